"""The lanes a caller opens: one connection to a peer each (:class:`Lane`), the main
thread's (it reads its own answer, :meth:`Lane.ask`) or a shared one (a reader thread hands
each reply to its call's callback, :meth:`Lane.post`), and a lane's answer to a call
(:class:`Reply`: a value, a lost lane, or what TensorPipe carries instead). Which call
takes a lane is :mod:`.caller`'s; what a process's lanes hold is :mod:`.state`'s.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from nbrpc import _fork, _timers

from .callee import take
from .frames import FRAME, Frames, Outbox
from .state import (
    FETCH,
    INLINE,
    ON_DEVICE,
    POOLED,
    REPLIES,
    RETRY,
    VALUE,
    LaneLost,
    here,
    reading,
    shut,
    socket_path as path_of,
)

#: seconds one read of the main thread's lane waits (then it looks at signals and prompts)
MAIN_SLICE_S = 0.1
_MAIN_SLICE = struct.pack("ll", 0, int(MAIN_SLICE_S * 1e6))  # a struct timeval
#: the main thread's wait: ``wait(one_slice, limit)`` is False if ``limit`` passed first
Waiter = Callable[[Callable[[], bool], float], bool]
LOST = 9  # a Reply's kind, here only: the lane closed before the reply came
UNREADABLE = 10  # a Reply's kind, here only: its value did not unpickle in this process
#: calls remembered as answering with a tensor on a device (then forgotten, oldest first)
ON_DEVICE_KEPT = 256
#: a reply's callbacks (a future's ``then``) that run longer than this on a lane's reader
#: have the lane read by a new thread: torch runs callbacks on one of its RPC threads, so
#: a slow one does not hold other replies up (:func:`_look`; read at every look)
SLOW_CALLBACK_S = 0.02
#: how often a look (:func:`_look`) runs, while this process has a shared lane
LOOK_EVERY_S = 0.05
#: readers handed over that still run their callbacks, at most, for the looks (torch's
#: default ``num_worker_threads``); beyond, a slow callback holds its lane's replies up
MAX_AWAY = 16


class Reply(NamedTuple):
    """A lane's answer to one call: a value (what the callee's ``run_function`` returned,
    a failure it sent back included), a lost lane, or the call TensorPipe must carry."""

    kind: int  # VALUE, FETCH, ON_DEVICE, RETRY, LOST or UNREADABLE
    got: Any  # the value, the key of the reply the callee kept, the LaneLost, the error

    @property
    def answered(self) -> bool:
        """Whether the lane brought the call's value (a failure the callee sent back
        included): nothing goes through TensorPipe."""
        return self.kind == VALUE

    @property
    def lost(self) -> LaneLost | None:
        """Why the lane closed before the reply came, if it did."""
        return self.got if self.kind == LOST else None

    @property
    def unreadable(self) -> BaseException | None:
        """Why the reply's value did not unpickle here, if it did not."""
        return self.got if self.kind == UNREADABLE else None

    def through_torch(self, dest: Any, sent: tuple) -> tuple | None:
        """What TensorPipe sends to ``dest`` (a WorkerInfo) instead, as ``(func, args,
        kwargs)``: the reply the callee kept (fetched with :func:`.callee.take`), or the
        call ``sent`` again (the callee could not unpickle it); None when the lane
        answered. A reply kept because it held a tensor on a device (``ON_DEVICE``) also
        sends the function's later calls to ``dest`` through TensorPipe from the start
        (:func:`answered_on_device`)."""
        if self.kind == ON_DEVICE:
            answered_on_device(dest, sent[0])
        if self.kind in (FETCH, ON_DEVICE):
            return take, (self.got,), None
        return sent if self.kind == RETRY else None


def hand_over_reading() -> None:
    """This thread is about to wait for a call: if it is a lane's reader (a future's
    callback runs here), another thread reads that lane from now on (:meth:`Lane.hand_over`)."""
    lane = reading.lane
    if lane is not None:
        lane.hand_over()


def answered_on_device(dest: Any, func: Any) -> None:
    """A lane's reply from ``dest`` to a call of ``func`` held a tensor on a device
    (``ON_DEVICE``): later calls of ``func`` there take TensorPipe from the start, as
    they would without lanes (a lane round, then TensorPipe's fetch, would cost both)."""
    with here.lock:
        here.on_device[dest.id, id(func)] = func  # (kept: its id stays its own)
        while len(here.on_device) > ON_DEVICE_KEPT:
            del here.on_device[next(iter(here.on_device))]


def in_flight() -> int:
    """Calls this process started on lanes that have not finished."""
    with here.lock:
        return sum(len(lane.pending) for lane in here.shared.values()) + sum(
            1 for lane in here.main.values() if lane.busy
        )


class Lane:
    """One connection to a peer. ``main``: the main thread's (it reads its own answer,
    :meth:`ask`), else shared (:meth:`post`), with a reader thread that hands each
    call's reply to its callback."""

    def __init__(self, sock: socket.socket, dest: str, main: bool) -> None:
        self.sock, self.dest, self.main = sock, dest, main
        self.frames = Frames(sock)
        if main:  # its reads return after a slice, for the main thread to look around
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _MAIN_SLICE)
        self.write_lock = threading.Lock()
        self.ids = itertools.count(1)
        self.pending: dict[int, Callable[[Reply], None]] = {}  # call id -> on_reply
        self.busy = False  # the main thread's lane: reserved for a call (route())
        self.closed = False
        self.outbox: Outbox | None = None
        self.reader: threading.Thread | None = None
        self.turn = threading.Lock()  # who reads next: the reader, or one after it
        #: (the reader, since when) while the reader runs a reply's callbacks
        self.settling: tuple[threading.Thread, float] | None = None
        if not main:  # calls leave through an outbox; a reader thread completes them
            self.outbox = Outbox(sock, f"nbrpc-lane-out-{dest}", self.write_lock, self._lost)
            if not self._start_reader():
                self.close()
                raise RuntimeError(f"no thread could start to read a lane to {dest}")

    def _start_reader(self) -> bool:
        """A new thread reads this lane; False if none could start (the reader stays)."""
        old = self.reader
        self.reader = threading.Thread(
            target=self._read, name=f"nbrpc-lane-{self.dest}", daemon=True
        )
        try:
            self.reader.start()
        except RuntimeError:  # "can't start new thread": a process or cgroup's limit
            self.reader = old
            return False
        return True

    def hand_over(self) -> None:
        """Called on this lane's reader thread, in a callback about to wait for a call
        (``fut.then(lambda f: other.wait())``): that call's reply may come on this lane,
        which only its reader reads, so another thread reads from now on, and this one
        ends when its callback returns."""
        self._hand_over_from(threading.current_thread(), None)

    def _hand_over_from(
        self, reader: threading.Thread, since: tuple[threading.Thread, float] | None
    ) -> None:
        """A new thread reads this lane if ``reader`` still does (and, ``since`` given,
        is still in the callbacks it began then, not back at the socket: two readers
        would split its frames)."""
        with self.turn:
            if self.closed or self.reader is not reader:
                return
            if since is not None and self.settling is not since:
                return
            if self._start_reader():
                self.settling = None
                _watching.went_away(reader)

    def ask(self, payload: bytes, limit: float, wait_in_slices: Waiter) -> Reply | None:
        """The main thread's call on this lane, reserved for it by :func:`route`: its
        reply, or None when ``limit`` seconds (0: none) passed first (the lane is closed
        then: its answer would come where no one reads; the next call opens another).

        The answer is read in slices of :data:`MAIN_SLICE_S` by ``wait_in_slices(one_slice,
        limit)``, the main thread's wait (it keeps the clock, serves prompts, and reads the
        first slice on its own: a small call's answer comes within it). A stop
        (KeyboardInterrupt) closes the lane and goes on up."""
        try:
            self._send(payload, None)
            got: list[Reply] = []

            def one_slice() -> bool:
                reply = self.answer()
                if reply is not None:
                    got.append(reply)
                return bool(got)

            if not wait_in_slices(one_slice, limit):
                self.close()
                return None
            return got[0]
        except LaneLost as lost:
            return Reply(LOST, lost)
        except BaseException:  # the stop button: this lane's answer is no one's now
            self.close()
            raise
        finally:
            self.busy = False

    def post(self, payload: bytes, on_reply: Callable[[Reply], None]) -> None:
        """A call on this shared lane: ``on_reply(reply)`` runs on the reader thread when
        its reply comes, or here at once if the lane is lost."""
        try:
            self._send(payload, on_reply)
        except LaneLost as lost:
            on_reply(Reply(LOST, lost))

    def _send(self, payload: bytes, on_reply: Callable[[Reply], None] | None) -> None:
        call = next(self.ids)
        frame = FRAME.pack(call, len(payload), INLINE if self.main else POOLED) + payload
        if on_reply is not None:
            self.pending[call] = on_reply
        try:
            if self.outbox is not None:
                if not self.outbox.put(frame):
                    raise OSError("closed")
            else:
                with self.write_lock:
                    self.sock.sendall(frame)
        except OSError as exc:
            self.pending.pop(call, None)
            self.close()
            raise LaneLost(f"the lane to {self.dest} closed: {exc}") from None

    def _lost(self, exc: Any) -> None:
        self.close()  # the reader sees the end, and fails the calls waiting

    def answer(self) -> Reply | None:
        """The main thread's lane: the reply if it comes within :data:`MAIN_SLICE_S`,
        else None (a read that times out: the main thread then looks at signals, prompts
        and its clock, and reads again); raises :class:`LaneLost`. One ``recv`` where a
        ``poll`` and a ``recv`` were (about 10 µs a call, measured)."""
        try:
            frame = self.frames.next()
        except BlockingIOError:  # SO_RCVTIMEO passed: nothing yet
            return None
        except OSError as exc:
            raise self._closed_by_peer(f"({exc})") from None
        if frame is not None and frame[1] == VALUE:  # (receive(), without its frames)
            return _reply(VALUE, frame[2])
        return self._reply_of(frame)[1]

    def receive(self) -> tuple[int, Reply]:
        """The next reply on this lane and its call's id; raises :class:`LaneLost`."""
        try:
            frame = self.frames.next()
        except BlockingIOError:
            raise  # the main lane's read timed out
        except OSError as exc:  # ECONNRESET: the peer died with bytes unread
            raise self._closed_by_peer(f"({exc})") from None
        return self._reply_of(frame)

    def _reply_of(self, frame: tuple[int, int, Any] | None) -> tuple[int, Reply]:
        if frame is None or frame[1] not in REPLIES:
            raise self._closed_by_peer("(its process exited)")
        call, kind, payload = frame
        return call, _reply(kind, payload)

    def _closed_by_peer(self, why: str) -> LaneLost:
        self.close()
        return LaneLost(f"{self.dest} closed its end of the lane {why}")

    def _read(self) -> None:
        reading.lane = self  # futures complete here, and run their callbacks here
        me = threading.current_thread()
        lost: LaneLost | None = None
        try:
            while self.reader is me:  # (until handed over: :meth:`hand_over`)
                call, reply = self.receive()
                on_reply = self.pending.pop(call, None)
                if on_reply is not None:
                    self.settling = since = (me, time.monotonic())
                    try:
                        on_reply(reply)  # the future's callbacks run here
                    finally:
                        with self.turn:  # back to the socket, unless handed over
                            if self.settling is since:
                                self.settling = None
        except LaneLost as exc:
            lost = exc
        except Exception as exc:  # a reply that does not unpickle here: the lane is unusable
            lost = LaneLost(f"the lane to {self.dest} broke: {type(exc).__name__}: {exc}")
        finally:
            if self.reader is me:
                self.close()
                pending = list(self.pending.values())
                self.pending.clear()
                for on_reply in pending:
                    on_reply(Reply(LOST, lost))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outbox is not None:
            self.outbox.close()
        shut(self.sock)
        here.forget(self)


class _Watching:
    """The look, on the timer service every :data:`LOOK_EVERY_S` while this process has a
    shared lane, that hands a lane's reading over while its reader runs a slow callback
    (:func:`_look`), and the readers handed over that still run their callbacks (a thread
    ends as its callbacks return)."""

    def __init__(self) -> None:
        self.timer: _timers.Timer | None = None
        self.lock = threading.Lock()
        self.away: set[threading.Thread] = set()

    def start(self) -> None:
        """Called once a shared lane is in ``here.shared``: the looks go on (again)."""
        with self.lock:
            if self.timer is None:
                self.timer = _timers.after(LOOK_EVERY_S, _look)

    def went_away(self, reader: threading.Thread) -> None:
        with self.lock:
            self.away.add(reader)

    def still_away(self) -> int:
        with self.lock:
            self.away = {t for t in self.away if t.is_alive()}
            return len(self.away)

    def lanes_or_stop(self) -> list[Lane]:
        """The shared lanes; none: the looks end (under the lock :meth:`start` takes)."""
        with self.lock:
            lanes = list(here.shared.values())
            if not lanes:
                self.timer = None
            return lanes

    def again(self) -> None:
        """The next look, unless the looks ended meanwhile."""
        with self.lock:
            if self.timer is not None:
                self.timer = _timers.after(LOOK_EVERY_S, _look)

    def forget(self) -> None:
        """In a forked child: the parent's looks and readers are not the child's."""
        self.timer = None
        self.away = set()


_watching = _Watching()
_fork.in_child(_watching.forget)


def _look() -> None:
    """While this process has a shared lane: one whose reader has run one reply's
    callbacks for over :data:`SLOW_CALLBACK_S` is read by a new thread from then on; the
    old one ends when its callbacks return. Without, ``fut.then(slow)`` held up every
    other reply from that peer until ``slow`` returned; in torch it holds one of 16
    threads. At most :data:`MAX_AWAY` such readers at once. Short (a lock held for a
    moment, a thread started): it runs on the timer service's thread."""
    lanes = _watching.lanes_or_stop()
    if not lanes:
        return
    try:
        now = time.monotonic()
        for lane in lanes:
            since = lane.settling
            if since is None or now - since[1] <= SLOW_CALLBACK_S:
                continue
            if _watching.still_away() >= MAX_AWAY:
                break
            lane._hand_over_from(since[0], since)
    finally:
        _watching.again()


def _reply(kind: int, payload: bytes) -> Reply:
    if kind == VALUE:
        try:
            return Reply(VALUE, pickle.loads(payload))
        except Exception as exc:  # a class this process lacks, a staged CUDA tensor with no
            # room on its device: that call's error, as TensorPipe's future gives it (the
            # facade translates it the same way); the frames are whole, the lane goes on
            return Reply(UNREADABLE, exc)
    if kind in (FETCH, ON_DEVICE):
        return Reply(kind, int.from_bytes(payload, "little"))
    return Reply(RETRY, None)


def lane_to(dest: Any, main: bool) -> Lane | None:
    """This process's lane to ``dest`` (a WorkerInfo), opened on first use; None if the
    peer has none (its calls go through TensorPipe from then on)."""
    table = here.main if main else here.shared
    lane = table.get(dest.id)
    if lane is not None and not lane.closed:
        return lane
    directory = here.directory
    if directory is None:
        return None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # out of descriptors a moment: TensorPipe takes this call
        return None
    try:
        sock.connect(path_of(directory, dest.name))
    except OSError:
        sock.close()
        here.laneless.add(dest.id)
        return None
    lane = Lane(sock, dest.name, main)
    with here.lock:
        opened = here.directory is not None  # else closed meanwhile
        other = table.get(dest.id)  # another thread's first call to dest opened one too
        kept = opened and (other is None or other.closed)
        if kept:
            table[dest.id] = lane
    if kept:
        if not main:
            _watching.start()  # (once the lane is in the table: it looks there)
        return lane
    lane.close()  # (its reader, its socket and the peer's thread end with it)
    return other if opened else None
