"""What a boot keeps (nbrpc/_lifecycle/booted.py): a stopped boot lets the joins it asked
end, within a bound, before the group forgets their names. No workers: ipyparallel's
results stand in as objects with its ``wait(timeout)``."""

from __future__ import annotations

import threading
import time

from nbrpc._lifecycle.booted import Booted


class _Join:
    """An AsyncResult's ``wait``: done after ``seconds`` (None: never)."""

    def __init__(self, seconds: float | None) -> None:
        self.done = threading.Event()
        if seconds is not None:
            threading.Timer(seconds, self.done.set).start()

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)


def test_a_stopped_boot_waits_for_its_joins_on_their_way_then_lets_go():
    booted = Booted()
    quick, slow = _Join(0.2), _Join(0.4)
    booted.asked = {"worker1": quick, "worker2": slow}
    t0 = time.monotonic()
    booted.let_joins_end(timeout=10)
    assert quick.done.is_set()
    assert slow.done.is_set()  # both waited for, not the first only
    assert time.monotonic() - t0 < 5
    assert booted.asked == {}


def test_a_join_that_never_ends_holds_the_cleanup_up_no_longer_than_the_bound():
    booted = Booted()
    booted.asked = {"worker1": _Join(None), "worker2": _Join(None)}
    t0 = time.monotonic()
    booted.let_joins_end(timeout=0.3)
    assert time.monotonic() - t0 < 2  # one bound for all, not one each
    assert booted.asked == {}
