"""The pool a callee runs a lane's pooled calls on (nbrpc/_wire/lanes/pool.py): calls that wait
on each other all get a thread (as on torch's pool), a stuck call does not hold up the
others, and it never has more threads than its size."""

from __future__ import annotations

import threading
import time

from nbrpc._wire.lanes.pool import Pool


def test_calls_meeting_at_a_barrier_all_finish_and_a_stuck_call_holds_up_no_one():
    threads: set[int] = set()
    done: list[int] = []
    lock = threading.Lock()

    def run(kind: str, value: object) -> None:
        with lock:
            threads.add(threading.get_ident())
        if kind == "meet":
            value.wait()  # a Barrier
        elif kind == "stuck":
            value.wait(30)  # an Event
        with lock:
            done.append(1)

    pool = Pool(4, run)
    barrier = threading.Barrier(4, timeout=20)
    for _ in range(4):
        pool.put(("meet", barrier))
    deadline = time.monotonic() + 20
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 4  # four threads met: each call got one
    assert len(threads) == 4

    release = threading.Event()
    pool.put(("stuck", release))
    for _ in range(200):
        pool.put(("quick", None))
    while len(done) < 204 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 204  # the quick calls ran beside the stuck one
    release.set()
    while len(done) < 205 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 205
    assert len(threads) <= 4  # never more than its size
    pool.stop()
