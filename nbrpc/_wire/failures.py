"""How a failed call comes back: the worker's exception with its type and its traceback.

torch sends only ``repr(e)`` plus a traceback string and rebuilds ``type(e)(that_string)``.
nbrpc sends the exception itself (pickled, when it can be), and the traceback as frames.
The caller formats those frames with *its own* ``linecache``, which holds the notebook
cells, so the remote traceback shows the line of notebook source that raised.

The last failure is kept for a post-mortem. A worker keeps the exception of its last
failed user call, traceback and frames included (one: memory stays bounded), under an id
that travels with the failure; the kernel remembers the last failure it received.
``%rpc_debug`` (:mod:`nbrpc._debugger.postmortem`) joins the two.

:func:`handle_exception` replaces torch's private hook of that role (installed by
:mod:`nbrpc._wire.pickling`); :func:`failure` is what the callee side
(:mod:`nbrpc._wire.callee`) returns for a call that raised.
"""

from __future__ import annotations

import collections
import itertools
import linecache
import pickle
import re
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nbrpc import _process
from nbrpc._errors import RemoteError
from nbrpc._torch import RemoteException


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


@dataclass
class _Failures:
    """A worker's last failed user call (for %rpc_debug), the last failure this process
    received from a call, and rebuilt exceptions waiting for the future that reads them.
    Ids carry the process token: worker names repeat across clusters."""

    kept_id: str | None = None
    kept: BaseException | None = None
    seen: dict[str, str] | None = None
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    rebuilt: collections.OrderedDict[int, BaseException] = field(
        default_factory=collections.OrderedDict
    )
    rebuilt_keys: itertools.count = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _Failures()
_REBUILT_KEEP = 1024  # failures read by plain torch calls are never collected: keep a few
_KEY = re.compile(r"\(nbrpc #(\d+)\)")  # the note that names a rebuilt exception


def kept_failure() -> tuple[str, BaseException] | None:
    """This worker's last failed user call: ``(failure id, exception)``, or None."""
    if _state.kept_id is None or _state.kept is None:
        return None
    return _state.kept_id, _state.kept


def last_seen_failure() -> dict[str, str] | None:
    """The last worker failure received here: ``worker``, ``id``, ``summary``; or None."""
    return dict(_state.seen) if _state.seen else None


def forget_failures() -> None:
    """At shutdown: the kept failure and the record of the last one seen go."""
    _state.kept_id = _state.kept = _state.seen = None


def failure(exc: BaseException, keep: bool = False) -> RemoteException:
    """What a call that raised ``exc`` returns to its caller; ``keep``: keep ``exc`` (and
    its frames' locals) for a post-mortem, releasing the one kept before."""
    failure_id = None
    if keep:
        failure_id = f"{_process.token()}.{next(_state.ids)}"
        _state.kept_id, _state.kept = failure_id, exc
    frames = [
        (f.filename, f.lineno or 0, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)
    ][1:]  # the first frame is run_function itself
    try:
        exc_bytes: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        exc_bytes = None
    ename = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    evalue = str(exc)
    worker = _process.name()
    text = f"On {worker}:\n{ename}: {evalue}\n" + "".join(traceback.format_list(frames))
    text_ = _FailureText(text, worker, ename, evalue, frames, exc_bytes, failure_id)
    return RemoteException(text_, type(exc))


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
        _state.seen = {
            "worker": failure.worker,
            "id": failure.failure_id or "",
            "summary": f"{failure.ename}: {failure.evalue}",
        }
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
    with _state.lock:
        key = next(_state.rebuilt_keys)
        _state.rebuilt[key] = exc
        while len(_state.rebuilt) > _REBUILT_KEEP:
            _state.rebuilt.popitem(last=False)
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
    with _state.lock:
        return _state.rebuilt.pop(int(match.group(1)), None)


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
    """Finish ``out`` unless its deadline (:mod:`nbrpc._debugger.deadlines`) failed it first."""
    if out.done():
        return
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)
    except RuntimeError:  # the deadline won the race
        pass
