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
