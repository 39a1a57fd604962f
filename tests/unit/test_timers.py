"""The timer service (nbrpc/_timers.py) and the fork hooks (nbrpc/_fork.py): one thread
for every delayed action of a process, and a child forked from it starts its own."""

from __future__ import annotations

import os
import threading

from nbrpc import _fork, _timers


def test_actions_run_in_their_order_on_one_thread_and_a_cancelled_one_does_not():
    ran: list[tuple[str, str]] = []
    done = threading.Event()

    def note(what: str) -> None:
        ran.append((what, threading.current_thread().name))
        if what == "last":
            done.set()

    _timers.after(0.15, note, "last")
    _timers.after(0.05, note, "first")
    dropped = _timers.after(0.1, note, "cancelled")
    _timers.after(0.1, note, "second")
    dropped.cancel()
    assert done.wait(10), "the last action never ran"
    assert [what for what, _ in ran] == ["first", "second", "last"]
    assert {thread for _, thread in ran} == {"nbrpc-timers"}


def test_an_action_that_raises_leaves_the_service_serving(caplog):
    after = threading.Event()

    def fails() -> None:
        raise RuntimeError("boom")

    _timers.after(0.0, fails)
    _timers.after(0.05, after.set)
    assert after.wait(10), "the service stopped after an action raised"
    assert any("a delayed action failed" in r.getMessage() for r in caplog.records)


def test_a_forked_child_runs_its_hooks_and_its_own_timer_service():
    reset: list[int] = []
    _fork.in_child(lambda: reset.append(os.getpid()))
    _timers.after(0.0, lambda: None)  # the parent's service runs
    pid = os.fork()
    if pid == 0:  # the child: its hook ran, and a timer runs on a thread of its own
        ok = threading.Event()
        _timers.after(0.01, ok.set)
        os._exit(0 if reset == [os.getpid()] and ok.wait(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's hooks or timers did not run"
    assert reset == []  # the parent's hooks did not run in the parent


def test_cancelled_entries_do_not_pile_up():
    for _ in range(_timers.COMPACT_AT + 10):
        _timers.after(300, lambda: None).cancel()  # (a finished call's deadline)
    _timers.after(300, lambda: None).cancel()
    assert _timers.pending() < _timers.COMPACT_AT


def test_work_on_several_hosts_runs_at_once_and_its_wait_is_bounded():
    """``_timers.at_once``: every item on a thread of its own at the same time (three
    that each wait for the other two finish), named nbrpc-action; a ``timeout`` bounds
    the wait for one that hangs."""
    import time

    together = threading.Barrier(3, timeout=10)
    names: list[str] = []

    def host(i: int) -> None:
        together.wait()
        names.append(threading.current_thread().name)

    _timers.at_once(host, [(i,) for i in range(3)], None)
    assert names == ["nbrpc-action"] * 3
    hang = threading.Event()
    t0 = time.monotonic()
    _timers.at_once(hang.wait, [(30,), (30,)], 0.2)
    assert time.monotonic() - t0 < 5
    hang.set()


def test_work_handed_to_the_service_runs_there_and_the_caller_waits_for_it():
    """The kernel shows workers' output on the service's thread (``show_output``): one
    thread, not each RPC thread, holds ipykernel's socket for the notebook's streams."""
    ran = []

    def where(tag):
        ran.append((tag, threading.current_thread().name))

    _timers.on_service_thread(where, "from a caller")
    assert ran == [("from a caller", "nbrpc-timers")]  # done before it returned

    def nested():
        _timers.on_service_thread(where, "from the service")  # at once, no wait on itself

    _timers.on_service_thread(nested)
    assert ran[-1] == ("from the service", "nbrpc-timers")
    threads = [
        threading.Thread(target=_timers.on_service_thread, args=(where, i)) for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert {name for _, name in ran} == {"nbrpc-timers"}
    assert len(ran) == 6
