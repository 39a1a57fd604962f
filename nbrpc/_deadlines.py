"""Call deadlines on nbrpc's own clock, which stands still while a debugger is open.

torch enforces an RPC's timeout in C++, on a clock nobody can stop: a call paused at a
worker's ``breakpoint()`` would fail with the 60 s default while a person is still typing
pdb commands. So nbrpc's calls go to torch with no timeout (0), and this module enforces
theirs instead, measured on :data:`clock`, which :mod:`nbrpc._debugger` pauses for as long
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
from typing import Any

__all__ = ["Clock", "clock", "expire_after"]


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

# [due on clock, sequence, weakref to the future, make_error]
_heap: list[list[Any]] = []
_cv = threading.Condition()
_seq = itertools.count()
_state: dict[str, Any] = {"thread": None, "compact_at": 4096}
_COMPACT_AT = 4096  # entries; below this, finished calls' entries wait for their due time


def expire_after(seconds: float, future: Any, make_error: Callable[[], BaseException]) -> None:
    """Fail ``future`` with ``make_error()`` if it has not finished ``seconds`` from now
    on :data:`clock`."""
    entry = [clock.now() + seconds, next(_seq), weakref.ref(future), make_error]
    with _cv:
        if _state["thread"] is None:
            thread = threading.Thread(target=_serve, name="nbrpc-deadlines", daemon=True)
            _state["thread"] = thread
            thread.start()
        if len(_heap) >= _state["compact_at"]:  # drop finished calls' entries (amortized)
            _heap[:] = [e for e in _heap if _pending(e[2])]
            heapq.heapify(_heap)
            _state["compact_at"] = max(_COMPACT_AT, 2 * len(_heap))
        heapq.heappush(_heap, entry)
        if _heap[0] is entry:
            _cv.notify()


def _pending(ref: Any) -> bool:
    future = ref()
    return future is not None and not future.done()


def _wake() -> None:
    with _cv:
        _cv.notify()


def _serve() -> None:
    while True:
        with _cv:
            while True:
                if not _heap or clock.paused:
                    _cv.wait()
                    continue
                due = _heap[0][0] - clock.now()
                if due <= 0:
                    ref, make_error = heapq.heappop(_heap)[2:]
                    break
                _cv.wait(due)
        future = ref()
        if future is None or future.done():
            continue
        with contextlib.suppress(Exception):  # finished meanwhile: the result won
            future.set_exception(make_error())
