"""How bytes travel on a lane (:mod:`nbrpc._wire.lanes`): frames, and their reading.

A frame is a header (:data:`FRAME`: the call's id, the payload's length, its kind) and
the payload, a pickle. A reader takes what arrived with one ``recv`` and cuts frames out
of it; a frame that says it is longer than :data:`MAX_PAYLOAD` is not a peer's, and ends
the connection.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

#: a frame's header: call id, payload length, kind
FRAME = struct.Struct("<QIB")
MAX_PAYLOAD = 1 << 30
_RECV = 1 << 16  # bytes asked of one recv


class Frames:
    """The frames arriving on a socket, read with one ``recv`` for as many as came (a
    buffered file object costs two reads through Python's I/O layers per frame).

    No spinning: a process that waits for a frame sleeps in ``recv``. (Measured here, 2
    cores: waiting without sleeping for up to 200 µs on both sides made a small call
    65 µs in one run and 340 µs in the next, as the scheduler placed both processes on
    one CPU or not; with ``sched_yield`` it was 200 µs.)"""

    __slots__ = ("buffer", "closed", "partial", "sock", "start")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.start, self.closed = sock, b"", 0, False
        # a large frame read in part when a read timed out: (call, kind, frame, bytes got)
        self.partial: tuple[int, int, bytearray, int] | None = None

    def next(self) -> tuple[int, int, Any] | None:
        """``(call, kind, payload)`` of the next frame, or None once the peer closed or
        sent what is not a frame (over :data:`MAX_PAYLOAD`); raises ``OSError``. A read
        that times out (``BlockingIOError``: the main thread's lane reads in slices)
        loses nothing: the next call goes on where it stopped."""
        if self.partial is not None:
            return self._rest(*self.partial)
        buffer, start, head = self.buffer, self.start, FRAME.size
        while True:
            have = len(buffer) - start
            if have >= head:
                call, size, kind = FRAME.unpack_from(buffer, start)
                if size > MAX_PAYLOAD:
                    return None
                end = start + head + size
                if len(buffer) >= end:  # the frame is here: the next one starts at its end
                    if len(buffer) > end:
                        self.buffer, self.start = buffer, end
                    else:
                        self.buffer, self.start = b"", 0
                    return call, kind, memoryview(buffer)[start + head : end]
                if head + size > _RECV:  # a large frame: the rest read straight into place
                    whole = bytearray(head + size)
                    whole[:have] = memoryview(buffer)[start:]
                    return self._rest(call, kind, whole, have)
            if self.closed:
                return None
            more = self.sock.recv(_RECV)
            if not more:
                self.closed = True
                return None
            buffer = buffer[start:] + more if have else more
            start = 0
            self.buffer, self.start = buffer, 0

    def _rest(
        self, call: int, kind: int, whole: bytearray, got: int
    ) -> tuple[int, int, Any] | None:
        view, end = memoryview(whole), len(whole)
        self.partial = None
        while got < end:
            try:
                n = self.sock.recv_into(view[got:])
            except BlockingIOError:  # a slice ended mid-frame: kept for the next call
                self.partial = call, kind, whole, got
                raise
            if not n:
                self.closed = True
                return None
            got += n
        self.buffer, self.start = b"", 0
        return call, kind, view[FRAME.size :]


class Outbox:
    """Frames to send on a socket, sent by a thread of their own in as few sends as they
    came: a burst of calls, or of their replies, leaves in a few large sends, and the
    thread that made each frame goes on at once. (One send per frame is a system call
    that wakes the peer and gives up this process's GIL: 1,000 calls spent 21-32 ms of
    the caller's main thread in them, measured.)

    ``lost(error)`` runs on the writer when a send fails (the peer is gone); frames put
    after that, or after :meth:`close`, are refused."""

    def __init__(
        self, sock: socket.socket, name: str, lock: threading.Lock, lost: Callable[[Any], None]
    ) -> None:
        self.sock, self.lock, self.lost = sock, lock, lost
        self.frames: list[bytes] = []
        self.cond = threading.Condition(threading.Lock())
        self.waiting = self.closed = False
        threading.Thread(target=self._write, name=name, daemon=True).start()

    def put(self, frame: bytes) -> bool:
        """Queue ``frame``; False if the outbox is closed."""
        with self.cond:
            if self.closed:
                return False
            self.frames.append(frame)
            if self.waiting:
                self.waiting = False
                self.cond.notify()
        return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()

    def _write(self) -> None:
        while True:
            with self.cond:
                while not self.frames and not self.closed:
                    self.waiting = True
                    self.cond.wait()
                frames, self.frames = self.frames, []
            if not frames:
                return  # closed, everything sent
            try:
                with self.lock:
                    self.sock.sendall(frames[0] if len(frames) == 1 else b"".join(frames))
            except OSError as exc:
                with self.cond:
                    self.closed = True
                    self.frames.clear()
                self.lost(exc)
                return
