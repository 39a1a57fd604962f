"""The deadlock watch's decisions (nbrpc/_calls/deadlock.py), poll by poll, over a real
torch TCPStore: two workers' watches in the orders their polls can come.

The end-to-end test (tests/test_nested_call_deadlocks.py) jams real workers; there the
order of the two workers' polls is the machine's. Here each order is forced, the one
that left a worker jammed unseen included: the worker that found the deadlock freed
itself and cleared its word before the other read it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from nbrpc._calls.deadlock import STUCK_S, Watch

STUCK_ON_2 = (16, 1, ["worker2"])
STUCK_ON_1 = (16, 0, ["worker1"])


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def members():
    return [SimpleNamespace(name=n) for n in ("worker0", "worker1", "worker2")]


def test_a_worker_told_it_deadlocks_fails_its_waits_after_the_teller_is_free(store):
    w1, w2 = Watch(store, "worker1"), Watch(store, "worker2")
    for w, stuck in ((w1, STUCK_ON_2), (w2, STUCK_ON_1)):
        assert w.step(stuck, 0.0, members) == ""  # stuck, not yet for long
    later = STUCK_S + 0.1
    assert w1.step(STUCK_ON_2, later, members) == ""  # worker2 has not said it is stuck
    why = w2.step(STUCK_ON_1, later, members)
    assert why.startswith("the RPC threads of worker1, worker2 (worker1 16, worker2 16")
    # worker2 failed its waits, is free, and clears its word before worker1 polls again
    assert w2.step(None, later + 0.2, members) == ""
    assert w1.step(STUCK_ON_2, later + 0.25, members) == why
    # told once: the word is used up
    assert w1.step(STUCK_ON_2, later + 0.5, members) == ""


def test_no_verdict_while_a_worker_on_the_chain_can_make_progress(store):
    w1, w2 = Watch(store, "worker1"), Watch(store, "worker2")
    later = STUCK_S + 0.1
    w1.step(STUCK_ON_2, 0.0, members)
    assert w1.step(STUCK_ON_2, later, members) == ""
    assert w2.step(None, later, members) == ""  # worker2 computes: nothing is failed
    assert w1.step(STUCK_ON_2, later + 0.25, members) == ""


def test_a_word_that_came_after_the_worker_was_free_fails_no_later_jam(store):
    """worker2 reads worker1's word; worker1 is freed (it clears its keys) before
    worker2 writes the verdict; worker1 is later stuck on a worker that computes."""

    class Slow:  # worker2's view of the store: worker1 is freed just before the write
        def __getattr__(self, name):
            return getattr(store, name)

        def set(self, key, value):
            if key.endswith("worker1") and "deadlocked" in key and value:
                assert w1.step(None, later + 0.01, members) == ""
            store.set(key, value)

    w1, w2 = Watch(store, "worker1"), Watch(Slow(), "worker2")
    later = STUCK_S + 0.1
    for w, stuck in ((w1, STUCK_ON_2), (w2, STUCK_ON_1)):
        w.step(stuck, 0.0, members)
    w1.step(STUCK_ON_2, later, members)
    assert w2.step(STUCK_ON_1, later, members)  # the verdict, written after worker1 cleared
    assert w2.step(None, later + 0.05, members) == ""
    # worker1 stuck again, on worker2 which computes now: no deadlock, no error
    w1.step(STUCK_ON_2, later + 1.0, members)
    assert w1.step(STUCK_ON_2, later + 1.0 + STUCK_S, members) == ""
    assert w1.step(STUCK_ON_2, later + 1.25 + STUCK_S, members) == ""


def test_a_worker_whose_waits_failed_and_still_looks_stuck_waits_anew(store):
    """Its threads take a moment to unwind: the next poll is not a second verdict."""
    w1, w2 = Watch(store, "worker1"), Watch(store, "worker2")
    later = STUCK_S + 0.1
    for w, stuck in ((w1, STUCK_ON_2), (w2, STUCK_ON_1)):
        w.step(stuck, 0.0, members)
    w1.step(STUCK_ON_2, later, members)
    assert w2.step(STUCK_ON_1, later, members)
    assert w2.step(STUCK_ON_1, later + 0.25, members) == ""
