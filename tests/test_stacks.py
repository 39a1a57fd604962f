"""nbrpc.stacks(): every thread of every process, read from outside each worker, also of
busy workers (across hosts: tests/test_hosts.py, tests/test_slurm.py; %rpc_stacks:
tests/test_timeline.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import wait_until

import nbrpc
from nbrpc._wire import stack_dumps, stacks as dumps

CELL = """
import os
import time

def spin(seconds, until=None):
    # in Python, until ``seconds`` passed or the file ``until`` exists (os.access: C, so
    # a stack read meanwhile shows spin innermost)
    t = time.time()
    while time.time() - t < seconds and not (until and os.access(until, os.F_OK)):
        pass
    return seconds

def regex_in_c(n):
    import re
    return len(re.findall(r"(a+)+b", "a" * n))

def regex_size_for(seconds):
    # each "a" more doubles the regex's time: the n that holds the GIL about ``seconds``
    import math, time
    t0 = time.monotonic()
    regex_in_c(18)
    took = max(time.monotonic() - t0, 1e-4)
    return 18 + max(0, math.ceil(math.log2(seconds / took)))
"""


@pytest.fixture
def code(nb, cluster):
    return nb(CELL)


def test_stacks_come_within_2_s_when_every_rpc_thread_is_busy_or_holds_the_gil(
    cluster, code, tmp_path
):
    threads = cluster.settings.num_worker_threads
    done = tmp_path / "done"  # the spins end once it exists (at most 60 s)
    busy = [nbrpc.rpc_async("worker1", code.spin, (60.0, str(done))) for _ in range(threads)]
    n = nbrpc.rpc_sync("worker2", code.regex_size_for, (10.0,))  # (28 took 30 s here)
    held = nbrpc.rpc_async("worker2", code.regex_in_c, (n,))  # seconds in C, GIL held

    def started() -> bool:  # every call runs its function (a busy machine starts them late:
        # a thread is labelled serving from the call's start, before it enters the function)
        rows = {r["name"]: r for r in nbrpc.stacks("worker1", "worker2")}
        inside = [
            t
            for r in rows.values()
            for t in r["threads"]
            if t["serving"] and {"spin", "regex_in_c"} & {f["function"] for f in t["frames"]}
        ]
        return len(inside) == threads + 1

    assert wait_until(started, timeout=8.0), "the calls did not all start"
    me = nbrpc.get_worker_info().name
    t0 = time.monotonic()
    rows = nbrpc.stacks()
    took = time.monotonic() - t0
    assert took < 2.0, f"stacks took {took:.2f} s"
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {me, "worker1", "worker2"}
    serving = [t for t in by_name["worker1"]["threads"] if t["serving"]]
    assert len(serving) == threads, by_name["worker1"]["threads"]
    for t in serving:
        assert t["serving"].startswith(f"spin from {me}")
        assert t["frames"][-1]["function"] == "spin"
    assert not held.done(), f"the regex (n={n}) ended before the stacks were read"
    (regex,) = [t for t in by_name["worker2"]["threads"] if t["serving"]]
    assert regex["serving"].startswith(f"regex_in_c from {me}")
    assert [f["function"] for f in regex["frames"]][-2:] == ["regex_in_c", "findall"]
    assert by_name["worker1"]["how"] == "thread"  # its threads run Python: the GIL turns
    assert by_name["worker2"]["how"] == "signal"  # held in C: faulthandler, without it
    assert by_name[me]["how"] == "this process"
    main = [t for t in by_name[me]["threads"] if t["name"] == "MainThread"]
    assert main
    assert main[0]["frames"][-1]["function"] == "here"
    done.touch()
    for fut in busy:  # nothing was disturbed: every call finishes with its own result
        assert fut.wait() == 60.0
    assert held.wait() == 0
    (only,) = nbrpc.stacks("worker2")
    assert only["name"] == "worker2"
    assert not [t for t in only["threads"] if t["serving"]]
    with pytest.raises(nbrpc.UnknownWorkerError, match="worker9"):
        nbrpc.stacks("worker9")


#: a program whose process set its stacks up (this file's ``stacks.py``, by path)
INSTALLED = """
import importlib.util, sys, threading, time
spec = importlib.util.spec_from_file_location("stacks", sys.argv[1])
stacks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stacks)
stacks.install()
"""


@contextlib.contextmanager
def running(program: str) -> Iterator[subprocess.Popen]:
    """``INSTALLED + program`` in a process of its own, once it printed "ready"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", INSTALLED + program, dumps.__file__],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


CHURN = """

def leaf(x):
    return x + 1

def spin():
    while True:
        for i in range(1000):
            leaf(i)
        threading.Thread(target=int).start()  # thread states come and go

for _ in range(8):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_asking_a_process_whose_threads_come_and_go_100_times_never_crashes_it():
    """faulthandler's dump of all threads from its signal handler reads the thread list
    without a lock: in this process it died of SIGSEGV within 200 dumps in 5 of 5 runs.
    Asked, the process's own thread answers under the GIL, and the signal is kept for a
    thread that holds the GIL in C."""
    with running(CHURN) as proc:
        hows = []
        for _ in range(100):
            part = dumps.collect([proc.pid])[proc.pid]
            assert proc.poll() is None, f"the process died (exit {proc.returncode})"
            assert "error" not in part, part
            hows.append(part["how"])
        assert set(hows) == {"thread"}, hows
        threads = stack_dumps.parse(part["dump"])
        spinning = [t for t in threads if "spin" in [f["function"] for f in t["frames"]]]
        assert len(spinning) == 8, threads
        assert not [t for t in threads if t["name"] == "nbrpc-stacks"]  # nbrpc's, hidden


DEEP = """

def down(depth):
    if depth:
        return down(depth - 1)
    time.sleep(60)

for _ in range(80):
    threading.Thread(target=down, args=(95,), daemon=True).start()
time.sleep(0.5)
print("ready", flush=True)
time.sleep(60)
"""


def test_two_readers_at_once_each_get_a_whole_dump_larger_than_the_first_map():
    """The thread answers into a map (one GIL turn, no system call); its first size is
    ANSWER_BYTES, and 80 threads 95 frames deep need more, so it grows. Two readers that
    ask at the same moment each find their own token named in the answer."""
    with running(DEEP) as proc:
        parts: list = [None, None]

        def read(i: int) -> None:
            parts[i] = dumps.collect([proc.pid])[proc.pid]

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        for part in parts:
            assert "error" not in part, part
            assert part["how"] == "thread"
            assert len(part["dump"].encode()) > dumps.ANSWER_BYTES
            deep = [t for t in stack_dumps.parse(part["dump"]) if len(t["frames"]) > 95]
            assert len(deep) == 80, part["dump"][-2000:]
        assert proc.poll() is None


def test_stacks_never_signal_a_process_that_did_not_set_them_up(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        found = dumps.collect([other.pid, 2**22 + 12345], timeout=0.5)
        assert "not set up" in found[other.pid]["error"]
        assert found[2**22 + 12345]["error"] == "no such process"
        assert other.poll() is None, "the process was signalled and died"
    finally:
        other.kill()
        other.wait()


def test_a_faulthandler_dump_parses_into_threads_innermost_last(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(
        "import faulthandler, sys, threading, time\n"
        "def deep():\n    faulthandler.dump_traceback(all_threads=True)\n"
        "def middle():\n    deep()\n"
        "t = threading.Thread(target=time.sleep, args=(2,), daemon=True); t.start()\n"
        "middle()\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=os.environ
    )
    threads = stack_dumps.parse(out.stderr)
    assert len(threads) == 2, out.stderr
    (current,) = [t for t in threads if t["current"]]
    assert [f["function"] for f in current["frames"]][-3:] == ["<module>", "middle", "deep"]
    assert current["frames"][-1]["line"] == 3
