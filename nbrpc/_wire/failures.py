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
import copy
import itertools
import linecache
import os
import pickle
import re
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nbrpc import _process
from nbrpc._errors import (
    RemoteError,
    SerializationError,
    ShortTraceback,
    format_frames,
)
from nbrpc._torch import NOT_ON_CALLEE, RemoteException


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
    its frames' locals) for a post-mortem, releasing the one kept before.

    An exception this process received from a call (:func:`rebuild`) and passed on through
    nbrpc's and torch's frames only goes on as it arrived: this process added no frame of
    the user's, so its hop would show nothing but theirs, and the receiver formats the
    origin's frames with its own cells. (An RRef whose value's creation failed raises that
    failure in its owner, to a proxy's type query: torch's ``_rref_typeof_on_owner``.)
    """
    everything = traceback.extract_tb(exc.__traceback__)
    frames = _users_frames(everything)
    arrived = getattr(exc, "_nbrpc_arrived", None)
    if not frames and isinstance(arrived, _Arrived) and arrived.result is not None:
        return arrived.result
    failure_id = None
    if keep:
        failure_id = f"{_process.token()}.{next(_state.ids)}"
        _state.kept_id, _state.kept = failure_id, exc
    frames = frames or _users_frames(everything, everyones=True)
    try:
        exc_bytes: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        exc_bytes = None
    ename = type_name(type(exc))
    evalue = str(exc)
    worker = _process.name()
    text = f"On {worker}:\n{ename}: {evalue}\n" + "".join(traceback.format_list(frames))
    text_ = _FailureText(text, worker, ename, evalue, frames, exc_bytes, failure_id)
    return RemoteException(text_, type(exc))


def type_name(kind: type) -> str:
    """An exception type's name as a traceback shows it: ``ZeroDivisionError``,
    ``numpy.linalg.LinAlgError``; nbrpc's own by the name ``nbrpc`` exports
    (``CallCancelledError``), never by the private module that defines it."""
    module = kind.__module__
    if module in ("builtins", "__main__") or module.split(".")[0] == "nbrpc":
        return kind.__qualname__
    return f"{module}.{kind.__qualname__}"


_TORCH_RPC = sys.modules[RemoteException.__module__].__file__ or ""
_OWN = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # nbrpc/
    os.path.dirname(os.path.abspath(_TORCH_RPC)) + os.sep,  # torch.distributed.rpc/
)  # the second: torch's waits and RRef proxies (``_local_invoke``)


def _users_frames(
    tb: traceback.StackSummary, everyones: bool = False
) -> list[tuple[str, int, str, str | None]]:
    """The frames of a failed call worth showing: the user's, not nbrpc's or torch RPC's
    around them (``run_function``, the call facade's waits, an RRef proxy's
    ``_local_invoke``); with ``everyones``, all of them."""
    frames = [(f.filename, f.lineno or 0, f.name, f.line) for f in tb]
    if everyones:
        return frames[1:]  # the first frame is run_function itself
    return [f for f in frames if not os.path.abspath(f[0]).startswith(_OWN)]


def format_remote_traceback(failure: _FailureText) -> str:
    """The worker's traceback, its source lines read here first (this process's linecache
    holds the notebook's cells), and a frame repeated more than 3 times in a row shown as
    Python shows it ("[Previous line repeated 995 more times]": a RecursionError is 14
    lines, not 2,000)."""
    frames = traceback.StackSummary.from_list(
        [
            traceback.FrameSummary(
                filename,
                lineno,
                name,
                line=linecache.getline(filename, lineno).strip() or (line or "").strip(),
            )
            for filename, lineno, name, line in failure.frames
        ]
    )
    lines = [f"Remote traceback (most recent call last), on {failure.worker}:\n"]
    lines.extend(chunk + "\n" for chunk in format_frames(list(frames)))
    lines.append(f"{failure.ename}: {failure.evalue}\n")
    return "".join(lines)


class _Arrived:
    """The RemoteException a rebuilt exception came as, for :func:`failure` to pass on.
    Not sent along: the next receiver keeps its own."""

    def __init__(self, result: RemoteException | None) -> None:
        self.result = result

    def __reduce__(self) -> tuple:
        return (_Arrived, (None,))


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
    if isinstance(exc, AttributeError) and NOT_ON_CALLEE in failure.evalue:
        exc = SerializationError(  # torch's caller gets a RuntimeError here: this is one
            f"{failure.worker} cannot find the function this call names: {failure.evalue} "
            "Or send its module by value: nbrpc.register_by_value(module)."
        )
    try:
        exc.worker = failure.worker  # type: ignore[attr-defined]
        exc.remote_traceback = remote_tb  # type: ignore[attr-defined]
        exc._render_traceback_ = ShortTraceback(exc)  # type: ignore[attr-defined]
        exc._nbrpc_arrived = _Arrived(result)  # type: ignore[attr-defined]
    except Exception:
        pass  # an exception type with __slots__: the note below still carries it
    if not getattr(exc, "says_where", False):  # (its own message names worker and call)
        _add_hop(exc, "\n" + remote_tb.rstrip("\n"))
    return exc


_HOP = "\nRemote traceback (most recent call last), on "
_BETWEEN = re.compile(r"^\(passed back through (\d+) more calls?\)$")


def _add_hop(exc: BaseException, note: str) -> None:
    """Add this hop's remote traceback to ``exc``. An exception passed back through many
    nested calls keeps where it was raised and the last hop, and counts those between (a
    40-deep chain of calls would otherwise carry 40 tracebacks)."""
    notes = list(getattr(exc, "__notes__", ()))
    hops = [i for i, n in enumerate(notes) if n.startswith(_HOP)]
    if len(hops) >= 2 or (hops and any(_BETWEEN.match(n) for n in notes)):
        between = len(hops) - 1  # every hop after the origin, shown or counted before
        for n in notes[hops[0] + 1 :]:
            match = _BETWEEN.match(n)
            if match:
                between += int(match.group(1))
        s = "s" if between > 1 else ""
        exc.__notes__ = [*notes[: hops[0] + 1], f"(passed back through {between} more call{s})"]
    exc.add_note(note)


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


def raisable(exc: BaseException) -> BaseException:
    """What to raise for ``exc``, an exception a future keeps: a copy, and ``exc`` itself
    left without a traceback.

    torch keeps a future's exception from C++, where Python's garbage collector cannot
    see it. Raised as it is, the exception gathers a traceback of the frames it passes
    through, and those frames hold the future: a cycle the collector cannot break, which
    kept every local of those frames alive (measured: the RRefs a failed
    DistributedOptimizer held, so every later shutdown waited 5 s for their dead owner).
    """
    exc.__traceback__ = None
    try:
        twin = copy.copy(exc)
    except Exception:  # a type that cannot be rebuilt from its args: raise it as it is
        return exc
    if type(twin) is not type(exc):
        return exc
    twin.__traceback__ = None
    if isinstance(getattr(twin, "_render_traceback_", None), ShortTraceback):
        twin._render_traceback_ = ShortTraceback(twin)  # type: ignore[attr-defined]
    return twin


def delivered(exc: BaseException) -> BaseException:
    """A rebuilt exception raised straight to its caller (``RRef.to_here`` converts on the
    caller's thread): the key :func:`handle_exception` noted goes, from its notes and from
    the exceptions kept for :func:`settle`."""
    notes = getattr(exc, "__notes__", [])
    keys = [int(m.group(1)) for m in map(_KEY.fullmatch, notes) if m]
    if keys:
        exc.__notes__ = [n for n in notes if not _KEY.fullmatch(n)]
        with _state.lock:
            for key in keys:
                _state.rebuilt.pop(key, None)
    return exc


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
        return None, received(exc, translate)


def received(exc: BaseException, translate: Any) -> BaseException:
    """The error to raise for ``exc``, which torch raised for a call: the worker's own
    exception as it was raised there (behind torch's RuntimeError, or as it is), torch's
    own errors as ``translate(exc)`` makes them."""
    if is_rebuilt(exc):
        return delivered(exc)
    original = unwrap(exc)
    if original is None:
        return translate(exc)
    original.__notes__ = [n for n in original.__notes__ if not _KEY.fullmatch(n)]
    return original


def returned(value: Any) -> tuple[Any, BaseException | None]:
    """``(value, None)``, or ``(None, error)`` when ``value`` is a failure a call sent back
    (a reply that came by a lane, :mod:`nbrpc._wire.lanes`, rebuilt as a future's is)."""
    if isinstance(value, RemoteException):
        return None, rebuild(value)
    return value, None


def settle(raw: Any, out: Any, translate: Any) -> None:
    """Complete future ``out`` from finished torch future ``raw`` (see :func:`outcome`)."""
    value, error = outcome(raw, translate)
    complete(out, value=value, error=error)


def complete(out: Any, value: Any = None, error: BaseException | None = None) -> None:
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
