"""What happens around a call on the callee, and how its failure comes back.

Two things a notebook user expects from a remote call that torch RPC does not give:

* ``print()`` inside the call shows in the calling cell. On workers, ``sys.stdout`` and
  ``sys.stderr`` are wrapped once (:func:`forward_output_to`); while a thread runs an RPC
  call its writes are sent, line by line, to the notebook kernel (an ``rpc_async`` to
  :func:`show_output`), prefixed with the worker's name. Before the call returns, the
  pending lines are awaited, so output arrives before the result does.
* An exception keeps its type and its traceback. torch sends only ``repr(e)`` plus a
  traceback string and rebuilds ``type(e)(that_string)``. nbrpc sends the exception
  itself (pickled, when it can be), and the traceback as frames. The caller formats those
  frames with *its own* ``linecache``, which holds the notebook cells, so the remote
  traceback shows the line of notebook source that raised.

* The last failure is kept for a post-mortem. A worker keeps the exception of its last
  failed user call, traceback and frames included (one: memory stays bounded), under an
  id that travels with the failure; the kernel remembers the last failure it received.
  ``%rpc_debug`` (:mod:`nbrpc._postmortem`) joins the two.

``run_function`` and ``handle_exception`` replace torch's private hooks of the same role;
:mod:`nbrpc._pickling` installs them.
"""

from __future__ import annotations

import bdb
import collections
import itertools
import linecache
import os
import pickle
import re
import sys
import threading
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed.rpc as rpc

from . import _shm, _torch
from ._errors import DebuggerQuitError, RemoteError
from ._torch import RemoteException

__all__ = [
    "after_call",
    "call_builtin",
    "call_counts",
    "calling",
    "drain_output",
    "forward_output_to",
    "handle_exception",
    "kept_failure",
    "kernel_name",
    "last_seen_failure",
    "run_function",
    "settle",
    "show_output",
    "worker_name",
]

_call = threading.local()  # .output: the _CallOutput of the RPC call running on this thread
_forward: dict[str, str] = {}  # {"to": kernel name, "me": this worker's name}
_OUTPUT_WAIT_S = 10.0


class _FailureText(str):
    """The message of a RemoteException, carrying what the caller needs to rebuild it.

    A ``str`` subclass, so torch's own handler (and any process without nbrpc's hooks)
    still sees a plain message.
    """

    worker: str
    ename: str
    evalue: str
    frames: list[tuple[str, int, str, str | None]]
    exc_bytes: bytes | None
    failure_id: str | None  # under which the worker keeps it for a post-mortem

    def __new__(cls, text, worker, ename, evalue, frames, exc_bytes, failure_id=None):
        self = super().__new__(cls, text)
        self.worker, self.ename, self.evalue = worker, ename, evalue
        self.frames, self.exc_bytes = frames, exc_bytes
        self.failure_id = failure_id
        return self

    def __reduce__(self):
        return (
            _FailureText,
            (
                str(self),
                self.worker,
                self.ename,
                self.evalue,
                self.frames,
                self.exc_bytes,
                self.failure_id,
            ),
        )


def worker_name() -> str:
    """This process's name in the group, or ``"?"`` outside one."""
    try:
        return rpc.get_worker_info().name
    except Exception:
        return "?"


# A worker's last failed user call (for %rpc_debug), and the last failure this process
# received from a call. Ids carry a per-process token: worker names repeat across clusters.
_kept: dict[str, Any] = {}
_seen: dict[str, Any] = {}
_failure_ids = itertools.count(1)
_token = [""]


def _new_token() -> None:
    _token[0] = f"{os.getpid()}.{os.urandom(4).hex()}"


_new_token()
os.register_at_fork(after_in_child=_new_token)  # workers are forked from the zygote


def process_token() -> str:
    """This process's own prefix for ids it hands out (failure ids, code keys): unique to
    it, also among processes forked from one parent, which get a new one at the fork."""
    return _token[0]


def kept_failure() -> tuple[str, BaseException] | None:
    """This worker's last failed user call: ``(failure id, exception)``, or None."""
    return (_kept["id"], _kept["exc"]) if _kept else None


def last_seen_failure() -> dict[str, str] | None:
    """The last worker failure received here: ``worker``, ``id``, ``summary``; or None."""
    return dict(_seen) if _seen else None


def forget_failures() -> None:
    """At shutdown: the kept failure and the record of the last one seen go."""
    _kept.clear()
    _seen.clear()


def _failure(exc: BaseException, keep: bool = False) -> RemoteException:
    failure_id = None
    if keep:  # the previous one (and its frames' locals) is released here
        failure_id = f"{process_token()}.{next(_failure_ids)}"
        _kept.update(id=failure_id, exc=exc)
    frames = [
        (f.filename, f.lineno or 0, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)
    ][1:]  # the first frame is run_function itself
    try:
        exc_bytes: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        exc_bytes = None
    ename = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    evalue = str(exc)
    worker = worker_name()
    text = f"On {worker}:\n{ename}: {evalue}\n" + "".join(traceback.format_list(frames))
    failure = _FailureText(text, worker, ename, evalue, frames, exc_bytes, failure_id)
    return RemoteException(failure, type(exc))


_counts = {"in_flight": 0, "done": 0}  # user calls this process has served
# nbrpc's own RPCs (output, ledger, trace) and torch's (group membership, RRef type
# queries, shutdown) are not user calls: not counted.
_NOT_USER_CALLS = ("nbrpc.", *_torch.TORCH_OWN_CALL_MODULES)
_counts_lock = threading.Lock()


def call_builtin(op: Any, args: tuple, kwargs: dict | None) -> Any:
    """Run a torch builtin operator sent as a Python call (so large tensors can take the
    shared-memory fast path, which torch's TorchScript path for builtins bypasses)."""
    return op(*args, **(kwargs or {}))


def call_counts() -> dict[str, int]:
    """User calls served by this process: running now, and finished (ok or not)."""
    with _counts_lock:
        return dict(_counts)


class _CallerUDF(_torch.PythonUDF):
    """torch's call record, plus who sent it and whether a reply goes back (see below)."""

    caller: str | None = None
    reply: bool = False


def udf_from(caller: str, reply: bool, func: Any, args: tuple, kwargs: dict) -> Any:
    """Unpickling side of :class:`WithCaller`: the call record with its caller."""
    udf = _CallerUDF(func, args, kwargs)
    udf.caller, udf.reply = caller, reply
    return udf


class WithCaller:
    """A call being sent when only some peers share this host's memory: it names its
    caller, so the callee knows whether its reply may carry large tensors through shared
    memory (:mod:`nbrpc._shm`). ``reply``: a result is sent back (not for ``remote()``,
    whose value stays with the callee)."""

    def __init__(self, udf: Any, reply: bool) -> None:
        self.udf, self.reply = udf, reply

    def __reduce__(self) -> tuple:
        udf = self.udf
        return (udf_from, (worker_name(), self.reply, udf.func, udf.args, udf.kwargs))


_after_call: list[Any] = []  # run on the call's thread as each call ends


def after_call(hook: Any) -> None:
    """Run ``hook()`` on the call's thread at the end of every call (idempotent)."""
    if hook not in _after_call:
        _after_call.append(hook)


def calling() -> bool:
    """Whether this thread runs an RPC call whose output goes to the kernel."""
    return getattr(_call, "output", None) is not None


def drain_output() -> None:
    """Wait (bounded) until the output this call printed so far is shown in the kernel."""
    output = getattr(_call, "output", None)
    if output is not None:
        output.drain()


def kernel_name() -> str | None:
    """On a worker: the name of the process its output (and debugger) goes to."""
    return _forward.get("to")


def run_function(python_udf: Any) -> Any:
    """Replaces ``torch.distributed.rpc.internal._run_function`` (called from C++)."""
    output = _CallOutput() if _forward else None
    if _shm.restricted():
        _shm.expect_reply(None, None)  # one left by a call whose reply went another way
    previous = getattr(_call, "output", None)
    _call.output = output
    _torch.quiet_optimizer_notice_if_loaded()  # DistributedOptimizer's, see there
    func = _torch.udf_function(python_udf)
    counted = (
        func is call_builtin
        or getattr(func, "user_call", False)  # nbrpc's own that run user code (%%rpc cells)
        or not (getattr(func, "__module__", "") or "").startswith(_NOT_USER_CALLS)
    )
    if counted:
        with _counts_lock:
            _counts["in_flight"] += 1
    try:
        if isinstance(python_udf, AttributeError):
            raise python_udf
        result = _torch.run_udf(python_udf)
        if getattr(python_udf, "reply", False) and not isinstance(result, torch.futures.Future):
            _shm.expect_reply(result, python_udf.caller)  # pickled next, on this thread
        return result
    except bdb.BdbQuit:  # q in the debugger (nbrpc._debugger)
        return _failure(DebuggerQuitError(worker_name(), getattr(func, "__qualname__", "?")))
    except BaseException as exc:  # sys.exit() or KeyboardInterrupt must not reach torch's C++
        return _failure(exc, keep=counted)
    finally:
        for hook in _after_call:
            hook()
        _call.output = previous
        if output is not None:
            output.close()
        if counted:
            with _counts_lock:
                _counts["in_flight"] -= 1
                _counts["done"] += 1


def format_remote_traceback(failure: _FailureText) -> str:
    lines = [f"Remote traceback (most recent call last), on {failure.worker}:\n"]
    for filename, lineno, name, line in failure.frames:
        lines.append(f'  File "{filename}", line {lineno}, in {name}\n')
        source = linecache.getline(filename, lineno).strip() or (line or "").strip()
        if source:
            lines.append(f"    {source}\n")
    lines.append(f"{failure.ename}: {failure.evalue}\n")
    return "".join(lines)


def rebuild(result: RemoteException) -> BaseException:
    """The exception to raise for a RemoteException that came back from a call."""
    failure = result.msg
    if not isinstance(failure, _FailureText):  # from a process without nbrpc's hooks
        try:
            return result.exception_type(str(failure))
        except Exception:
            return RemoteError(
                getattr(result.exception_type, "__name__", "?"), str(failure), "?", str(failure)
            )
    remote_tb = format_remote_traceback(failure)
    if getattr(failure, "failure_id", None):
        _seen.update(
            worker=failure.worker,
            id=failure.failure_id,
            summary=f"{failure.ename}: {failure.evalue}",
        )
    exc: BaseException | None = None
    if failure.exc_bytes is not None:
        try:
            exc = pickle.loads(failure.exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        try:
            exc = result.exception_type(failure.evalue)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(failure.ename, failure.evalue, failure.worker, remote_tb)
    try:
        exc.worker = failure.worker  # type: ignore[attr-defined]
        exc.remote_traceback = remote_tb  # type: ignore[attr-defined]
    except Exception:
        pass  # an exception type with __slots__: the note below still carries it
    exc.add_note("\n" + remote_tb.rstrip("\n"))
    return exc


_rebuilt: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_rebuilt_lock = threading.Lock()
_rebuilt_keys = itertools.count(1)
_REBUILT_KEEP = 1024  # failures read by plain torch calls are never collected: keep a few
_KEY = re.compile(r"\(nbrpc #(\d+)\)")  # the note that names a rebuilt exception


def handle_exception(result: Any) -> None:
    """Replaces ``torch.distributed.rpc.internal._handle_exception`` (called from C++).

    Raises the rebuilt exception. Where torch converts it on the caller's thread
    (``RRef.to_here``) it arrives as is. Where it converts it on an RPC thread (every
    future), torch keeps only its text, in a ``RuntimeError``; the note added here names a
    key under which the exception waits for :func:`settle`. Plain ``torch.distributed.rpc``
    callers still see the remote type, message and traceback in that text.
    """
    if not isinstance(result, RemoteException):
        return
    exc = rebuild(result)
    with _rebuilt_lock:
        key = next(_rebuilt_keys)
        _rebuilt[key] = exc
        while len(_rebuilt) > _REBUILT_KEEP:
            _rebuilt.popitem(last=False)
    exc.add_note(f"(nbrpc #{key})")
    raise exc


def is_rebuilt(exc: BaseException) -> bool:
    """Whether ``exc`` is a worker's own exception, rebuilt here (it carries the key)."""
    return any(_KEY.fullmatch(note) for note in getattr(exc, "__notes__", ()))


def unwrap(exc: BaseException) -> BaseException | None:
    """The rebuilt remote exception behind torch's RuntimeError, when there is one."""
    match = _KEY.search(str(exc))
    if match is None:
        return None
    with _rebuilt_lock:
        return _rebuilt.pop(int(match.group(1)), None)


def outcome(raw: Any, translate: Any) -> tuple[Any, BaseException | None]:
    """``(value, None)`` or ``(None, error)`` of finished torch future ``raw``, keeping
    error types: a remote exception as it was raised there, and torch's own errors as
    ``translate(exc)`` makes them (timeouts, a lost worker: nbrpc's)."""
    try:
        return raw.wait(), None
    except BaseException as exc:
        original = unwrap(exc)
        if original is None:
            return None, translate(exc)
        original.__notes__ = [n for n in original.__notes__ if not _KEY.fullmatch(n)]
        return None, original


def settle(raw: Any, out: Any, translate: Any) -> None:
    """Complete future ``out`` from finished torch future ``raw`` (see :func:`outcome`)."""
    value, error = outcome(raw, translate)
    _complete(out, value=value, error=error)


def _complete(out: Any, value: Any = None, error: BaseException | None = None) -> None:
    """Finish ``out`` unless its deadline (:mod:`nbrpc._deadlines`) failed it first."""
    if out.done():
        return
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)
    except RuntimeError:  # the deadline won the race
        pass


# --- output forwarding -------------------------------------------------------------


def show_output(worker: str, chunks: list[tuple[str, str]]) -> None:
    """Runs in the kernel: print a worker's output, each line marked with its name."""
    for stream, text in chunks:
        out = sys.stderr if stream == "stderr" else sys.stdout
        out.write("".join(f"[{worker}] {line}" for line in text.splitlines(keepends=True)))
        out.flush()


class _CallOutput:
    """Output written by one RPC call on a worker, sent to the kernel in order.

    At most one message is in flight: the kernel runs RPCs on a thread pool, so two
    messages in flight could print out of order. Lines written meanwhile wait and go
    together in the next message.
    """

    def __init__(self) -> None:
        self.buffers = {"stdout": "", "stderr": ""}
        self._pending: list[tuple[str, str]] = []
        self._in_flight = False
        self._lock = threading.RLock()
        # made at the first message: most calls print nothing (an Event costs ~4 us a call)
        self._idle: threading.Event | None = None

    def write(self, stream: str, text: str) -> None:
        buf = self.buffers[stream] + text
        cut = buf.rfind("\n") + 1
        self.buffers[stream] = buf[cut:]
        if cut:
            self._queue(stream, buf[:cut])

    def _queue(self, stream: str, text: str) -> None:
        with self._lock:
            self._pending.append((stream, text))
            if not self._in_flight:
                self._send_pending()

    def _send_pending(self) -> None:  # holds self._lock
        chunks, self._pending = self._pending, []
        self._in_flight = True
        if self._idle is None:
            self._idle = threading.Event()
        self._idle.clear()
        try:
            fut = rpc.rpc_async(
                _forward["to"], show_output, args=(_forward["me"], chunks), timeout=_OUTPUT_WAIT_S
            )
        except Exception as exc:  # the kernel is gone: keep the text on the worker
            self._in_flight = False
            self._idle.set()
            text = "".join(t for _, t in chunks)
            if sys.__stderr__ is not None:
                sys.__stderr__.write(f"{text}(nbrpc: could not forward output: {exc})\n")
            return
        fut.add_done_callback(self._sent)

    def _sent(self, _fut: Any) -> None:
        with self._lock:
            self._in_flight = False
            if self._pending:
                self._send_pending()
            elif self._idle is not None:
                self._idle.set()

    def drain(self) -> None:
        """Wait (bounded) until every complete line written so far has been printed."""
        if self._idle is not None:
            self._idle.wait(_OUTPUT_WAIT_S)

    def close(self) -> None:
        """Send what is left and wait (bounded) until the kernel has printed it all."""
        for stream, rest in self.buffers.items():
            if rest:
                self._queue(stream, rest + "\n")
        if self._idle is not None:
            self._idle.wait(_OUTPUT_WAIT_S)


class _ForwardingStream:
    """Wraps a worker's stdout/stderr: writes from inside an RPC call go to the kernel."""

    def __init__(self, wrapped: Any, stream: str) -> None:
        self._wrapped = wrapped
        self._stream = stream

    def write(self, text: str) -> int:
        output = getattr(_call, "output", None)
        if output is None:
            return self._wrapped.write(text)
        output.write(self._stream, text)
        return len(text)

    def flush(self) -> None:
        self._wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def forward_output_to(kernel: str, me: str) -> None:
    """On a worker: send output printed during RPC calls to ``kernel``, marked ``me``."""
    _forward.update(to=kernel, me=me)
    if not isinstance(sys.stdout, _ForwardingStream):
        sys.stdout = _ForwardingStream(sys.stdout, "stdout")
    if not isinstance(sys.stderr, _ForwardingStream):
        sys.stderr = _ForwardingStream(sys.stderr, "stderr")
