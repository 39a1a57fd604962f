"""A process's side of a cancel (nbrpc/_wire/cancelling.py) on this thread's registry: no
workers. A call that returned and whose end waits for its output to reach the caller is
still reached by a cancel: its output's rest is dropped, nothing is interrupted."""

from __future__ import annotations

import threading

from nbrpc._wire import cancelling


def _origin() -> int:
    return cancelling.origin_here()  # a new one, as a call made on this thread gets


def test_a_cancel_during_a_calls_output_drain_drops_the_rest_and_interrupts_nothing():
    origin = _origin()
    entry = cancelling.running(origin, "shout", "worker0")
    cancelling.enter(entry)
    dropped: list[str] = []
    cancelling.leave(entry, draining=lambda: dropped.append(threading.current_thread().name))
    rows = cancelling.cancel([(origin, origin)], grace=0.1)
    assert dropped == [threading.current_thread().name]  # once, by the cancel
    assert [(r["name"], r["stopped"]) for r in rows] == [("shout", True)]
    assert not entry.interrupted  # the function had returned: no interrupt may fire
    cancelling.drained(entry)
    assert cancelling.cancel([(origin, origin)], grace=0.1) == []  # over: nothing listed


def test_a_call_that_ended_without_output_to_wait_for_is_not_listed():
    origin = _origin()
    entry = cancelling.running(origin, "add", "worker0")
    cancelling.enter(entry)
    cancelling.leave(entry)
    assert cancelling.cancel([(origin, origin)], grace=0.1, ask=True) == []
