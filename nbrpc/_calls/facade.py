"""The notebook-facing facade over ``torch.distributed.rpc`` calls.

Each function is torch's own (same arguments, same return types: a ``torch.futures.Future``,
a torch ``RRef``) with what a notebook needs in front: a clear error before init, an
unknown worker named together with the known ones, ``timeout=None`` for "the cluster's
default", and timeouts raised as :class:`~nbrpc.RpcTimeoutError` naming the call and the
worker. Notebook-defined code travels because :mod:`nbrpc._wire.pickling` is installed.

Timeouts are nbrpc's, not torch's: calls go to torch with no timeout and
:mod:`nbrpc._debugger.deadlines` fails them on a clock that stands still while a worker's
debugger is open (a person typing pdb commands must not see the call time out). While the
main thread waits on a call it also serves those debuggers' prompts (:mod:`nbrpc._debugger`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef, WorkerInfo

from nbrpc import _group, _ledger, _process, _states, _torch, _trace
from nbrpc._debugger import deadlines, prompts
from nbrpc._errors import (
    CallCancelledError,
    ClusterClosedError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
    WorkerDiedError,
    show_short,
    show_short_unless_rendered,
    shown_short,
)
from nbrpc._wire import callee, cancelling, failures, lanes, pickling, recording, shm

from . import cancel, deadlock, scripts

T = TypeVar("T")


@dataclass
class _Calls:
    """Set by the cluster layer: ``cancelled`` from the moment a non-graceful shutdown
    starts, so calls it cuts off say so instead of "worker died"; ``last_output``: what a
    dead worker printed last, by name, for its WorkerDiedError. Which workers are dead is
    :mod:`nbrpc._states`' to say (``_states.unreachable``): their calls fail here, unsent
    (torch logs a C++ error line for every one it tries to send to a closed pipe)."""

    cancelled: bool = False
    last_output: Callable[[str], str] | None = None
    #: ranks of processes a restart replaced, or that left at a scale -> (their name, when
    #: they left at the scale, or "" for a restart): what they owned is gone
    gone: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: a name or rank -> its WorkerInfo, found once per membership (torch's lookup lets go
    #: of the GIL: where other threads want it, a call waited ~20 µs for it back, measured)
    infos: dict[Any, WorkerInfo] = field(default_factory=dict)
    #: workers nbrpc makes leave at a scale -> why: a call they cut off says so
    leaving: dict[str, str] = field(default_factory=dict)
    infos_of: Any = None  # the agent they are of (kept alive: its identity is checked)
    infos_at: int = -1  # and the membership changes they were found after


_calls = _Calls()
#: the main thread's ident (a forked worker's main thread is another thread)
_main = threading.main_thread().ident


def _after_fork() -> None:
    global _main
    _main = threading.main_thread().ident


# after threading's own handler, which makes the forking thread the child's main thread
os.register_at_fork(after_in_child=_after_fork)


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
                else:  # a future's callback on a lane's reader: the reply may come there
                    lanes.hand_over_reading()
            return super().wait()
        except BaseException as kept:
            if isinstance(kept, KeyboardInterrupt):  # the stop button, between two waits
                show_short(kept)  # the cell's lines, not this frame
            error = failures.raisable(kept)  # the future keeps ``kept`` (see there)
        show_short_unless_rendered(error)  # torch's own error: short too
        raise error


def set_active(active: bool, last_output: Callable[[str], str] | None = None) -> None:
    """A cluster is up (calls may go out) or not; ``last_output`` names what a dead
    worker printed last."""
    _group.set_active(active)
    _calls.last_output = last_output if active else None
    _calls.infos.clear()
    if active:
        _calls.cancelled = False
        scripts.forget()  # a new cluster's workers compiled no TorchScript function yet


def on_worker_change(change: _states.WorkerChange) -> None:
    """A listener of :mod:`nbrpc._states` (registered by the lifecycle): the old ranks of
    workers a restart replaces are remembered (what they owned is gone), and the workers'
    ``WorkerInfo`` is looked up afresh after a restart, a scale or a death."""
    if change.kind is _states.Change.LEAVING and change.detail:  # a scale's leavers
        _calls.leaving.update(dict.fromkeys(change.names, change.detail))
        return
    if change.kind in (_states.Change.JOINED, _states.Change.REJOINED):
        for name in change.names:
            _calls.leaving.pop(name, None)
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
    _calls.cancelled = True


def calls_in_flight() -> int:
    """Calls this process started that have not finished (torch's own count)."""
    metrics = _torch.agent().get_metrics()
    return int(metrics.get("agent.client_active_calls", 0)) + lanes.in_flight()


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
        raise WorkerDiedError(to, _states.unreachable[to], _last_output(to))
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
                raise WorkerDiedError(info.name, why, _last_output(info.name))
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


def _name_of(func: Any) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__


def timeout_error(
    exc: BaseException | None, what: str, dest: str, timeout: float | None
) -> RpcTimeoutError:
    seconds = rpc.get_rpc_timeout() if timeout is None else timeout
    limit = f"{seconds:g} s" + (" (default)" if timeout is None else "")
    return RpcTimeoutError(  # torch's own words too, which code written for torch matches
        f"{what} on {dest} timed out after {limit} (RPC ran for more than the set timeout, "
        f"{seconds * 1000:.0f} ms); it may still be running there. Pass "
        "timeout=SECONDS (0 waits forever) or start the cluster with a larger --timeout."
        + (f" torch said: {exc}" if exc is not None else "")
    )


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
    # the main thread waits on torch's future, or on its lane, itself and settles it here.
    dest = _destination(to, "rpc_sync")  # (bad input fails here, before anything is sent)
    limit = limit_of(timeout)
    sent = (func, tuple(args), kwargs)
    way = lanes.route(dest, func, sent[1], kwargs, main=True)
    if way.lane is None:
        value, error = _sync_through_torch(dest, sent, Sent(dest.name, func, limit, timeout))
    else:
        try:
            reply = way.lane.ask(way.payload, limit, prompts.wait_in_slices_on_main_thread)
        except KeyboardInterrupt as stop:  # the stop button: the cell's lines, not nbrpc's
            show_short(stop)
            raise
        if reply is not None and reply.kind == lanes.VALUE:  # the answer, or its error
            value, error = failures.returned(reply.got)
        else:
            call = Sent(dest.name, func, limit, timeout)
            value, error, resend = _outcome(reply, dest, sent, call)
            if resend is not None:
                value, error = _sync_through_torch(dest, resend, call)
    if error is not None:
        raise error
    return value


def _sync_through_torch(dest: WorkerInfo, sent: tuple, call: Sent) -> tuple[Any, Any]:
    raw = _send_to(dest, sent[0], sent[1], sent[2], sync=True)
    if not prompts.wait_on_main_thread(raw, call.limit):
        return None, call.expired()
    return failures.outcome(raw, call.translate)


def _outcome(
    reply: lanes.Reply | None, dest: WorkerInfo, sent: tuple, call: Sent
) -> tuple[Any, Any, tuple | None]:
    """A lane's reply (None: the call's time ran out) as ``(value, error, None)``, or as
    ``(None, None, the call TensorPipe carries instead)``: the reply the callee kept, or
    the call again (the callee could not unpickle it). A reply kept because it holds a
    CUDA tensor sends the function's later calls to ``dest`` through TensorPipe."""
    if reply is None:
        return None, call.expired(), None
    if reply.lost is not None:
        return None, call.translate(reply.lost), None
    if reply.unreadable is not None:  # as TensorPipe's reply that does not unpickle here
        return None, call.translate(reply.unreadable), None
    if reply.kind == lanes.ON_DEVICE:
        lanes.answered_on_device(dest, sent[0])
    resend = reply.through_torch(sent)
    if resend is not None:
        return None, None, resend
    value, error = failures.returned(reply.got)
    return value, error, None


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


class Sent:
    """A call torch has started: the limit in seconds nbrpc keeps, and the errors that
    name the call and its worker. Not its future: a deadline holds ``expired`` for the
    length of the timeout, and must not keep a finished call's result alive."""

    __slots__ = ("dest", "func", "limit", "timeout")

    def __init__(self, dest: str, func: Any, limit: float, timeout: float | None) -> None:
        self.dest, self.func, self.limit, self.timeout = dest, func, limit, timeout

    @property
    def what(self) -> str:
        """The call, as its errors name it (made only for an error)."""
        return f"call of {_name_of(self.func)}"

    def translate(self, exc: BaseException) -> Any:
        return translate(exc, self.what, self.dest, self.timeout)

    def expired(self) -> RpcTimeoutError:
        return timeout_error(None, self.what, self.dest, self.timeout)


def _addressed(what: str, to: Any, func: Any, timeout: float | None) -> tuple[WorkerInfo, Sent]:
    """The worker ``to`` names (bad input fails here, before anything is sent) and what
    nbrpc keeps of a call of ``func`` to it."""
    dest = _destination(to, what)
    return dest, Sent(dest.name, func, limit_of(timeout), timeout)


def _send_to(
    dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, sync: bool = False
) -> torch.futures.Future:
    """Start the call with torch: its raw future (torch's errors); ``sync``: as torch's
    ``rpc_sync`` starts it (its profiler's event says so)."""
    _trace.note_call(dest.id, func, args, kwargs)  # what the hang check's shape remembers
    sent, args, kwargs = _as_python_call(func, tuple(args), kwargs)
    scripts.ensure_on(dest.name, func)  # a notebook's TorchScript function: compiled there
    send = _torch.rpc_sync_started if sync else _torch.rpc_async
    # torch's timeout: none (nbrpc's clock keeps it); the stop button waits for the send:
    # pressed once an RRef in it was pickled (a fork torch waits for), every shutdown waited
    with shm.sending_to(dest.name), _process.interrupts_deferred():
        return send(dest, sent, args, kwargs, 0)


def start_call(
    what: str, to: Any, func: Any, args: tuple, kwargs: dict | None, timeout: float | None
) -> torch.futures.Future:
    """Start a call, on a lane if it takes one (:mod:`nbrpc._wire.lanes`), else with
    torch; its future, settled with nbrpc's errors. Bad input fails before anything is sent."""
    dest, call = _addressed(what, to, func, timeout)
    out = Future()
    out.dest = call.dest
    sent = (func, tuple(args), kwargs)
    cancelling.forget_last()
    way = lanes.route(dest, func, sent[1], kwargs, main=False)
    if way.lane is None:
        _settle_through_torch(dest, sent, call, out, sync=what == "rpc_sync")
    else:
        way.lane.post(way.payload, lambda reply: settle_from_lane(reply, dest, sent, call, out))
    out.origin = cancelling.last_origin()  # what nbrpc.cancel(out) cancels
    if call.limit > 0:
        deadlines.expire_after(call.limit, out, call.expired)
    return out


def settle_from_lane(
    reply: lanes.Reply, dest: WorkerInfo, sent: tuple, call: Sent, out: Future
) -> None:
    """Finish ``out`` with a lane's reply (on the lane's reader thread, or the caller's
    when the lane was lost as the call left). A call fetched or sent again through
    TensorPipe that torch refuses to start (the worker died meanwhile, a device map)
    fails ``out`` with that error: the reader thread, which has already let go of this
    call, would end on it, and ``out`` would wait forever."""
    try:
        value, error, resend = _outcome(reply, dest, sent, call)
        if resend is None:
            failures.complete(out, value, error)
        else:  # fetched, or sent again, through TensorPipe (no wait on this thread)
            _settle_through_torch(dest, resend, call, out)
    except Exception as exc:
        failures.complete(out, error=call.translate(exc))


def _settle_through_torch(
    dest: WorkerInfo, sent: tuple, call: Sent, out: Future, sync: bool = False
) -> None:
    """Send ``sent`` with torch (``sync``: as its ``rpc_sync``); its answer finishes ``out``
    (nbrpc's errors)."""
    raw = _send_to(dest, sent[0], sent[1], sent[2], sync=sync)
    raw.add_done_callback(lambda done: _settle(done, out, call))


def _settle(raw: torch.futures.Future, out: Future, call: Sent) -> None:
    """Finish ``out`` from torch's finished future ``raw``. With CUDA devices, ``raw`` is
    CUDA-aware: this callback runs on streams that wait for the reply's copies, and
    ``out`` (nbrpc's, not CUDA-aware) is waited on from other streams; those copies
    finish first, so a CUDA tensor in ``out``'s value is ready on any stream."""
    try:
        for device in _group.cuda_devices():
            torch.cuda.current_stream(device).synchronize()
    except Exception as exc:  # CUDA failing: the call's error, not a future left waiting
        failures.complete(out, error=exc)
        return
    failures.settle(raw, out, call.translate)


def translate(exc: BaseException, what: str, dest: str, timeout: float | None) -> Any:
    """torch's error for ``what`` (``"call of f"``) on worker ``dest``, as the nbrpc error
    that names the problem and the fix; other errors are returned as they are."""
    if _torch.is_timeout(exc):
        return timeout_error(exc, what, dest, timeout)
    here = _torch.missing_module_here(exc)
    if here:
        return SerializationError(
            f"this process cannot import module {here!r}, which the reply to the {what} "
            f"on {dest} needs: {dest} returned an object of a class from that module, and a "
            f"class from an importable module travels by reference. Install {here} here "
            "too, or return plain values (numbers, lists, dicts, tensors) from the function."
        )
    missing = _torch.missing_module(exc)
    if missing:
        return SerializationError(
            f"{dest} cannot import module {missing!r}, which the {what} needs: code from "
            f"an importable module travels by reference. Install {missing} on the workers, "
            "or send it by value with "
            f"nbrpc.register_by_value({missing.split('.')[0]}) before the call."
        )
    undefined = _torch.undefined_script_function(exc)
    if undefined and not any("%%rpc" in note for note in getattr(exc, "__notes__", ())):
        exc.add_note(  # torch's error as it is (its type and words), and nbrpc's fix
            f"nbrpc: {dest} does not know the TorchScript function {undefined}. A function "
            "compiled with @torch.jit.script in this kernel is compiled here only: run its "
            "cell on the workers too (%%rpc as the cell's first line, the imports it needs "
            "in it), then call it."
        )
        return exc
    unsent = _torch.serialization_failure(exc)
    if unsent:
        return SerializationError(f"{unsent} (the {what} on {dest})")
    if _torch.is_connection_loss(exc) or isinstance(exc, lanes.LaneLost):
        if _calls.cancelled:
            return ClusterClosedError(
                f"{what} on {dest} was cancelled: the cluster was "
                "shut down with graceful=False while it ran. Use a graceful shutdown "
                "(the default) to let calls in flight finish."
            )
        if dest in _calls.leaving:  # a forced scale's leaver, whose call could not stop
            return CallCancelledError(dest, what, True, _calls.leaving[dest])
        detail = f"its connection closed; torch said: {str(exc).splitlines()[0]}"
        _states.mark_dead(dest, detail)  # the owner of its state: calls to it now fail at once
        return WorkerDiedError(dest, detail, _last_output(dest))
    return exc


def _last_output(dest: str) -> str:
    last_output = _calls.last_output
    try:
        return last_output(dest) if last_output is not None else ""
    except Exception:  # an error message must not fail while it is being written
        return ""


def _as_python_call(func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """What works locally works remotely: a builtin goes as torch sends it where it can,
    else as the Python call it is.

    torch sends builtins (``torch.add``, ``torch.ones``, Python's ``dict``) as TorchScript
    operators matched against a schema on the callee, and ``remote()`` of one makes a typed
    ``RRef[Tensor]`` that TorchScript code takes. Where no schema takes the arguments
    (``torch.ones(3)``, ``dict(k=1)``: "failed to match any schema", although they work
    locally), nbrpc sends a Python call instead, checked here first; and so it does where a
    large tensor would take the shared-memory fast path, or while a timeline records (the
    Python call is what names the row). A CUDA argument the kernel refuses
    (:func:`nbrpc._wire.pickling.refuse_devices`) is refused here for what does not go
    through nbrpc's pickler: builtins sent as TorchScript operators, TorchScript functions.
    """
    if isinstance(func, FunctionType | MethodType):
        return func, args, kwargs  # nbrpc's pickler sees all it sends
    arguments = (*args, *(kwargs or {}).values())
    pickling.refuse_here(arguments)  # a builtin's or TorchScript's arguments: not pickled
    if not _torch.is_builtin(func):
        return func, args, kwargs
    native = (
        recording.active() is None
        and not shm.carries_any(arguments)
        and _torch.builtin_accepts(func, args, kwargs)
    )
    if native:
        return func, args, kwargs
    return callee.call_builtin, (func, args, kwargs), None


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
    _trace.note_call(dest.id, func, tuple(args), kwargs)
    sent, args, kwargs = _as_python_call(func, tuple(args), kwargs)
    scripts.ensure_on(dest.name, func)
    limit = 0 if timeout is None else limit_of(timeout)
    try:
        with shm.sending_to(dest.name, "remote"), _process.interrupts_deferred():  # (_send_to)
            rref = _torch.remote(dest, sent, args=args, kwargs=kwargs, timeout=limit)
    except Exception as exc:  # a lost connection at send time
        error = translate(exc, f"remote call of {_name_of(func)}", dest.name, timeout)
        if error is exc:
            raise
        raise error from None
    if sent is not func:  # a builtin sent as a Python call: the ownership view names it
        _ledger.label(rref, dest, func)
    return rref


def given(timeout: float) -> float | None:
    """torch's "the default timeout" (``UNSET_RPC_TIMEOUT``) is nbrpc's ``None``."""
    return None if timeout == _torch.UNSET_RPC_TIMEOUT else timeout
