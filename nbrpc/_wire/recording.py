"""A call timeline, recorded in every process: each call's row, written where it ran.

While a recording is on (``nbrpc.record()``: the kernel turns it on in every process of
the group), nbrpc's pickler sends every user call with a small header: a call id unique to
the cluster (the caller's rank in the high bits), the caller's name, the call it was made
inside (its *parent*: the call this thread was serving when it made it) and when it was
sent, on the caller's clock. The callee makes the row: when the function ran, what it
raised, and, once the reply was pickled on the same thread right after, the reply's bytes
and the path its tensors took. The caller keeps the request's own bytes and path under the
call id. The kernel joins both halves and puts every time on its own clock with the
offset it measured per process (``nbrpc._gather.timeline``).

The header travels with every user call, recording or not: its caller's name says whom a
thread serves in a stack dump (:mod:`nbrpc._wire.stacks`), and, where only some peers
share this host's memory, whether a reply goes back to it (:mod:`nbrpc._wire.shm`). Off,
recording costs a call one module-global read in the pickler and one in the callee. On, a
few ``time.time()`` calls, a dict and a counter per call (``make bench`` reports the
ratio).

Calls that are not recorded: nbrpc's own and torch's own (as :mod:`nbrpc._wire.callee`
does not count them), and torch builtins a worker sends with torch's own
``rpc_sync``/``remote`` (TorchScript calls: they never reach a Python pickler).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc

from nbrpc import _torch

from . import cancelling, shm

#: call ids: the caller's rank above these bits, its own counter below
_RANK_SHIFT = 40
_KEEP_ROWS = 200_000  # rows one process keeps while recording (the oldest go first)


@dataclass
class _Recording:
    """This process's part of one recording."""

    token: str
    rank: int
    counter: Any = field(default_factory=lambda: itertools.count(1))
    rows: list[dict] = field(default_factory=list)  # rows of calls served here
    sent: dict[int, dict] = field(default_factory=dict)  # call id -> the request's size, path
    lock: threading.Lock = field(default_factory=threading.Lock)
    drained: int = 0  # rows already handed out by drain()


_on: _Recording | None = None  # read once per call: off is nearly free
_thread = threading.local()  # .calls: stack of rows served on this thread; .message
#: thread id -> (result, row): the reply a call's thread pickles next. Not a threading.local:
#: torch pickles the reply under a new acquisition of the GIL, with a new thread state.
_replies: dict[int, tuple[Any, dict]] = {}


def clock() -> float:
    """This process's clock, the one rows are written on (seconds, wall time)."""
    return time.time()


def start(token: str) -> float:
    """Start recording in this process (asked by the kernel); returns the clock."""
    global _on
    _on = _Recording(token, rpc.get_worker_info().id)
    return clock()


def stop(token: str) -> dict[str, Any]:
    """Stop recording; everything recorded here that :func:`drain` did not hand out."""
    global _on
    rec = _on
    if rec is None or rec.token != token:
        return {"rows": [], "sent": {}}
    _on = None
    _replies.clear()  # results kept for their replies' sizes: not after the recording
    with rec.lock:
        rows = rec.rows[rec.drained :]
        rec.drained = len(rec.rows)
        return {"rows": [_public(r) for r in rows], "sent": dict(rec.sent)}


def drain(token: str) -> dict[str, Any]:
    """Rows finished since the last drain (for a live view), and the requests' sizes sent
    since; a row waits here until its reply was pickled (or could not have been)."""
    rec = _on
    if rec is None or rec.token != token:
        return {"rows": [], "sent": {}}
    with rec.lock:
        ready = rec.drained
        now = clock()
        while ready < len(rec.rows) and (
            "_reply" in rec.rows[ready] or now - rec.rows[ready]["end"] > 1.0
        ):
            ready += 1
        rows = rec.rows[rec.drained : ready]
        rec.drained = ready
        sent, rec.sent = rec.sent, {}
    return {"rows": [_public(r) for r in rows], "sent": sent}


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def active() -> _Recording | None:
    return _on


# -- the caller's side: a header on every user call --------------------------------------


#: A call's header: ``(call id, caller, parent id, sent, reply, origin)``. ``call`` is 0
#: when the call is not recorded (then ``parent`` is None and ``sent`` 0.0); ``reply``:
#: the caller expects its reply through shared memory if the two share a host
#: (nbrpc._wire.shm); ``origin``: the cell whose stop button cancels it, None if none
#: (nbrpc._wire.cancelling).
Header = tuple[int, str, "int | None", float, bool, "int | None"]


class Recorded:
    """A call being sent: torch's call record and its header."""

    def __init__(self, udf: Any, header: Header) -> None:
        self.udf, self.header = udf, header

    def __reduce__(self) -> tuple:
        return (arrived, (self.header, self.udf))


class _RecordedUDF(_torch.PythonUDF):
    """torch's call record with the header it arrived with (``.record``)."""


def arrived(header: Header, udf: Any) -> Any:
    """Unpickling side of :class:`Recorded`: the call record, with its header attached."""
    if type(udf) is _torch.PythonUDF:
        udf = _RecordedUDF(udf.func, udf.args, udf.kwargs)
    if not isinstance(udf, BaseException):  # an AttributeError torch made while unpickling
        udf.record = header
    return udf


def arrived_call(header: Header, func: Any, args: tuple, kwargs: dict, lane: bool) -> Any:
    """A call that arrived with ``header`` beside it (a lane's: ``lane``), as
    :func:`arrived` makes it."""
    udf: Any = _RecordedUDF(func, args, kwargs)
    udf.record, udf.lane = header, lane
    return udf


def header_of(python_udf: Any) -> Header | None:
    """The header a call arrived with (None: sent without one)."""
    return getattr(python_udf, "record", None)


def outgoing(obj: Any, caller: str, reply: bool, user: bool) -> tuple[Any, dict | None]:
    """``obj`` (a call's record being pickled) with its header, and, for a ``user`` call
    while recording, where to count the request's bytes."""
    header, message = header_for(caller, reply, user)
    return Recorded(obj, header), message


def header_for(caller: str, reply: bool, user: bool) -> tuple[Header, dict | None]:
    """A call's header (:data:`Header`), and, for a ``user`` call while recording, where
    to count the request's bytes (see :func:`outgoing`; a lane sends the header beside
    the call, :mod:`nbrpc._wire.lanes`)."""
    rec = _on if user else None
    origin = cancelling.origin_here() if user else None
    if rec is None:
        return (0, caller, None, 0.0, reply, origin), None
    stack = getattr(_thread, "calls", None)
    parent = stack[-1]["id"] if stack else None
    call = rec.rank << _RANK_SHIFT | next(rec.counter)
    message: dict[str, Any] = {"call": call, "bytes": 0, "paths": set()}
    _thread.message = message
    return (call, caller, parent, clock(), reply, origin), message


def counted(reducer: Any, path: str = "tensorpipe") -> Any:
    """The tensor reducer of a message pickled while recording: it also adds each
    tensor's bytes and path to the message being pickled on this thread (``path``: where
    a tensor goes that is not in shared memory)."""

    def reduce(t: torch.Tensor) -> Any:
        reduced = reducer(t)
        message = getattr(_thread, "message", None)
        if message is not None:
            message["bytes"] += t.untyped_storage().nbytes()
            if reduced[0] is shm.import_tensor:
                message["paths"].add("arena" if isinstance(reduced[1][0], tuple) else "segment")
            else:
                message["paths"].add("cuda" if t.is_cuda else path)
        return reduced

    return reduce


def message_for(obj: Any) -> dict | None:
    """The row a reply being pickled on this thread belongs to (its counts go there)."""
    ident = threading.get_ident()
    reply = _replies.get(ident)
    if reply is None or reply[0] is not obj:
        return None
    del _replies[ident]
    row = reply[1]
    message = {"bytes": 0, "paths": set(), "row": row}
    _thread.message = message
    return message


def reply_row(result: Any) -> dict | None:
    """The row whose reply ``result`` is (pickled next on this thread), if recorded; for a
    reply a lane leaves to TensorPipe (:func:`reply_here`)."""
    reply = _replies.get(threading.get_ident())
    return reply[1] if reply is not None and reply[0] is result else None


def reply_here(result: Any, row: dict | None) -> None:
    """``result``, the reply of ``row``, is pickled next on this thread (a lane's reply
    that TensorPipe fetches: its bytes and path count where the call's row is)."""
    if row is not None:
        _replies[threading.get_ident()] = (result, row)


def pickled(message: dict, size: int) -> None:
    """A recorded message was pickled: ``size`` bytes of pickle, its tensors counted."""
    _thread.message = None
    rec = _on
    if rec is None:
        return
    total = size + message["bytes"]
    path = "+".join(sorted(message["paths"]))
    row = message.get("row")
    with rec.lock:
        if row is not None:  # a reply
            row["bytes_out"], row["path_out"], row["_reply"] = total, path, True
        else:
            rec.sent[message["call"]] = {"bytes": total, "path": path}


# -- the callee's side: a row per call served ---------------------------------------------


def begin(python_udf: Any, name: str) -> dict | None:
    """A call arrived: its row, started (None when it was sent without a header)."""
    header = header_of(python_udf)
    rec = _on
    if header is None or rec is None or not header[0]:
        return None
    call, caller, parent, sent = header[:4]
    row = {
        "id": call,
        "parent": parent,
        "caller": caller,
        "function": name,
        "route": "lane" if getattr(python_udf, "lane", False) else "tensorpipe",
        "sent": sent,
        "start": clock(),
        "end": 0.0,
        "thread": threading.get_ident(),
        "bytes_out": 0,
        "path_out": "",
        "ok": True,
        "error": None,
    }
    stack = getattr(_thread, "calls", None)
    if stack is None:
        stack = _thread.calls = []
    stack.append(row)
    _replies.pop(threading.get_ident(), None)
    return row


def end(row: dict, result: Any, error: str | None) -> None:
    """The call returned ``result`` (pickled next on this thread, as its reply) or
    failed with an exception of type ``error``."""
    row["end"] = clock()
    if error is not None:
        row["ok"], row["error"] = False, error
    stack = _thread.calls
    stack.pop()
    if isinstance(result, torch.futures.Future):
        row["_reply"] = False  # sent later, from another thread: not counted
    else:
        _replies[threading.get_ident()] = (result, row)
    rec = _on
    if rec is not None:
        with rec.lock:
            rec.rows.append(row)
            if len(rec.rows) > _KEEP_ROWS:
                del rec.rows[: _KEEP_ROWS // 10]
                rec.drained = max(0, rec.drained - _KEEP_ROWS // 10)


def function_name(func: Any, args: tuple, builtin: bool) -> str:
    """The name a row shows: a notebook function by its name, a builtin sent as a Python
    call (``builtin``) by the builtin's, a method of an RRef's proxy as ``Type.method``."""
    if builtin and args:
        op = args[0]
        name = getattr(op, "__name__", None) or str(op)
        return f"torch.{name}" if getattr(op, "__module__", None) in (None, "torch") else name
    if getattr(func, "__module__", "") == _torch.RREF_PROXY_MODULE and len(args) >= 2:
        try:
            owned = args[0].local_value()
            return f"{type(owned).__name__}.{args[1]}"
        except Exception:
            return str(args[1])
    return getattr(func, "__qualname__", None) or type(func).__name__
