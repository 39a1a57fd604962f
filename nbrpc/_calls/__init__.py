"""The calls a notebook makes: :mod:`.facade` (``rpc_sync``, ``rpc_async``, ``remote``: the
facade over torch's; it asks :mod:`.routes` for a call's route once, sends once and
translates the answer once, :mod:`.errors`), the routes (:mod:`.lane_route`,
:mod:`.tensorpipe_route`), :mod:`.rrefs` (torch's RRef methods with nbrpc's errors),
:mod:`.spelling` (torch's own names routed to nbrpc's), :mod:`.deadlock` (nested calls
that use up the RPC threads, noticed and ended), :mod:`.cancel` (the stop button: a cell's
calls cancelled on every process, said in the cell), :mod:`.scripts` (TorchScript
functions a worker compiled).

The routes, registered here in the order :func:`.routes.choose` asks them (a new route is
a module and a line here): a lane where the lanes take the call, then TensorPipe, which
takes every call.
"""

from . import lane_route, routes, tensorpipe_route

routes.register(lane_route.LaneRoute())
routes.register(tensorpipe_route.TensorPipeRoute())
