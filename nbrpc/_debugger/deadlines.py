"""Call deadlines on nbrpc's own clock, which stands still while a debugger is open.

torch enforces an RPC's timeout in C++, on a clock nobody can stop: a call paused at a
worker's ``breakpoint()`` would fail with the 60 s default while a person is still typing
pdb commands. So nbrpc's calls go to torch with no timeout (0), and this module enforces
theirs instead, measured on :data:`clock`, which :mod:`nbrpc._debugger.prompts` pauses for as long
as a debugger session is open and resumes when it ends (``c`` or ``q``).

The deadlines are a heap here, on :data:`clock`; the process's timer service
(:mod:`nbrpc._timers`, one thread for everything done later) wakes it when the earliest
is due, and not while the clock is paused (a resume wakes it again). A deadline whose
future finished first is dropped when it comes due (or when the heap is compacted,
amortized over pushes), and holds the future only weakly, so a finished call's result is
not kept alive for the length of its timeout.
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

from nbrpc import _timers


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
    future, make_error]``; ``wake``: the timer service's entry for the earliest."""

    heap: list[list[Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: itertools.count = field(default_factory=itertools.count)
    wake: _timers.Timer | None = None
    compact_at: int = COMPACT_AT


_pending_deadlines = _Deadlines()


def expire_after(seconds: float, future: Any, make_error: Callable[[], BaseException]) -> None:
    """Fail ``future`` with ``make_error()`` if it has not finished ``seconds`` from now
    on :data:`clock`."""
    d = _pending_deadlines
    entry = [clock.now() + seconds, next(d.seq), weakref.ref(future), make_error]
    with d.lock:
        if len(d.heap) >= d.compact_at:  # drop finished calls' entries (amortized)
            d.heap[:] = [e for e in d.heap if _pending(e[2])]
            heapq.heapify(d.heap)
            d.compact_at = max(COMPACT_AT, 2 * len(d.heap))
        heapq.heappush(d.heap, entry)
        if d.heap[0] is entry:
            _wake_at_the_earliest()


def pending() -> int:
    """Deadlines kept now (finished calls' entries included until the heap is compacted)."""
    with _pending_deadlines.lock:
        return len(_pending_deadlines.heap)


def _pending(ref: Any) -> bool:
    future = ref()
    return future is not None and not future.done()


def _wake() -> None:
    with _pending_deadlines.lock:
        _wake_at_the_earliest()


def _wake_at_the_earliest() -> None:
    """(holding the lock) The timer service wakes :func:`_due` when the earliest deadline
    is due; none while the clock is paused."""
    d = _pending_deadlines
    if d.wake is not None:
        d.wake.cancel()
        d.wake = None
    if d.heap and not clock.paused:
        d.wake = _timers.after(d.heap[0][0] - clock.now(), _due)


def _due() -> None:
    """On the timer service's thread: each deadline that passed fails its future, on a
    thread of its own (:func:`_fail`)."""
    d = _pending_deadlines
    expired = []
    with d.lock:
        d.wake = None
        if clock.paused:
            return
        now = clock.now()
        while d.heap and d.heap[0][0] <= now:
            ref, make_error = heapq.heappop(d.heap)[2:]
            future = ref()
            if future is not None and not future.done():
                expired.append((future, make_error))
            del future
        _wake_at_the_earliest()
    for future, make_error in expired:
        _timers.on_its_own_thread(_fail, future, make_error())
    del expired


def _fail(future: Any, error: BaseException) -> None:
    """Fail ``future`` with ``error``, on a thread of its own: ``set_exception`` runs the
    future's callbacks on the thread that calls it, and a callback that waits on another
    call (a ``then`` that makes one) would hold the timer service's one thread, and with
    it every other deadline and delayed action in the process. Expiries are rare: a
    thread each is cheap."""
    with contextlib.suppress(Exception):  # finished meanwhile: the result won
        future.set_exception(error)
