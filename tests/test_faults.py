"""A worker dies: calls fail fast and clearly, the kernel lives, the cluster rebuilds."""

import gc
import os
import signal
import time

import pytest
import torch
from conftest import ensure_cluster, notebook_code, run_script, wait_until

import nbrpc
from nbrpc import _ledger, _torch
from nbrpc.optim import DistributedOptimizer

CELL = """
import time
import torch

def slow(seconds):
    time.sleep(seconds)
    return seconds

def param():
    return torch.ones(2, requires_grad=True)

def crash(message):
    # what a C++ library does when it gives up: a line on stderr, then abort()
    import os
    os.write(2, message.encode())
    os.abort()
"""


def test_killed_worker_fails_calls_fast_and_the_cluster_rebuilds(cluster):
    cell = notebook_code(CELL)
    victim = cluster.workers[2]
    handles_before = _ledger.handle_count()
    p1 = nbrpc.remote("worker1", cell.param)
    p2 = nbrpc.remote("worker2", cell.param)
    p1.to_here()
    p2.to_here()
    in_flight = nbrpc.rpc_async("worker2", cell.slow, args=(30,))
    time.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(nbrpc.WorkerDiedError, match=r"worker2 is gone.*%rpc_shutdown") as died:
        in_flight.wait()
    assert "last output" not in str(died.value)  # kill -9 leaves nothing to show
    noticed = time.monotonic() - t0
    assert noticed < 10, f"a call waiting on a dead worker took {noticed:.1f} s to fail"
    print(f"in-flight call failed {noticed:.2f} s after the kill")

    with pytest.raises(nbrpc.WorkerDiedError, match="worker2 is gone"):
        nbrpc.rpc_sync("worker2", min, args=(1, 2))
    assert nbrpc.rpc_sync("worker1", min, args=(1, 2)) == 1  # the rest still works

    with pytest.raises(nbrpc.WorkerDiedError, match=r"owning parameters.*worker1, worker2"):
        DistributedOptimizer(torch.optim.SGD, [p1, p2], lr=0.1)

    deadline = time.monotonic() + 20  # ipyparallel/the OS report the death
    while "worker2" not in cluster.dead_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"%rpc_status shows worker2 dead {time.monotonic() - t0:.2f} s after the kill")
    rows = {line.split()[0]: line for line in cluster.summary().splitlines()[2:]}
    assert rows["worker2"].endswith("dead")
    assert rows["worker1"].endswith("ready")

    del p1, p2

    def released() -> bool:
        gc.collect()
        return _ledger.handle_count() == handles_before

    # a future keeps its exception from C++; a traceback on it once kept these RRefs (and
    # every later shutdown waited 5 s for their owners). Waited for: a reply still being
    # unpickled on an RPC thread holds its RRef for a moment
    assert wait_until(released, timeout=5), _ledger.handle_count() - handles_before
    t0 = time.monotonic()
    nbrpc.shutdown()
    took = time.monotonic() - t0
    assert took < 15, f"shutdown with a dead worker took {took:.1f} s"
    print(f"shutdown with a dead worker took {took:.2f} s")

    again = ensure_cluster()  # the same kernel rebuilds the cluster
    assert nbrpc.workers() == ["worker0", "worker1", "worker2"]
    assert nbrpc.rpc_sync("worker2", cell.slow, args=(0,)) == 0
    assert all(r.state == "ready" for r in again.workers)


def test_a_crashed_worker_s_last_output_is_in_the_error(cluster):
    """A worker that aborts (found on a GPU: torch's C++ allocator gave up) left only "its
    connection closed"; the error now ends with what the process printed last."""
    cell = notebook_code(CELL)
    held = nbrpc.remote("worker1", cell.param)
    held.to_here()
    message = "terminate called after throwing an instance of 'c10::Error' (a test)\n"
    with pytest.raises(nbrpc.WorkerDiedError) as caught:
        nbrpc.rpc_sync("worker1", cell.crash, args=(message,))
    text = str(caught.value)
    print(text)
    last = text.split("The last output of worker1's process:\n", 1)[1].splitlines()
    assert last[0] == "    " + message.strip()
    assert "    Fatal Python error: Aborted" in last  # faulthandler, with the call's stack
    assert any("in crash" in line for line in last), last
    assert nbrpc.rpc_sync("worker2", min, args=(1, 2)) == 1  # the kernel and others live
    nbrpc.shutdown()
    ensure_cluster()
    # an RRef kept from the crashed worker: the views say its owner is gone, and using it
    # says so too (torch: "could not find destination id 1")
    assert nbrpc.status()[0]["name"] == "worker0"
    assert [r["owner"] for r in nbrpc.ownership() if r["id"] == _torch.rref_id(held)] == ["(gone)"]
    with pytest.raises(nbrpc.WorkerDiedError, match="the worker that owned this RRef is gone"):
        held.to_here()


def test_last_words_are_a_crash_report_not_earlier_errors(tmp_path):
    """An engine's log also holds torch's error lines of earlier calls (their callers got
    them already): a worker killed by SIGKILL has no last words, not those lines."""
    from nbrpc._engines.local import last_words

    log = tmp_path / "engine.log"
    earlier = (
        "2026-11-22 22:14:28.813 [IPEngine.0] Handling apply_request: 1\n"
        "[E1122 23:09:46.506011825 request_callback_no_python.cpp:561] Received error "
        "while processing request type 258: ModuleNotFoundError: No module named 'x'\n"
        "At:\n  internal.py(163): deserialize\n"
    )
    log.write_text(earlier)
    assert last_words(str(log)) == ""
    crash = (
        "[W1122 23:10:01.1 tensorpipe_agent.cpp:723] RPC agent for worker1 encountered error\n"
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  Allocator not initialized for device\n"
        "Fatal Python error: Aborted\n\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "<notebook-cell-3>", line 2 in step\n\n'
        "Extension modules: numpy._core._multiarray_umath, torch._C\n"
    )
    log.write_text(earlier + crash)
    assert last_words(str(log)).splitlines() == [
        "    terminate called after throwing an instance of 'c10::Error'",
        "      what():  Allocator not initialized for device",
        "    Fatal Python error: Aborted",
        "    Current thread 0x00007f (most recent call first):",
        '      File "<notebook-cell-3>", line 2 in step',
    ]
    assert last_words(str(log), start=len(earlier + crash)) == ""  # before this engine
    # a report whose threads' stacks run past 16 KB (a worker with many threads): found
    stacks = "".join(
        f"\nThread 0x{i:016x} (most recent call first):\n"
        + '  File "/venv/lib/python3.11/site-packages/torch/distributed/rpc/api.py", '
        "line 82 in wait\n" * 30
        for i in range(20)
    )
    assert len(stacks) > 40_000
    head = crash[: crash.index("Current thread")]
    log.write_text(earlier + head + stacks + crash[crash.index("Current thread") :])
    said = last_words(str(log)).splitlines()
    assert said[2:4] == [  # the crashing thread's stack, not the first thread listed
        "    Fatal Python error: Aborted",
        "    Current thread 0x00007f (most recent call first):",
    ], said
    # another thread's unfinished line before the report: the report is still found
    log.write_text(earlier + "[W1122 23:10:01.1 half a line" + crash[crash.index("Fatal") :])
    assert last_words(str(log)).splitlines()[:2] == [
        "    Fatal Python error: Aborted",
        "    Current thread 0x00007f (most recent call first):",
    ]


HALF_JOIN = '''
import time, nbrpc
from nbrpc._engines import worker

def half_join(name, rank, store, *rest):
    """What a worker leaves when its join fails half way: torch's join token taken and
    its name listed (rpc_prefix_0: the prefix torch's init_rpc gives a fresh process)."""
    import torch.distributed as dist
    from nbrpc import _group, _torch
    base = _group.StoreSpec(**store).open(is_master=False, timeout_s=5)
    s = dist.PrefixStore("rpc_prefix_0", base)
    mine = f"Token_for_{name}_join"
    assert s.compare_set(_torch.GROUP_TOKEN_KEY, "", mine).decode() == mine
    names = dist.PrefixStore("names", s)
    key = _torch.MEMBER_LIST_KEY
    listed = names.get(key).decode() if names.check([key]) else ""
    names.set(key, listed + f"{name}-{rank},")
    raise RuntimeError("connect: ECONNREFUSED (worker0)")

real = worker.join
worker.join = half_join
try:
    nbrpc.init(n=1, progress=False)
except nbrpc.BootError as e:
    print("failed:", str(e).splitlines()[0])
worker.join = real
c = nbrpc.init(n=1, progress=False)
print("again:", nbrpc.rpc_sync("worker1", lambda: "ok"))
nbrpc.shutdown()
'''


def test_a_boot_whose_join_failed_half_way_leaves_the_kernel_able_to_boot_again(tmp_path):
    """A worker that took torch's join token and listed its name, then failed (as one that
    could not reach the kernel does): without cleanup the next boot's worker1 was "not
    unique" and the kernel's exit waited 60 s on the token."""
    t0 = time.monotonic()
    out = run_script(tmp_path / "half_join.py", HALF_JOIN, timeout=120)
    took = time.monotonic() - t0
    assert "failed: worker1 could not join the RPC group: RuntimeError: connect" in out
    assert "again: ok" in out
    assert took < 45, f"{took:.0f} s: the exit waited on the join token"
