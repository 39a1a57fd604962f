"""Which way a call travels: the one interface every route answers (:class:`Route`), and
the one choice (:func:`choose`).

The call facade (:mod:`.facade`) asks :func:`choose` once per call, sends once through the
route it names (:meth:`Route.wait` for the main thread's ``rpc_sync``, which waits for its
answer itself; :meth:`Route.start` for every other call), and gets an :data:`Outcome`
back from any route: a value, the callee's error, or the route's own failure, which the
facade translates once (:func:`.errors.translate`). It never asks which route it holds;
what a route answers besides that (a lane's reply kept for TensorPipe, a call sent again)
stays inside the route, as httpx's retries stay inside its transport. The routes are
asked in the order they are registered (:mod:`nbrpc._calls`, one line each); the last,
TensorPipe, takes every call. A new route is a module and a registration.

Which call takes which route, and where its tensors go (decided here, in that order):

=====================================  ===============================================
a call                                 its route, and why
=====================================  ===============================================
``rpc_sync`` / ``rpc_async`` of a      **lane** (:mod:`.lane_route`): a small round trip
Python function or a builtin, in a     costs what the pipe and the pickling cost (about
local cluster with lanes on            0.2 ms, against 1 ms through TensorPipe). The main
                                       thread's ``rpc_sync`` writes on a lane of its own
                                       and reads the answer itself; every other call
                                       takes the peer's shared lane.
the same, by size                      tensor storages of 64 KB together ride in the
                                       frame (``LANE_TENSOR_BYTES``); a larger dense CPU
                                       storage goes into the sender's arena, the frame
                                       carrying its place (``shm.lend``, as the call is
                                       pickled), where the cluster shares memory (local,
                                       not ``--no-shm``), else the call is TensorPipe's;
                                       so is a call that pickles to over 1 GiB (a frame)
what the lanes leave out (their        **TensorPipe** (:mod:`.tensorpipe_route`), torch's
``Why``): lanes off (across hosts,     own path, which keeps what torch does there: it
``--no-fast-calls``) or paused, no     forks an RRef; distributed autograd and the
lane to the peer or the main one       profiler record the send; a nested call waits on
busy; a call from a thread serving     torch's pool, where the deadlock watch sees it;
one or from a lane's reader; an        torch completes an ``async_execution`` future;
``async_execution`` function; inside   device maps place a CUDA tensor the lane does not
a profiler or an autograd context;     stage (an ``rpc_async``'s, one no map places, one
an RRef, a tensor that requires grad,  over 64 KB); a function whose reply held a
a CUDA one not staged, arguments that  device's tensor answers that way anyway; torch's
do not pickle                          pickling says what does not pickle, in its words
the same, by size                      storages of the shared-memory threshold (1 MB) or
                                       more go into the sender's arena where the callee
                                       shares this host's memory (nbrpc's pickler makes
                                       them a place; ``shm.sending_to`` names the
                                       callee), the rest by TensorPipe's copy. A builtin
                                       goes as torch's TorchScript operator, unless an
                                       argument would take the arena
                                       (``shm.carries_any``), a timeline records, or no
                                       schema takes its arguments: then as a Python call
``remote()``                           **TensorPipe** always: torch makes the RRef (its
                                       arguments' storages as above)
a lane's reply it cannot carry (an     fetched by the lane's route through TensorPipe
RRef, a tensor that requires grad or   (the callee kept it); one with a device's tensor
is on a device, a large one without    also sends the function's later calls to that
shared memory, over 1 GiB); a call     worker through TensorPipe from the start; a call
the callee cannot unpickle             the callee could not unpickle goes again through
                                       TensorPipe, unrun, so its error is torch's
=====================================  ===============================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.rpc import WorkerInfo

from .errors import Sent

#: What a route gives back for one call, ``(value, error, failure)``: its value (then
#: ``None, None``); or ``error``, the callee's own exception (rebuilt here) or one nbrpc
#: made (the call's time ran out), raised as it is; or ``failure``, the route's own
#: (torch's error, a lost lane), which the facade translates. (A plain tuple: a small
#: call makes one, and a NamedTuple's took 0.2 µs more, measured.)
Outcome = tuple[Any, BaseException | None, BaseException | None]


#: what :meth:`Route.start` reports to: called once, with the call's outcome
Done = Callable[[Outcome], None]


class Route:
    """One way a call travels. A route writes :meth:`take`, :meth:`wait` and
    :meth:`start`; :meth:`in_flight` and :meth:`before_wait` have defaults.

    ``dest``: the callee's ``WorkerInfo``; ``sent``: the call, ``(func, args, kwargs)``;
    ``call``: what nbrpc keeps of it (its limit, the errors that name it)."""

    #: the route's name, as ``nbrpc.record()`` rows name it
    name = ""

    def take(
        self, dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, main: bool
    ) -> Any:
        """Whether this route takes the call: what it needs to send it (for :meth:`wait`
        or :meth:`start`, given back as ``taken``), or None, and the next route is asked.
        ``main``: the main thread's ``rpc_sync`` (then :meth:`wait` follows)."""
        raise NotImplementedError

    def wait(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent) -> Outcome:
        """Send the call and wait for its outcome, on the main thread: interruptible,
        serving a worker's debugger, on nbrpc's clock (``call.limit``; its time run out is
        ``(None, call.expired(), None)``). An error in sending it raises."""
        raise NotImplementedError

    def start(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent, done: Done) -> None:
        """Send the call; ``done(outcome)`` runs once when its outcome comes (on the
        route's thread). An error in sending it raises, and ``done`` is not called."""
        raise NotImplementedError

    def in_flight(self) -> int:
        """Calls this process started on this route that have not finished."""
        return 0

    def before_wait(self) -> None:
        """This thread is about to wait for a call (not the main thread, nor one of
        torch's RPC threads): what the route must do first (a lane's reader that runs a
        future's callback hands its reading over: the reply may come on that lane)."""


#: the routes, in the order :func:`choose` asks them (registered by :mod:`nbrpc._calls`)
ROUTES: list[Route] = []


def register(route: Route) -> None:
    """Ask ``route`` after those registered before it (the last must take every call)."""
    ROUTES.append(route)


def choose(
    dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, main: bool
) -> tuple[Route, Any]:
    """The route of a call of ``func`` to ``dest`` (``main``: the main thread's
    ``rpc_sync``), and what it took the call with (the module's table)."""
    for route in ROUTES:
        taken = route.take(dest, func, args, kwargs, main)
        if taken is not None:
            return route, taken
    raise LookupError(f"no route takes a call to {dest.name}: none registered takes every call")


def before_wait() -> None:
    """This thread is about to wait for a call: each route's :meth:`Route.before_wait`."""
    for route in ROUTES:
        route.before_wait()


def in_flight() -> int:
    """Calls this process started, on every route, that have not finished."""
    return sum(route.in_flight() for route in ROUTES)
