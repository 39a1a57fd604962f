"""One thread for everything this process does later: the timer service.

What nbrpc does after a delay (a call's deadline, a line updated in place sent to the
kernel, a worker's held output shown, a cancel's late report, a stop pressed again, a
side panel's fallback card) is an entry in one heap, served by one daemon thread,
``nbrpc-timers``, started at the first entry. Before, each was a ``threading.Timer``: a
thread of its own per delay, each kind another name in a process's thread list.

An action runs on the service's thread, so it must be short and must not wait for long
(a call's answer, a lock held across a call): it would hold every later action up. One
that may wait starts a thread of its own (:func:`nbrpc._debugger.deadlines` fails a
future on its own thread for that reason). An action that raises is logged, and the
service goes on. A cancelled entry stays in the heap until it is due or the heap is
compacted (amortized over pushes), holding nothing but its arguments.

In a forked child (workers are forked from the zygote) the service starts again at the
child's first entry: the parent's thread and entries are not the child's.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import _fork

log = logging.getLogger(__name__)

COMPACT_AT = 4096  # entries; below this, cancelled entries wait for their due time


class Timer:
    """One action due at ``due`` (``time.monotonic()``); :meth:`cancel` drops it."""

    __slots__ = ("action", "args", "cancelled", "due")

    def __init__(self, due: float, action: Callable[..., Any], args: tuple) -> None:
        self.due, self.action, self.args, self.cancelled = due, action, args, False

    def cancel(self) -> None:
        """The action will not run (if it has not begun). Raises nothing."""
        self.cancelled = True
        self.args = ()


@dataclass
class _Service:
    heap: list[tuple[float, int, Timer]] = field(default_factory=list)
    cv: threading.Condition = field(default_factory=threading.Condition)
    seq: itertools.count = field(default_factory=itertools.count)
    thread: threading.Thread | None = None
    compact_at: int = COMPACT_AT


_service = _Service()


def after(seconds: float, action: Callable[..., Any], *args: Any) -> Timer:
    """Run ``action(*args)`` on the service's thread ``seconds`` from now; the entry, to
    cancel it."""
    timer = Timer(time.monotonic() + max(seconds, 0.0), action, args)
    s = _service
    with s.cv:
        if s.thread is None:
            s.thread = threading.Thread(target=_serve, name="nbrpc-timers", daemon=True)
            s.thread.start()
        if len(s.heap) >= s.compact_at:  # drop cancelled entries (amortized)
            s.heap[:] = [e for e in s.heap if not e[2].cancelled]
            heapq.heapify(s.heap)
            s.compact_at = max(COMPACT_AT, 2 * len(s.heap))
        entry = (timer.due, next(s.seq), timer)
        heapq.heappush(s.heap, entry)
        if s.heap[0] is entry:
            s.cv.notify()
    return timer


def on_service_thread(action: Callable[..., Any], *args: Any, timeout: float = 30.0) -> None:
    """Run ``action(*args)`` on the service's thread now, and return once it ran (at most
    ``timeout`` seconds: it then runs when the service gets to it). On that thread
    already, it runs at once. For short work that must happen on one long-lived thread
    rather than on the caller's (the kernel's output: :func:`nbrpc._wire.output.show_output`)."""
    if threading.current_thread() is _service.thread:
        action(*args)
        return
    ran = threading.Event()

    def run() -> None:
        try:
            action(*args)
        finally:
            ran.set()

    after(0, run)
    ran.wait(timeout)


def on_its_own_thread(action: Callable[..., Any], *args: Any) -> threading.Thread:
    """Run ``action(*args)`` now on a thread of its own (``nbrpc-action``): for an action
    due on the service that may wait (a future's callbacks, questions to every process),
    which must not hold the service's thread up. The thread, started."""
    thread = threading.Thread(target=action, args=args, name="nbrpc-action", daemon=True)
    thread.start()
    return thread


def at_once(action: Callable[..., Any], each: Iterable[tuple], timeout: float | None) -> None:
    """``action(*args)`` for each ``args`` of ``each``, all at once, each on a thread of
    its own (:func:`on_its_own_thread`), and return when all returned, or ``timeout``
    seconds from now (None: no limit): work on several hosts, each over its own
    connection (stack dumps, engines stopped over ssh)."""
    threads = [on_its_own_thread(action, *args) for args in each]
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def pending() -> int:
    """Entries in the heap now (cancelled ones included until due or compacted)."""
    with _service.cv:
        return len(_service.heap)


def _serve() -> None:
    s = _service
    while True:
        with s.cv:
            while True:
                if not s.heap:
                    s.cv.wait()
                    continue
                wait = s.heap[0][0] - time.monotonic()
                if wait <= 0:
                    timer = heapq.heappop(s.heap)[2]
                    break
                s.cv.wait(wait)
        if timer.cancelled:
            continue
        action, args = timer.action, timer.args
        timer.cancel()  # ran: its arguments are let go
        try:
            action(*args)
        except Exception:
            log.exception(
                "nbrpc: a delayed action failed (%s)", getattr(action, "__name__", action)
            )
        del action, args, timer


def _after_fork_in_child() -> None:
    """The parent's thread is not the child's, nor its entries (see the module doc)."""
    global _service
    with contextlib.suppress(Exception):
        _service = _Service()


_fork.in_child(_after_fork_in_child)
