"""The callee's side of a lane: peers admitted, their calls run, the replies sent.

The calls run in :func:`nbrpc._wire.callee.run_function`, as TensorPipe's calls are run.
The main thread's lane (``INLINE`` frames) runs its calls on the connection's own
thread; a shared lane's (``POOLED``) go to the pool (:mod:`.pool`), and their replies
leave through an outbox. A reply that cannot take the lane is kept and fetched through
TensorPipe (:func:`take`); a call that does not unpickle here, or that torch's server-process
profiler would not see here, is sent back as ``RETRY``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from nbrpc import _torch
from nbrpc._wire import pickling, recording, same_user
from nbrpc._wire.callee import run_function, serve_lanes_here

from . import messages
from .frames import FRAME, MAX_PAYLOAD, Frames, Outbox
from .state import CALLS, FETCH, INLINE, ON_DEVICE, RETRY, VALUE, here, shut


def listen(listener: socket.socket) -> None:
    """Admit peers on ``listener`` until it closes (on the process's accept loop,
    :mod:`nbrpc._wire.same_user`): only a process of this user (``SO_PEERCRED``), each
    served on a thread of its own."""
    same_user.listen(listener, _serve, "nbrpc-lane", _admitted)


def _admitted(conn: socket.socket) -> None:
    with here.lock:
        here.served.add(conn)


def _serve(conn: socket.socket) -> None:
    """Read a peer's calls: the main thread's run here, the others on the pool."""
    serve_lanes_here()
    frames = Frames(conn)
    write_lock = threading.Lock()
    outbox: Outbox | None = None

    def answer(frame: bytes) -> None:
        try:
            with write_lock:
                conn.sendall(frame)
        except OSError:
            pass  # the caller went away (its stop button, a timeout): nothing waits for it

    try:
        while True:
            frame = frames.next()
            if frame is None or frame[1] not in CALLS:
                return  # closed, or not a peer speaking this protocol: drop it
            call, kind, payload = frame
            if kind == INLINE:
                run(answer, call, payload, id(conn))
            elif here.pool is not None:
                if outbox is None:  # pooled calls' replies leave through an outbox
                    outbox = Outbox(conn, "nbrpc-lane-replies", write_lock, _ignore)
                here.pool.put((outbox.put, call, payload))
    except Exception:  # bytes from outside never take the process down
        return
    finally:
        if outbox is not None:
            outbox.close()
        with here.lock:
            here.served.discard(conn)
            _drop_kept(id(conn))
        shut(conn)


def run(answer: Callable[[bytes], Any], call: int, payload: bytes, lane: int = 0) -> None:
    """Run one call and ``answer`` it (a frame sent, or put in the connection's outbox).
    ``lane``: the main thread's lane it came by (its connection's id), whose replies kept
    for :func:`take` go when it closes; 0: a shared lane's, whose caller always takes."""
    try:
        func, args, kwargs, header, back = messages.lane_call_of(payload)
    except Exception:  # e.g. a function this process cannot import, or a staged CUDA
        # tensor that could not be placed: TensorPipe sends it again and says it
        answer(FRAME.pack(call, 0, RETRY))
        return
    if _torch.server_profiling():  # torch's server-process profiler sees TensorPipe's only
        del func, args, kwargs
        answer(FRAME.pack(call, 0, RETRY))
        return
    if header is not None:  # a user's call: its header, and the row says it came this way
        udf = recording.arrived_call(header, func, args, kwargs, lane=True)
    else:
        udf = _torch.PythonUDF(func, args, kwargs)
    del func, args, kwargs
    result = run_function(udf)
    row = recording.reply_row(result)
    try:
        reply = messages.lane_dumps(result, back)  # small CUDA tensors: staged back
        if len(reply) > MAX_PAYLOAD:  # more than a frame holds: TensorPipe fetches it
            raise messages.NotLane(f"a reply of {len(reply)} bytes")
        kind = VALUE
    except Exception as exc:  # an RRef, a CUDA tensor, no pickle...: TensorPipe takes it
        messages.unsent()  # (what shared memory the refused reply's tensors took)
        made = None
        kind = ON_DEVICE if isinstance(exc, messages.OnDevice) else FETCH
        # a reply refused for something else first (a large CPU tensor, an RRef) may hold
        # CUDA tensors too; only Python code on this thread made them (a lane's call has
        # no TensorPipe arguments), so CUDA is initialized wherever there are any
        if kind == ON_DEVICE or torch.cuda.is_initialized():
            with contextlib.suppress(Exception):  # CUDA failing: TensorPipe's send says so
                made = _made_on(result, getattr(exc, "device", None))
        with here.lock:
            key = next(here.held_ids)
            here.held[key] = result, row, made, lane
        reply = key.to_bytes(8, "little")
    del result, udf
    answer(FRAME.pack(call, len(reply), kind) + reply)


def _drop_kept(lane: int) -> None:
    """The main thread's lane ``lane`` closed: the replies kept for its calls are not
    taken (its caller closes it when it stops waiting: a timeout, the stop button), and
    would hold their objects, a large or a CUDA tensor, until the cluster closes."""
    for key in [k for k, kept in here.held.items() if kept[3] == lane]:
        del here.held[key]


def _ignore(exc: Any) -> None:
    """A reply could not be sent: the caller went away, nothing waits for it."""


def _made_on(result: Any, first: Any) -> list[tuple[Any, Any]]:
    """Where a reply's CUDA tensors are being made: an event on this thread's stream of
    each of their devices (``first``: the one pickling met first, if it did), recorded now.
    :func:`take` runs on one of torch's RPC threads, whose streams TensorPipe orders the
    reply after, not this one's."""
    found = (first, *pickling.devices_of(result))
    devices = {d for d in found if d is not None and d.type == "cuda"}
    made = []
    for device in sorted(devices, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        made.append((device, event))
    return made


def take(key: int) -> Any:
    """Called through TensorPipe by a caller: a reply kept because it could not take the
    lane (:func:`run`), sent now with torch's pickling. A CUDA tensor's stream work on
    the lane's thread comes first: this thread's stream waits for it, and TensorPipe's
    CUDA-aware reply waits for this stream, as for a call that ran on its thread."""
    with here.lock:
        result, row, made, _ = here.held.pop(key)
    for device, event in made or ():
        torch.cuda.current_stream(device).wait_event(event)
    recording.reply_here(result, row)  # a recorded call's row counts the reply's bytes
    return result
