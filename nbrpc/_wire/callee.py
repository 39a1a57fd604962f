"""The callee side of a call: what runs around the function a peer asked for.

:func:`run_function` replaces torch's private ``_run_function`` hook (installed by
:mod:`nbrpc._wire.pickling`) and adds, around the user's function: its output forwarded to
the calling cell (:mod:`nbrpc._wire.output`), its failure sent back with type and traceback
(:mod:`nbrpc._wire.failures`), the hooks other features run as each call ends (the
debugger's), the reply's route when shared memory reaches some peers only
(:mod:`nbrpc._wire.shm`), and the count of user calls served that ``%rpc_status`` shows.
"""

from __future__ import annotations

import bdb
import inspect
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from nbrpc import _process, _torch
from nbrpc._errors import CallCancelledError, DebuggerQuitError, SerializationError

from . import cancelling, failures, native_output, output, recording, shm, stacks

# nbrpc's own RPCs (output, ledger, trace) and torch's (group membership, RRef type
# queries, shutdown) are not user calls: not counted.
_NOT_USER_CALLS = ("nbrpc.", *_torch.TORCH_OWN_CALL_MODULES)


@dataclass
class _Served:
    """User calls this process has served (running now, finished), and the hooks that
    run on the call's thread as each call ends."""

    in_flight: int = 0
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    after_call: list[Any] = field(default_factory=list)


_served = _Served()


class _Thread(threading.local):
    """``depth``: calls this thread serves now (nested: > 1); ``lane``: it is one of the
    lanes' own threads. Class defaults: asked on every call, and a missing attribute of a
    ``threading.local`` costs an exception inside ``getattr``."""

    depth = 0
    lane = False


_thread = _Thread()


def serving() -> bool:
    """Whether this thread is an RPC thread serving a call now (a call it makes is nested)."""
    return _thread.depth > 0


def holds_rpc_thread() -> bool:
    """Whether this thread serves a call on one of torch's RPC threads (whose pool a wait
    here can use up), not on one of the lanes' own threads (:mod:`.lanes`)."""
    return _thread.depth > 0 and not _thread.lane


def serve_lanes_here() -> None:
    """This thread is one of the lanes' own: its calls hold none of torch's RPC threads."""
    _thread.lane = True


class BuiltinArgumentError(TypeError, RuntimeError):
    """A torch operator called with arguments it does not take: the ``TypeError`` it raises
    locally, and the ``RuntimeError`` torch's RPC raises ("failed to match any schema")."""


def call_builtin(op: Any, args: tuple, kwargs: dict | None) -> Any:
    """Run a builtin sent as a Python call: one no TorchScript schema takes the arguments
    of (``torch.ones(3)``), or one with a large tensor for the shared-memory fast path, or
    one recorded on a timeline (``tensorpipe_route.python_call``)."""
    try:
        return op(*args, **(kwargs or {}))
    except TypeError as exc:
        if type(exc) is not TypeError or not getattr(op, "__module__", "").startswith("torch"):
            raise
        raise BuiltinArgumentError(
            f"Overloaded torch operator invoked from Python failed to match any schema: {exc}"
        ) from None


def as_python_call(func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """``(func, args, kwargs)`` as a Python call the callee runs: a builtin (which torch
    sends as a TorchScript operator) wrapped in :func:`call_builtin`, anything else as it
    is. The one place a builtin becomes a Python call, for either route that sends one:
    a lane always, TensorPipe where no schema takes the arguments
    (``tensorpipe_route.python_call``)."""
    if _torch.is_builtin(func):
        return call_builtin, (func, args, kwargs), None
    return func, args, kwargs


def is_user_call(func: Any) -> bool:
    """Whether a call of ``func`` runs the user's code (counted, recorded): not nbrpc's
    own calls nor torch's, except nbrpc's that run user code (``%%rpc`` cells)."""
    return (
        func is call_builtin
        or getattr(func, "user_call", False)
        or not (getattr(func, "__module__", "") or "").startswith(_NOT_USER_CALLS)
    )


def call_counts() -> dict[str, int]:
    """User calls served by this process: running now, and finished (ok or not)."""
    with _served.lock:
        return {"in_flight": _served.in_flight, "done": _served.done}


def after_call(hook: Any) -> None:
    """Run ``hook()`` on the call's thread at the end of every call (idempotent)."""
    if hook not in _served.after_call:
        _served.after_call.append(hook)


#: results no pickler sends (:func:`_unsendable`; none of these types can be subclassed)
_UNSENDABLE = frozenset({types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType})


def _unsendable(result: Any, func: Any) -> SerializationError | None:
    """The error for a result no pickler can send back, found before torch tries (it would
    fail in C++, and the caller get a RuntimeError with C++ frames): what to do instead."""
    name = getattr(func, "__qualname__", "the function")
    if inspect.iscoroutine(result):
        result.close()  # never awaited: no "coroutine was never awaited" warning here
        return SerializationError(
            f"{name} returned a coroutine: an `async def` function called by RPC returns one "
            "without running it, and a coroutine cannot be sent back. Make it a plain "
            "function, run it on the worker with asyncio.run(...), or return a "
            "torch.futures.Future from a function decorated @rpc.functions.async_execution."
        )
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        return SerializationError(
            f"{name} returned a generator, which cannot be sent back over RPC (it runs where "
            "it was made). Return list(...) of it, or keep it on the worker: "
            "nbrpc.remote(...) returns an RRef to the value."
        )
    return None


def run_function(python_udf: Any) -> Any:
    """Replaces ``torch.distributed.rpc.internal._run_function`` (called from C++)."""
    if shm.restricted():
        shm.expect_reply(None, None)  # one left by a call whose reply went another way
    _thread.depth += 1
    printed, interrupted = output.begin_call()
    _torch.quiet_optimizer_notice_if_loaded()  # DistributedOptimizer's, see there
    func = _torch.udf_function(python_udf)
    counted = is_user_call(func)
    if counted:
        with _served.lock:
            _served.in_flight += 1
    row = running = None
    header = recording.header_of(python_udf)  # its caller, and more (nbrpc._wire.recording)
    if counted:  # what this thread serves, for a stack dump; a row, while recording
        name = recording.function_name(func, python_udf.args, func is call_builtin)
        stacks.label(
            f"{name} from {header[1]} (call {header[0]})"
            if header and header[0]
            else f"{name} from {header[1] if header else 'a peer'}"
        )
        if recording.active() is not None:
            row = recording.begin(python_udf, name)
    result: Any = None
    raised: str | None = None
    try:
        if isinstance(python_udf, AttributeError):
            raise python_udf
        if counted and header and header[5] is not None:  # the stop button reaches it
            running = cancelling.running(header[5], name, header[1])
        try:
            if running is not None:
                cancelling.enter(running)
            result = _torch.run_udf(python_udf)
        finally:
            if running is not None:  # no interrupt fires after this (see cancelling); a
                # cancel from now on drops the output not sent yet (its end waits for it)
                cancelling.leave(running, printed.cancel if printed is not None else None)
        unsendable = _unsendable(result, func) if type(result) in _UNSENDABLE else None
        if unsendable is not None:
            raised = type(unsendable).__name__
            result = failures.failure(unsendable)  # no traceback: nothing of the user's raised
            return result
        if header and header[4] and not isinstance(result, torch.futures.Future):
            shm.expect_reply(result, header[1])  # pickled next, on this thread
        return result
    except bdb.BdbQuit:  # q in the debugger (nbrpc._debugger)
        quit_ = DebuggerQuitError(_process.name(), getattr(func, "__qualname__", "?"))
        raised = type(quit_).__name__
        result = failures.failure(quit_)
        return result
    except cancelling.Cancelled:  # its cell's calls were cancelled before it started
        cancelled = CallCancelledError(_process.name(), name, started=False)
        raised = type(cancelled).__name__
        result = failures.failure(cancelled)
        return result
    except BaseException as exc:  # sys.exit() or KeyboardInterrupt must not reach torch's C++
        error = exc
        if running is not None:
            cancelling.leave(running)  # the interrupt fired in the first leave, before it ended
            if running.interrupted:  # whatever it raised then: the stop button ended it
                error = CallCancelledError(_process.name(), running.name)
        raised = type(error).__name__
        result = failures.failure(error, keep=counted)
        if output.stderr_replaced():
            # where code replaced sys.stderr, it is logged there, as torch's callee does
            # (on the stream nbrpc set up, a calling cell would show it twice)
            print(result.msg, file=sys.stderr)
        return result
    finally:
        _thread.depth -= 1
        if counted:
            stacks.label(None)
        if row is not None:
            recording.end(row, result, raised)
        for hook in _served.after_call:
            hook()
        native_output.before_call_ends(printed)
        output.end_call(printed, interrupted, running is not None and running.interrupted)
        if running is not None:
            cancelling.drained(running)
        if counted:
            with _served.lock:
                _served.in_flight -= 1
                _served.done += 1
