"""The calls a notebook makes: :mod:`.facade` (``rpc_sync``, ``rpc_async``, ``remote``: the
facade over torch's; it asks :mod:`nbrpc._wire.lanes` for a call's route once, a lane or
TensorPipe, waits and translates the answer), :mod:`.rrefs` (torch's RRef methods with
nbrpc's errors), :mod:`.spelling` (torch's own names routed to nbrpc's),
:mod:`.deadlock` (nested calls that use up the RPC threads, noticed and ended),
:mod:`.cancel` (the stop button: a cell's calls cancelled on every process, said in the
cell), :mod:`.scripts` (TorchScript functions a worker compiled)."""
