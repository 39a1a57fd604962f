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


def _serve(origin: int, body, seen: list[str]) -> cancelling.Running:
    """``body()`` as a call of ``origin`` served on a thread of its own; what it raised,
    and where, in ``seen``."""
    entry = cancelling.running(origin, "episode", "worker0")
    started = threading.Event()

    def serve() -> None:
        entry.thread = threading.get_ident()
        try:
            cancelling.enter(entry)
            body(started, seen)
        except KeyboardInterrupt:
            seen.append("interrupted")
        finally:
            cancelling.leave(entry)

    thread = threading.Thread(target=serve)
    thread.start()
    started.wait(5)
    cancelling.cancel([(origin, origin)], grace=5)
    thread.join(5)
    assert not thread.is_alive()
    return entry


def test_a_cancel_during_a_send_interrupts_the_call_as_the_send_ends():
    """torch counts an RRef's fork as it pickles it into a message: an interrupt between
    that and the hand-over left a fork no message carried (every shutdown then waited on
    it). The send ends, then the interrupt comes."""

    def body(started: threading.Event, seen: list[str]) -> None:
        with cancelling.sends_held():
            seen.append("pickled")
            started.set()
            for _ in range(200):  # Python's own work: an interrupt would land in here
                threading.Event().wait(0.005)
            seen.append("handed over")
        for _ in range(200):
            threading.Event().wait(0.005)
        seen.append("ran on")

    seen: list[str] = []
    entry = _serve(_origin(), body, seen)
    assert seen == ["pickled", "handed over", "interrupted"]
    assert entry.interrupted


def test_a_cancel_outside_a_send_interrupts_at_once():
    def body(started: threading.Event, seen: list[str]) -> None:
        started.set()
        for _ in range(200):
            threading.Event().wait(0.005)
        seen.append("ran on")

    seen: list[str] = []
    _serve(_origin(), body, seen)
    assert seen == ["interrupted"]
