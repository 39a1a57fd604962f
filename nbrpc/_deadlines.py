"""Call deadlines on nbrpc's own clock, which stands still while a debugger is open.

torch enforces an RPC's timeout in C++, on a clock nobody can stop: a call paused at a
worker's ``breakpoint()`` would fail with the 60 s default while a person is still typing
pdb commands. So nbrpc's calls go to torch with no timeout (0), and this module enforces
theirs instead, measured on :data:`clock`, which :mod:`nbrpc._debugger` pauses for as long
as a debugger session is open and resumes when it ends (``c`` or ``q``).

One daemon thread serves every deadline from a heap; a deadline whose future finished
first is dropped when it comes due (or when the heap is compacted), and holds the future
only weakly, so a finished call's result is not kept alive for the length of its timeout.
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

# [due on clock, sequence, weakref to the future or None once it finished, make_error]
_heap: list[list[Any]] = []
_cv = threading.Condition()
_seq = itertools.count()
_state: dict[str, Any] = {"thread": None, "finished": 0}
_COMPACT_AT = 4096  # entries; below this, finished entries simply wait for their due time


def expire_after(seconds: float, future: Any, make_error: Callable[[], BaseException]) -> None:
    """Fail ``future`` with ``make_error()`` if it has not finished ``seconds`` from now
    on :data:`clock`."""
    entry = [clock.now() + seconds, next(_seq), weakref.ref(future), make_error]
    with _cv:
        if _state["thread"] is None:
            thread = threading.Thread(target=_serve, name="nbrpc-deadlines", daemon=True)
            _state["thread"] = thread
            thread.start()
        if len(_heap) >= _COMPACT_AT and _state["finished"] * 2 > len(_heap):
            _heap[:] = [e for e in _heap if e[2] is not None]
            heapq.heapify(_heap)
            _state["finished"] = 0
        heapq.heappush(_heap, entry)
        if _heap[0] is entry:
            _cv.notify()
    future.add_done_callback(lambda _: _finished(entry))


def _finished(entry: list[Any]) -> None:
    with _cv:
        if entry[2] is not None:
            entry[2] = None
            _state["finished"] += 1


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
                    entry = heapq.heappop(_heap)
                    ref, make_error = entry[2], entry[3]
                    if ref is None:
                        _state["finished"] -= 1
                        continue
                    entry[2] = None  # out of the heap: its future's end counts nothing
                    break
                _cv.wait(due)
        future = ref()
        if future is None or future.done():
            continue
        with contextlib.suppress(Exception):  # finished meanwhile: the result won
            future.set_exception(make_error())
