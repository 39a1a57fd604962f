"""nbrpc's call deadlines (nbrpc/_debugger/deadlines.py) on plain futures: no process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nbrpc._debugger import deadlines


def test_a_callback_of_an_expired_call_that_waits_on_another_does_not_stop_the_clock():
    """``rpc_async(..., timeout=0.1).then(<waits on a call of 0.3 s timeout>)``: the
    first expiry runs the callback; the second call still fails at its own time."""
    first, second = torch.futures.Future(), torch.futures.Future()
    waited: list[float] = []

    def on_first(_: torch.futures.Future) -> None:
        t0 = time.monotonic()
        failed = threading.Event()
        second.add_done_callback(lambda _: failed.set())
        failed.wait(10)
        waited.append(time.monotonic() - t0)

    first.add_done_callback(on_first)
    deadlines.expire_after(0.1, first, lambda: TimeoutError("first"))
    deadlines.expire_after(0.3, second, lambda: TimeoutError("second"))
    deadline = time.monotonic() + 15
    while not waited and time.monotonic() < deadline:
        time.sleep(0.02)
    assert waited, "the callback never returned"
    assert waited[0] < 5, f"the second call failed {waited[0]:.1f} s into the first's callback"
    with pytest.raises(TimeoutError, match="second"):
        second.wait()


def test_a_sliced_wait_reads_its_first_slice_alone_and_keeps_one_clock(monkeypatch):
    """The main thread's sliced wait (a lane's read, nbrpc/_debugger/prompts.py): the
    first slice is read before the prompts are looked at; its time counts against the
    limit on the one clock of timeouts; a stop in it cancels the cell's calls."""
    from nbrpc._debugger import prompts
    from nbrpc._wire import cancelling

    entered: list[int] = []
    real = prompts.main_thread_waits

    def counting(woke: threading.Event):
        entered.append(1)
        return real(woke)

    monkeypatch.setattr(prompts, "main_thread_waits", counting)
    assert prompts.wait_in_slices_on_main_thread(lambda: True, 5.0)
    assert entered == []  # answered in the first slice: no prompt desk

    t0 = time.monotonic()
    slices: list[float] = []

    def never() -> bool:
        slices.append(time.monotonic())
        time.sleep(prompts.SIGNAL_CHECK_S)
        return False

    assert not prompts.wait_in_slices_on_main_thread(never, 0.35)
    took = time.monotonic() - t0
    assert entered == [1]
    assert 0.35 <= took < 0.35 + 2 * prompts.SIGNAL_CHECK_S + 0.5  # the first slice counted
    assert len(slices) <= 5

    stops: list[int] = []
    monkeypatch.setattr(cancelling, "stopped", lambda: stops.append(1))

    def stop() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prompts.wait_in_slices_on_main_thread(stop, 5.0)
    assert stops == [1]  # the first slice's stop, as any other's
