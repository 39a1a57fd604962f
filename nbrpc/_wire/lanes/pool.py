"""The threads a callee runs a lane's pooled calls on (:mod:`nbrpc._wire.lanes`).

torch runs a process's calls on a pool of ``num_worker_threads`` threads, so calls that
wait on each other (four calls meeting at a barrier) all get a thread and all finish.
This pool keeps that, and runs a burst of short calls on as few threads as keep up.

A pool that wakes a thread for every call (what a queue with every thread waiting on it
does) spent 90-130 ms of system time on 1,000 echo calls here, 16 threads taking turns
at the GIL. Here a thread that finishes a call takes the next one without sleeping,
and another thread starts on a waiting call only when no call started or ended for
:data:`STUCK_S` (every running call waits on something, or runs long): one of the
idle threads, the *watcher*, looks at that while calls wait.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from nbrpc._wire.callee import serve_lanes_here

#: seconds without a call starting or ending, calls waiting, before another thread starts one
STUCK_S = 1e-3


class Pool:
    """Runs ``run(*item)`` for each item put, on up to ``size`` threads made as needed."""

    def __init__(self, size: int, run: Callable[..., None]) -> None:
        self.size, self.run = max(1, size), run
        self.items: collections.deque = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.threads = self.idle = self.running = 0
        self.watcher = False  # an idle thread waits STUCK_S at a time to look
        self.progress = 0.0  # when a call last started or ended
        self.stopped = False

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            if self.running and (self.watcher or not self._may_grow()):
                return  # a running thread takes it next, or the watcher will
            self._another()

    def _may_grow(self) -> bool:
        return self.idle > 0 or self.threads < self.size

    def _another(self) -> None:
        """Wake an idle thread, or start one if the pool may have more (under the lock)."""
        if self.idle:
            self.cond.notify()
        elif self.threads < self.size:
            self.threads += 1
            threading.Thread(target=self._work, name="nbrpc-lane-pool", daemon=True).start()

    def _work(self) -> None:
        serve_lanes_here()
        cond, items = self.cond, self.items
        ran = False
        while True:
            with cond:
                if ran:  # a call ended: this thread is free, so it takes the next at once
                    self.running -= 1
                    self.progress = time.monotonic()
                item = items.popleft() if ran and items else self._next(cond, items)
                if item is None:
                    return
                self.running += 1
                self.progress = time.monotonic()
                if items and not self.watcher and self._may_grow():  # the next one waits
                    self._another()
            try:
                self.run(*item)
            except Exception:  # (run answers its call itself; a thread that ended here
                pass  # would have left its count taken and the calls behind it waiting)
            finally:
                del item
                ran = True

    def _next(self, cond: threading.Condition, items: collections.deque) -> Any:
        """The next item this thread runs (None: the pool stopped), waiting as needed."""
        while not self.stopped:
            if items and (not self.running or time.monotonic() - self.progress >= STUCK_S):
                return items.popleft()  # nothing runs, or every running call is stuck
            if items and not self.watcher:
                self.watcher = True  # calls wait behind running ones: look again soon
                try:
                    self.idle += 1
                    cond.wait(STUCK_S)
                finally:
                    self.idle -= 1
                    self.watcher = False
                continue
            self.idle += 1
            try:
                cond.wait()
            finally:
                self.idle -= 1
        return None

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
