"""The notebook-facing facade over ``torch.distributed.rpc`` calls.

Each function is torch's own (same arguments, same return types: a ``torch.futures.Future``,
a torch ``RRef``) with what a notebook needs in front: a clear error before init, an
unknown worker named together with the known ones, ``timeout=None`` for "the cluster's
default", and timeouts raised as :class:`~nbrpc.RpcTimeoutError` naming the call and the
worker. Notebook-defined code travels because :mod:`nbrpc._wire.pickling` is installed.

Each call asks for its route once (:func:`.routes.choose`: a lane or TensorPipe, the
table there), sends once through it and translates what comes back once (:func:`_result`,
:func:`.errors.translate`), for ``rpc_sync`` and ``rpc_async`` alike; it never asks which
route it holds. Timeouts are nbrpc's, not torch's: calls go to torch with no timeout and
:mod:`nbrpc._debugger.deadlines` fails them on a clock that stands still while a worker's
debugger is open (a person typing pdb commands must not see the call time out). While the
main thread waits on a call it also serves those debuggers' prompts (:mod:`nbrpc._debugger`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef, WorkerInfo

from nbrpc import _fork, _group, _states, _torch
from nbrpc._debugger import deadlines, prompts
from nbrpc._errors import (
    UnknownWorkerError,
    WorkerDiedError,
    show_short,
    show_short_unless_rendered,
    shown_short,
)
from nbrpc._wire import callee, cancelling, failures

from . import cancel, deadlock, errors, routes, scripts, tensorpipe_route
from .errors import Sent, translate
from .routes import Outcome

T = TypeVar("T")


@dataclass
class _Calls:
    """What the facade knows of the cluster's workers, set by the cluster layer (what the
    errors say beyond that: :data:`.errors.known`). Which workers are dead is
    :mod:`nbrpc._states`' to say (``_states.unreachable``): their calls fail here, unsent
    (torch logs a C++ error line for every one it tries to send to a closed pipe)."""

    #: ranks of processes a restart replaced, or that left at a scale -> (their name, when
    #: they left at the scale, or "" for a restart): what they owned is gone
    gone: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: a name or rank -> its WorkerInfo, found once per membership (torch's lookup lets go
    #: of the GIL: where other threads want it, a call waited ~20 µs for it back, measured)
    infos: dict[Any, WorkerInfo] = field(default_factory=dict)
    infos_of: Any = None  # the agent they are of (kept alive: its identity is checked)
    infos_at: int = -1  # and the membership changes they were found after


_calls = _Calls()
#: the main thread's ident (a forked worker's main thread is another thread)
_main = threading.main_thread().ident


def _after_fork() -> None:
    global _main
    _main = threading.main_thread().ident


# after threading's own handler, which makes the forking thread the child's main thread
_fork.in_child(_after_fork)


class Future(torch.futures.Future):
    """torch's Future, whose ``wait()`` the notebook's stop button can interrupt, and
    during which a worker's debugger can ask the notebook for commands.

    torch's own ``wait()`` blocks in C++, where Python cannot deliver SIGINT: a
    KeyboardInterrupt would only arrive when the remote call ends. On the main thread
    this waits on a ``threading.Event`` instead
    (:func:`nbrpc._debugger.prompts.wait_on_main_thread`).
    """

    #: the worker the call went to (set by rpc_async)
    dest: str = ""
    #: the call's origin (nbrpc._wire.cancelling), for nbrpc.cancel; None: not cancellable
    origin: int | None = None

    def cancel(self) -> bool:
        """Cancel the call where it runs, with the calls it made (``nbrpc.cancel``); True
        if it had not finished. ``wait()`` then raises :class:`~nbrpc.CallCancelledError`."""
        return cancel.cancel(self) == 1

    def wait(self) -> Any:
        try:
            if not self.done():
                if threading.current_thread() is threading.main_thread():
                    prompts.wait_on_main_thread(self)
                elif callee.holds_rpc_thread():  # a call made inside a call, on torch's pool
                    with deadlock.waiting(self.dest, self):
                        return super().wait()
                else:  # e.g. a future's callback on a lane's reader: the reply may come there
                    routes.before_wait()
            return super().wait()
        except BaseException as kept:
            if isinstance(kept, KeyboardInterrupt):  # the stop button, between two waits
                show_short(kept)  # the cell's lines, not this frame
            error = failures.raisable(kept)  # the future keeps ``kept`` (see there)
        show_short_unless_rendered(error)  # torch's own error: short too
        raise error


def new_future(dest: str) -> Future:
    """The future nbrpc hands out for a call to ``dest``. Where this process lends CUDA
    devices to the cluster it is CUDA-aware, as torch's RPC futures are: its value's CUDA
    tensors are ready on the stream that completed it (``set_result`` records an event
    there), a ``then`` callback runs on fresh streams that wait for that event, and
    ``wait()`` makes the waiter's current stream wait for the callback's work. A plain
    future would hand a callback's in-place write to a waiter on another stream
    unfinished (issue 63's risk 1)."""
    out = Future(devices=list(_group.cuda_devices()) or None)
    out.dest = dest
    return out


def set_active(active: bool, last_output: Callable[[str], str] | None = None) -> None:
    """A cluster is up (calls may go out) or not; ``last_output`` names what a dead
    worker printed last."""
    _group.set_active(active)
    errors.known.last_output = last_output if active else None
    _calls.infos.clear()
    if active:
        errors.known.cancelled = False
        scripts.forget()  # a new cluster's workers compiled no TorchScript function yet


def on_worker_change(change: _states.WorkerChange) -> None:
    """A listener of :mod:`nbrpc._states` (registered by the lifecycle): the old ranks of
    workers a restart replaces are remembered (what they owned is gone), and the workers'
    ``WorkerInfo`` is looked up afresh after a restart, a scale or a death."""
    if change.kind is _states.Change.LEAVING and change.detail:  # a scale's leavers
        errors.known.leaving.update(dict.fromkeys(change.names, change.detail))
        return
    if change.kind in (_states.Change.JOINED, _states.Change.REJOINED):
        for name in change.names:
            errors.known.leaving.pop(name, None)
    if change.kind is _states.Change.LEFT and (change.replaced or change.at):
        for name, rank in zip(change.names, change.ranks, strict=True):
            _calls.gone[rank] = (name, change.at)
        scripts.forget(change.names)  # a fresh process of that name compiled nothing yet
    elif change.kind not in (_states.Change.REJOINED, _states.Change.DIED, _states.Change.JOINED):
        return
    _calls.infos.clear()


def gone_error(rank: int) -> WorkerDiedError | None:
    """The error for what the process of torch rank ``rank`` owned, if a restart replaced
    it or it left at a scale (None: neither)."""
    gone = _calls.gone.get(rank)
    if gone is None:
        return None
    name, at = gone
    return WorkerDiedError(name, left_at=at) if at else WorkerDiedError(name, restarted=rank)


def cancel_calls_in_flight() -> None:
    """A non-graceful shutdown begins: calls it cuts off fail as cancelled."""
    errors.known.cancelled = True


def calls_in_flight() -> int:
    """Calls this process started that have not finished (each route's count: torch's
    own, the lanes')."""
    return routes.in_flight()


def _destination(to: str | WorkerInfo | int, what: str) -> WorkerInfo:
    """The worker ``to`` names, as torch takes it: a name, a rank or a ``WorkerInfo``."""
    kind = type(to)
    if kind is str or kind is int:  # a name or rank found before, in this membership
        info = _calls.infos.get(to)  # (emptied as a cluster starts, ends or changes)
        if (
            info is not None
            and _calls.infos_of is _torch.agent()
            and _calls.infos_at == _torch.membership_changes()
            and info.name not in _states.unreachable
        ):
            return info
    _group.require_active(what)
    if isinstance(to, WorkerInfo):
        gone = gone_error(to.id)
        if gone is not None:
            if gone.left_at:  # a call to a worker that left: as to its name
                raise UnknownWorkerError(to.name, _group.member_names(), gone.left_at)
            raise gone
        return to
    if isinstance(to, str) and to in _states.unreachable:  # dead, or being restarted
        raise WorkerDiedError(to, _states.unreachable[to], errors.last_output(to))
    if isinstance(to, str | int) and not isinstance(to, bool):
        agent = _torch.agent()
        changes = _torch.membership_changes()
        if agent is not _calls.infos_of or _calls.infos_at != changes:
            _calls.infos.clear()  # torch's RPC started again (its own init_rpc), or a peer
            _calls.infos_of, _calls.infos_at = agent, changes  # joined or left
        info = _calls.infos.get(to)
        try:  # one lookup in the agent's table; the full list only for the error
            if info is None:
                info = _calls.infos[to] = agent.get_worker_info(to)
        except RuntimeError:
            pass
        else:
            if info.name in _states.unreachable:
                why = _states.unreachable[info.name]
                raise WorkerDiedError(info.name, why, errors.last_output(info.name))
            return info
    raise UnknownWorkerError(to, _group.member_names(), _states.departed.get(str(to), ""))


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """torch's ``WorkerInfo`` (name and id) of a worker, or of this process.

    ``worker_name``: a worker's name or rank; ``None``: this process. Raises
    :class:`~nbrpc.NotInitializedError` before a cluster runs,
    :class:`~nbrpc.UnknownWorkerError` for a name or rank not in the group and
    :class:`~nbrpc.WorkerDiedError` for a worker whose process is gone.
    """
    if worker_name is None:
        _group.require_active("nbrpc.get_worker_info()")
        return rpc.get_worker_info()
    return _destination(worker_name, "nbrpc.get_worker_info()")


def limit_of(timeout: float | None) -> float:
    """A call's timeout in seconds (0: none), the cluster's default for None."""
    return rpc.get_rpc_timeout() if timeout is None else max(float(timeout), 0.0)


@shown_short
def rpc_sync(
    to: str | WorkerInfo | int,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    ``to``: the worker, by name (``"worker1"``), rank or torch's ``WorkerInfo``.
    ``func``: any callable; one defined in the notebook (function, lambda, closure,
    class) travels by value. ``args`` and ``kwargs``: its arguments
    (tensors travel beside the pickle, large CPU ones through shared memory on one host).
    ``timeout``: seconds to wait for the result (``0``: no limit; ``None``: the cluster's
    ``rpc_timeout``, 60 s by default).

    Raises the exception ``func`` raised on the worker, with its own type and the
    worker's traceback (:class:`~nbrpc.RemoteError` when that type cannot be rebuilt
    here); :class:`~nbrpc.NotInitializedError` before a cluster runs;
    :class:`~nbrpc.UnknownWorkerError` for a ``to`` that is not in the group;
    :class:`~nbrpc.WorkerDiedError` when the worker's process is gone;
    :class:`~nbrpc.RpcTimeoutError` after ``timeout``; :class:`~nbrpc.SerializationError`
    for an argument or a result that cannot travel; :class:`~nbrpc.CallCancelledError`
    when the stop button (or :func:`nbrpc.cancel`) cancels the call.
    """
    if threading.get_ident() != _main:
        return start_call("rpc_sync", to, func, args, kwargs, timeout).wait()
    # The notebook's case, without the future rpc_async returns (measured ~40 µs a call):
    # the main thread waits for the call's outcome itself, on its route.
    dest = _destination(to, "rpc_sync")  # (bad input fails here, before anything is sent)
    call = Sent(dest.name, func, limit_of(timeout), timeout)
    sent = (func, tuple(args), kwargs)
    route, taken = routes.choose(dest, func, sent[1], kwargs, main=True)
    value, error = _result(route.wait(taken, dest, sent, call), call)
    if error is not None:
        raise error
    return value


def _result(outcome: Outcome, call: Sent) -> tuple[Any, BaseException | None]:
    """A route's outcome as the call's ``(value, error)``: the route's own failure
    translated, here only (for ``rpc_sync`` and ``rpc_async`` alike); the callee's error
    as it is."""
    value, error, failure = outcome
    if failure is not None:
        return None, call.translate(failure)
    return value, error


@shown_short
def rpc_async(
    to: str | WorkerInfo | int,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> torch.futures.Future[T]:
    """Start ``func(*args, **kwargs)`` on worker ``to``; return a ``torch.futures.Future``.

    Takes what :func:`rpc_sync` takes, meaning the same: ``to``, ``func``, ``args``,
    ``kwargs`` and ``timeout``.

    ``NotInitializedError`` and ``UnknownWorkerError`` are raised here, before anything is
    sent; every other error of :func:`rpc_sync` is raised by the future's ``wait()``
    (``.value()`` too). The stop button interrupts a ``wait()`` and cancels the call on
    the worker (``fut.cancel()`` or :func:`nbrpc.cancel` do so from code).
    """
    fut = start_call("rpc_async", to, func, args, kwargs, timeout)
    _torch.list_future(fut)  # inside torch's _wait_all() block: waited for at its end
    return fut


def _addressed(what: str, to: Any, func: Any, timeout: float | None) -> tuple[WorkerInfo, Sent]:
    """The worker ``to`` names (bad input fails here, before anything is sent) and what
    nbrpc keeps of a call of ``func`` to it (``what``: ``"rpc_sync"``, as torch's starts)."""
    dest = _destination(to, what)
    return dest, Sent(dest.name, func, limit_of(timeout), timeout, sync=what == "rpc_sync")


def start_call(
    what: str, to: Any, func: Any, args: tuple, kwargs: dict | None, timeout: float | None
) -> torch.futures.Future:
    """Start a call on its route (:func:`.routes.choose`); its future, settled with
    nbrpc's errors. Bad input fails before anything is sent."""
    dest, call = _addressed(what, to, func, timeout)
    out = new_future(call.dest)
    sent = (func, tuple(args), kwargs)
    cancelling.forget_last()
    route, taken = routes.choose(dest, func, sent[1], kwargs, main=False)
    route.start(taken, dest, sent, call, settles(out, call))
    out.origin = cancelling.last_origin()  # what nbrpc.cancel(out) cancels
    if call.limit > 0:
        deadlines.expire_after(call.limit, out, call.expired)
    return out


def settles(out: torch.futures.Future, call: Sent) -> routes.Done:
    """What finishes ``out`` with a route's outcome of ``call`` (:func:`_result`), unless
    its deadline failed it first."""

    def done(outcome: Outcome) -> None:
        value, error = _result(outcome, call)
        failures.complete(out, value, error)

    return done


@shown_short
def remote(
    to: str | WorkerInfo | int,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> RRef[T]:
    """Run ``func`` on ``to`` and keep the result there; return an ``RRef`` to it.

    ``to``, ``func``, ``args`` and ``kwargs`` as for :func:`rpc_sync`. The worker owns the
    value; the RRef is torch's (``to_here()``, ``owner()``, ``local_value()`` on the
    owner, the ``rpc_sync()``/``rpc_async()``/``remote()`` proxies).

    Errors come as from :func:`rpc_sync`: ``to_here()`` on an RRef whose call failed
    raises the worker's exception, a timeout is an :class:`~nbrpc.RpcTimeoutError`.
    ``NotInitializedError`` and ``UnknownWorkerError`` are raised here, before anything is
    sent. Without ``timeout`` the creation has none: ``to_here()`` keeps the clock (paused
    while a debugger is open); with one, torch enforces it on the creation.
    """
    dest = _destination(to, "remote")
    limit = 0 if timeout is None else limit_of(timeout)
    rref, _, failure = tensorpipe_route.remote(dest, func, tuple(args), kwargs, limit)
    if failure is not None:  # a lost connection at send time
        error = translate(failure, f"remote call of {errors.name_of(func)}", dest.name, timeout)
        if error is failure:
            raise failure
        raise error from None
    return rref


def given(timeout: float) -> float | None:
    """torch's "the default timeout" (``UNSET_RPC_TIMEOUT``) is nbrpc's ``None``."""
    return None if timeout == _torch.UNSET_RPC_TIMEOUT else timeout
