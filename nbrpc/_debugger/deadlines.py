"""Call deadlines on nbrpc's own clock, which stands still while a debugger is open.

torch enforces an RPC's timeout in C++, on a clock nobody can stop: a call paused at a
worker's ``breakpoint()`` would fail with the 60 s default while a person is still typing
pdb commands. So nbrpc's calls go to torch with no timeout (0), and this module enforces
theirs instead, measured on :data:`clock`, which :mod:`nbrpc._debugger.prompts` pauses for as long
as a debugger session is open and resumes when it ends (``c`` or ``q``).

One daemon thread serves every deadline from a heap; a deadline whose future finished
first is dropped when it comes due (or when the heap is compacted, amortized over pushes),
and holds the future only weakly, so a finished call's result is not kept alive for the
length of its timeout.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Clock:
    """``time.monotonic()``, less the time spent paused (pauses may nest)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paused_total = 0.0
        self._paused_at: float | None = None
        self._pauses = 0

    def now(self) -> float:
        with self._lock:
            t = self._paused_at if self._paused_at is not None else time.monotonic()
            return t - self._paused_total

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    def pause(self) -> None:
        with self._lock:
            self._pauses += 1
            if self._pauses == 1:
                self._paused_at = time.monotonic()

    def resume(self) -> None:
        with self._lock:
            if self._pauses == 0:
                return
            self._pauses -= 1
            if self._pauses == 0 and self._paused_at is not None:
                self._paused_total += time.monotonic() - self._paused_at
                self._paused_at = None
        _wake()


clock = Clock()

COMPACT_AT = 4096  # entries; below this, finished calls' entries wait for their due time


@dataclass
class _Deadlines:
    """Every pending deadline, in a heap of ``[due on clock, sequence, weakref to the
    future, make_error]``, served by one daemon thread started at the first one."""

    heap: list[list[Any]] = field(default_factory=list)
    cv: threading.Condition = field(default_factory=threading.Condition)
    seq: itertools.count = field(default_factory=itertools.count)
    thread: threading.Thread | None = None
    compact_at: int = COMPACT_AT


_pending_deadlines = _Deadlines()


def expire_after(seconds: float, future: Any, make_error: Callable[[], BaseException]) -> None:
    """Fail ``future`` with ``make_error()`` if it has not finished ``seconds`` from now
    on :data:`clock`."""
    d = _pending_deadlines
    entry = [clock.now() + seconds, next(d.seq), weakref.ref(future), make_error]
    with d.cv:
        if d.thread is None:
            d.thread = threading.Thread(target=_serve, name="nbrpc-deadlines", daemon=True)
            d.thread.start()
        if len(d.heap) >= d.compact_at:  # drop finished calls' entries (amortized)
            d.heap[:] = [e for e in d.heap if _pending(e[2])]
            heapq.heapify(d.heap)
            d.compact_at = max(COMPACT_AT, 2 * len(d.heap))
        heapq.heappush(d.heap, entry)
        if d.heap[0] is entry:
            d.cv.notify()


def pending() -> int:
    """Deadlines kept now (finished calls' entries included until the heap is compacted)."""
    with _pending_deadlines.cv:
        return len(_pending_deadlines.heap)


def _pending(ref: Any) -> bool:
    future = ref()
    return future is not None and not future.done()


def _wake() -> None:
    with _pending_deadlines.cv:
        _pending_deadlines.cv.notify()


def _serve() -> None:
    d = _pending_deadlines
    while True:
        with d.cv:
            while True:
                if not d.heap or clock.paused:
                    d.cv.wait()
                    continue
                due = d.heap[0][0] - clock.now()
                if due <= 0:
                    ref, make_error = heapq.heappop(d.heap)[2:]
                    break
                d.cv.wait(due)
        future = ref()
        if future is None or future.done():
            continue
        error = make_error()
        threading.Thread(
            target=_fail, args=(future, error), name="nbrpc-deadline-expired", daemon=True
        ).start()
        del future


def _fail(future: Any, error: BaseException) -> None:
    """Fail ``future`` with ``error``, on a thread of its own: ``set_exception`` runs the
    future's callbacks on the thread that calls it, and a callback that waits on another
    call (a ``then`` that makes one) would hold this module's one thread, and with it
    every other deadline in the process. Expiries are rare: a thread each is cheap."""
    with contextlib.suppress(Exception):  # finished meanwhile: the result won
        future.set_exception(error)
