"""Load, re-runs and shutdown with work in flight: nothing lost, nothing hung, nothing leaked."""

import gc
import glob
import os
import re
import time
from collections import Counter

import psutil
import pytest
import torch
from conftest import ensure_cluster, notebook_code, running_kernel, steady, wait_until

import nbrpc
from nbrpc import _ledger

CELL = """
import time
import torch

def square(i):
    return i, i * i

def nap(seconds):
    time.sleep(seconds)
    return seconds

def ledger_size():
    from nbrpc import _ledger
    import gc
    gc.collect()
    return _ledger.handle_count()
"""

ME = psutil.Process()


def _rss_mb() -> float:
    gc.collect()
    return ME.memory_info().rss / 2**20


def _owned() -> dict[str, int]:
    return {r["name"]: r["rrefs_owned"] for r in nbrpc.status()}


def test_ten_thousand_rpc_async_calls_all_complete_once(cluster):
    nb = notebook_code(CELL)
    for i in range(200):  # warm both workers and the pickling caches
        nbrpc.rpc_async(f"worker{1 + i % 2}", nb.square, args=(i,)).wait()
    baseline = _rss_mb()
    t0 = time.monotonic()
    futs = [nbrpc.rpc_async(f"worker{1 + i % 2}", nb.square, args=(i,)) for i in range(10_000)]
    results = [f.wait() for f in futs]
    elapsed = time.monotonic() - t0
    assert Counter(i for i, _ in results) == Counter(range(10_000))  # none lost or doubled
    assert all(sq == i * i for i, sq in results)
    del futs, results
    grown = _rss_mb() - baseline
    print(f"10,000 rpc_async: {elapsed:.1f} s, kernel RSS {grown:+.1f} MB after")
    assert grown < 100, f"kernel memory grew {grown:.0f} MB after 10,000 calls"


def test_ten_thousand_rrefs_created_and_dropped_do_not_leak_on_owners(cluster):
    nb = notebook_code(CELL)
    owned_before = steady(_owned)
    ledgers_before = {w: nbrpc.rpc_sync(w, nb.ledger_size) for w in ("worker1", "worker2")}
    kernel_before = _ledger.handle_count()
    t0 = time.monotonic()
    checked = 0
    for batch in range(100):
        refs = [
            nbrpc.remote(f"worker{1 + i % 2}", torch.add, args=(torch.full((2,), i), 1))
            for i in range(100)
        ]
        if batch % 10 == 0:  # fetch some values: RRefs that were used, not only created
            assert [r.to_here()[0].item() for r in refs[:10]] == [i + 1 for i in range(10)]
            checked += 10
        del refs
    gc.collect()
    elapsed = time.monotonic() - t0
    assert wait_until(lambda: _owned() == owned_before, timeout=20), (
        f"owner-side RRef counts did not return: {_owned()} vs {owned_before}"
    )
    assert _ledger.handle_count() == kernel_before
    assert {w: nbrpc.rpc_sync(w, nb.ledger_size) for w in ("worker1", "worker2")} == (
        ledgers_before
    )
    print(f"10,000 RRefs created and dropped in {elapsed:.1f} s; owners back to {owned_before}")


def test_a_remote_handle_dropped_before_its_confirmation_is_let_go_on_a_python_thread(cluster):
    """torch would let go of it in its confirmation callback, on an RPC thread, where a
    delete can deadlock with a Python thread dropping another RRef (``nbrpc._ledger``)."""
    import threading
    import weakref

    nb = notebook_code(CELL)
    owned_before = steady(_owned)
    gone_on: list[str] = []
    rref = nbrpc.remote("worker1", nb.nap, args=(0.5,))
    seen = weakref.ref(rref, lambda _: gone_on.append(threading.current_thread().name))
    rref_id = _ledger.rref_id(rref)
    del rref
    gc.collect()
    assert seen() is not None, "let go before its owner confirmed it"
    assert not gone_on
    # what the user sees: dropped, although held until its creation settles
    assert rref_id not in {r["id"] for r in nbrpc.ownership()}
    assert wait_until(lambda: gone_on, timeout=10), "the held handle was never let go"
    assert gone_on[0] in ("nbrpc-timers", threading.main_thread().name), gone_on
    assert wait_until(lambda: _owned() == owned_before, timeout=10), _owned()


def test_graceful_shutdown_waits_for_calls_in_flight(cluster):
    nb = notebook_code(CELL)
    fut = nbrpc.rpc_async("worker1", nb.nap, args=(2.0,))
    time.sleep(0.2)
    t0 = time.monotonic()
    nbrpc.shutdown()
    took = time.monotonic() - t0
    assert fut.wait() == 2.0  # the call finished and its result arrived
    assert took >= 1.5, f"shutdown returned after {took:.1f} s, before the call ended"
    ensure_cluster()


def test_non_graceful_shutdown_cancels_calls_in_flight(cluster):
    nb = notebook_code(CELL)
    fut = nbrpc.rpc_async("worker2", nb.nap, args=(60.0,))
    time.sleep(0.2)
    t0 = time.monotonic()
    nbrpc.shutdown(graceful=False)
    with pytest.raises(nbrpc.ClusterClosedError, match="cancelled: the cluster was shut down"):
        fut.wait()
    took = time.monotonic() - t0
    assert took < 15, f"non-graceful shutdown and cancellation took {took:.1f} s"
    ensure_cluster()


def _open_files() -> list[str]:
    """What this process's descriptors point at, sockets included."""
    files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return files


def _resources() -> dict[str, int]:
    gc.collect()
    fds = _open_files()
    listening = [
        c for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid == ME.pid
    ]
    return {
        "ipyparallel logs": _controller_logs(),
        "threads": ME.num_threads(),
        "open files": sum(1 for f in fds if not f.startswith("socket:")),
        "sockets": sum(1 for f in fds if f.startswith("socket:")),
        "listening ports": len(listening),
        "child processes": len(ME.children(recursive=True)),
    }


def _controller_logs() -> int:
    """ipyparallel's files in the profile's log folder of this process's kept controller
    (one per engine it started, never removed: 5,000 on one machine)."""
    from nbrpc._engines import local

    kept = local.kept()
    if kept is None:
        return 0
    cluster_id = os.path.basename(kept.cluster_file)[len("cluster-") : -len(".json")]
    return len(glob.glob(os.path.join(kept.log_dir, f"*{cluster_id}*")))


def _kinds(files: list[str]) -> Counter:
    """Open files by kind: a log's path without its engine's id, a pidfd, a pipe."""
    return Counter(re.sub(r"[0-9]+", "N", f) for f in files if not f.startswith("socket:"))


#: torch 2.13's TensorPipe agent never drops its pipe to a worker that left a dynamic group
#: (``connectedPipes_`` is not erased on leave); with nbrpc's "uv" transport such a pipe
#: keeps 4 connected sockets. Measured: 4 per departed worker the kernel had called (24
#: shared-memory descriptors and ~8 MB with torch's default "shm" transport). nbrpc cannot
#: close them from Python; the test bounds them so that anything more fails.
SOCKETS_PER_DEPARTED_WORKER = 4


def test_twenty_init_shutdown_cycles_do_not_grow_resources():
    nbrpc.shutdown()
    rows, files = [], []
    for _ in range(20):
        t0 = time.monotonic()
        nbrpc.init(n=1, progress=False)
        ref = nbrpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        assert ref.to_here().tolist() == [2.0, 2.0]
        del ref
        booted = time.monotonic() - t0
        nbrpc.shutdown()
        rows.append({"boot s": booted, "cycle s": time.monotonic() - t0, **_resources()})
        files.append(_open_files())
    for line in rows:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in line.items()})
    # The baseline is the second cycle's row: the first cycle takes a spare engine the
    # shared cluster's shutdown left (its reader, its log and ipyparallel's wait on it
    # were in place before), the second is the first to start its own. From then on each
    # cycle does the same work, so 18 cycles of a leak of one per cycle show 18 over.
    # Each row is a moment just after shutdown: threads and processes may still be on
    # their way out (a spare engine starting, a reader thread ending), so the last row is
    # read again until it settles.
    # The level is the highest of cycles 2-4: one such row once read one open file below
    # the rest (57, then 58 for good) and failed a run; a leak of one per cycle still
    # shows 15 over.
    first = {k: max(r[k] for r in rows[1:4]) for k in rows[1]}
    last = rows[-1]
    for key in ("ipyparallel logs", "threads", "open files", "listening ports", "child processes"):
        if last[key] > first[key]:
            wait_until(lambda key=key: _resources()[key] <= first[key], timeout=10)
            last[key] = _resources()[key]
        grew = _kinds(_open_files()) - _kinds(files[1]) if key == "open files" else ""
        assert last[key] <= first[key], (
            f"{key} grew over 18 cycles: {first[key]} -> {last[key]} {grew or ''}"
        )
    sockets = last["sockets"] - first["sockets"]
    assert sockets <= 18 * SOCKETS_PER_DEPARTED_WORKER, f"{sockets} more sockets after 18 cycles"

    # a release takes ipyparallel's files of its controller with it
    from nbrpc._engines import local

    kept = local.kept()
    assert kept is not None
    cluster_id = os.path.basename(kept.cluster_file)[len("cluster-") : -len(".json")]
    profile = os.path.dirname(kept.log_dir)
    nbrpc.shutdown(release=True)
    left = glob.glob(os.path.join(profile, "*", f"*{cluster_id}*"))
    assert left == [], left
    # and ipyparallel writes the cluster file no more: its event loop's callbacks, a moment
    # after a stop, wrote a Slurm job's again after the release had removed it
    ipp_cluster = kept._ipp
    assert ipp_cluster.cluster_file == ""
    ipp_cluster.update_cluster_file()  # what such a callback runs
    assert glob.glob(os.path.join(profile, "*", f"*{cluster_id}*")) == []
    ensure_cluster()


def test_a_released_controller_leaves_no_thread_in_a_kernel():
    """ipyparallel's ``Cluster`` runs its ``*_sync`` methods on a thread of its own where an
    event loop already runs, as in a Jupyter kernel (not in this test process, so the
    cycles above never saw it), and nothing stopped that thread: each
    ``%rpc_shutdown --release`` left one more, and its epoll descriptor (the soak,
    docs/soak.md)."""
    loops = """
import sys, traceback

def loops():  # ipyparallel's (ipykernel's IOPub thread has a _thread_main too)
    return len([f for f in sys._current_frames().values()
                if any(s.name == '_thread_main' and 'ipyparallel' in s.filename
                       for s in traceback.extract_stack(f))])
"""
    with running_kernel("%load_ext nbrpc", loops) as k:
        for _ in range(2):
            k.run("%rpc_init -n 1 --quiet", timeout=180)
            assert k.value("loops()") <= 1  # the controller's, while it runs
            k.run("%rpc_shutdown --release", timeout=60)
            assert k.value("loops()") == 0
