"""The same-host fast path: large CPU tensors through shared memory, same semantics."""

import contextlib
import ctypes
import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import STAGE_CELL, ensure_cluster, notebook_code, wait_until

import nbrpc
from nbrpc import autograd
from nbrpc._wire import arena as arena_mod, shm

CELL = """
import torch

def echo(*xs):
    return xs if len(xs) > 1 else xs[0]

def describe(t):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())

def scribble(t):
    t.fill_(-1.0)  # the callee's own tensor: the caller's must not change
    return float(t.sum())

def segments_made():
    from nbrpc._wire import shm
    return shm.exported()

def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

def total(t, *rest):
    return float(t.sum())

def with_rref(n):
    import torch.distributed.rpc as rpc
    return torch.ones(n), rpc.RRef(1)

def slots_in_use():
    from nbrpc._wire import shm
    return shm.arena().in_use() if shm.arena() is not None else 0
"""

BASE = torch.randn(1024, 1024)  # 4 MB: over the 1 MB threshold these tests set
CASES = {
    "contiguous": BASE,
    "transposed": BASE.t(),
    "slice": BASE[10:500, 3:700],
    "every other element": BASE.view(-1)[::2],
    "int64": torch.arange(1 << 20),
    "bool": torch.rand(1 << 21) > 0.5,
    "float16 3-d": torch.randn(64, 128, 256).half(),
}


def _segments_made() -> int:
    return shm.exported()


TEST_THRESHOLD = 1 << 20  # small tensors keep the tests fast; the code path is the same


def _threshold_everywhere(cluster, threshold):
    prefix = shm.prefix()
    for record in cluster.records[1:]:
        nbrpc.rpc_sync(record.name, shm.configure, args=(prefix, threshold))
    shm.configure(prefix, threshold)


@pytest.fixture
def fast(cluster):
    assert cluster.fast_path, cluster.summary()
    _threshold_everywhere(cluster, TEST_THRESHOLD)
    yield notebook_code(CELL)
    _threshold_everywhere(cluster, cluster.shm_threshold)


@pytest.mark.parametrize("name", list(CASES))
def test_values_dtype_strides_and_offset_survive_both_ways(fast, name):
    t = CASES[name]
    before = _segments_made()
    assert nbrpc.rpc_sync("worker1", fast.describe, args=(t,)) == (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.untyped_storage().nbytes(),
    )
    back = nbrpc.rpc_sync("worker1", fast.echo, args=(t,))
    assert _segments_made() > before, "the fast path was not taken"
    assert torch.equal(back, t)
    assert (back.stride(), back.storage_offset(), back.dtype) == (
        t.stride(),
        t.storage_offset(),
        t.dtype,
    )
    assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_the_callee_gets_its_own_tensor(fast):
    t = torch.ones(1 << 20)
    assert nbrpc.rpc_sync("worker2", fast.scribble, args=(t,)) == -(1 << 20)
    assert bool((t == 1).all()), "the caller's tensor changed: it was aliased"


def test_tensors_sharing_a_storage_still_share_it(fast):
    a, b = BASE, BASE[3]
    assert nbrpc.rpc_sync("worker1", fast.same_storage, args=(a, b))
    x, y = nbrpc.rpc_sync("worker1", fast.echo, args=(a, b))
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert torch.equal(y, BASE[3])


def test_small_tensors_keep_torchs_path(fast):
    before = _segments_made()
    small = torch.randn(1000)  # 4 KB
    assert torch.equal(nbrpc.rpc_sync("worker1", fast.echo, args=(small,)), small)
    assert _segments_made() == before


#: over what a lane's frame carries in its bytes (64 KB), under the arena's 1 MB threshold
#: for TensorPipe's messages
OVER_A_FRAME = {
    "64 KB and 4 bytes": torch.randn(16 * 1024 + 1),
    "256 KB": torch.randn(64 * 1024),
    "a view of 1 MB": torch.randn(1 << 18)[5:-7],
    "uint8 2-d, transposed": torch.randint(0, 255, (300, 700), dtype=torch.uint8).t(),
}


@pytest.mark.parametrize("name", list(OVER_A_FRAME))
def test_a_tensor_over_a_frame_takes_the_lane_through_shared_memory(cluster, name):
    """A tensor a lane's frame cannot hold took TensorPipe (256 KB: 1.87 ms a round trip,
    0.40 ms now, docs/architecture.md): it takes the lane, its storage in the arena."""
    code = notebook_code(CELL)
    t = OVER_A_FRAME[name]
    before = _segments_made()
    with nbrpc.record() as rec:
        back = nbrpc.rpc_sync("worker1", code.echo, args=(t,))
    assert _segments_made() > before, "shared memory was not taken"
    assert torch.equal(back, t)
    assert (back.stride(), back.storage_offset(), back.dtype) == (
        t.stride(),
        t.storage_offset(),
        t.dtype,
    )
    assert [r["route"] for r in rec.calls if r["function"] == "echo"] == ["lane"]
    pair = nbrpc.rpc_sync("worker1", code.echo, args=(t, t[1:]))  # one storage: shared
    assert pair[0].untyped_storage().data_ptr() == pair[1].untyped_storage().data_ptr()


def test_a_lane_message_not_sent_gives_its_shared_memory_back(cluster):
    """A call whose large tensor was copied into the arena, then refused by the lane (an
    RRef after it: TensorPipe carries the call), and a reply refused so: their slots are
    free again, not lost to the arena until the cluster ends."""
    code = notebook_code(CELL)
    big = torch.ones(1 << 16)  # 256 KB
    mine = shm.arena()
    in_use = mine.in_use() if mine is not None else 0
    for _ in range(5):
        assert nbrpc.rpc_sync("worker1", code.total, args=(big, rpc.RRef(1))) == 1 << 16
    assert wait_until(lambda: shm.arena().in_use() <= in_use, 5.0), shm.arena().in_use()
    theirs = nbrpc.rpc_sync("worker1", code.slots_in_use)
    for _ in range(5):
        ones, rref = nbrpc.rpc_sync("worker1", code.with_rref, args=(1 << 16,))
        assert float(ones.sum()) == 1 << 16
        assert rref.to_here() == 1
    del ones, rref
    gc.collect()
    assert wait_until(lambda: nbrpc.rpc_sync("worker1", code.slots_in_use) <= theirs, 5.0)


def test_distributed_autograd_through_large_tensors(fast):
    """A tensor that requires grad keeps torch's path, so its gradient flows back."""
    nb = notebook_code(STAGE_CELL)
    stage = nbrpc.remote("worker1", nb.Stage, args=(7, 512, 512))
    x = torch.randn(1024, 512, dtype=torch.float64, requires_grad=True)  # 4 MB
    bias = torch.randn(1024, 512, dtype=torch.float64)  # large, no grad: the fast path
    before = _segments_made()
    with autograd.context() as ctx:
        y = stage.rpc_sync().forward(x + 0) + nbrpc.rpc_sync("worker2", torch.mul, args=(bias, 2))
        autograd.backward(ctx, [y.sum()])
        grad = autograd.get_gradients(ctx)[x]
    assert _segments_made() > before  # the result of forward (no grad there) ... or bias
    twin = nb.Stage(7, 512, 512)
    x2 = x.detach().clone().requires_grad_(True)
    (twin(x2) + bias * 2).sum().backward()
    torch.testing.assert_close(grad, x2.grad, rtol=1e-12, atol=1e-12)


def test_segments_are_recycled_not_leaked(fast):
    prefix = shm.prefix()
    for _ in range(20):
        out = nbrpc.rpc_sync("worker1", fast.echo, args=(BASE,))
        del out
    gc.collect()
    names = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-")]
    in_flight = [n for n in names if "-pool-" not in n and "-arena-" not in n]
    assert len([n for n in names if "-arena-" in n]) <= len(nbrpc.workers())  # one each
    pooled = sum(int(n.split("-pool-")[1].split("-")[0]) for n in names if "-pool-" in n)
    live_here = [t for t in CASES.values()]  # the cases are the kernel's own memory
    assert len(in_flight) <= 2 * len(live_here), in_flight  # only what tensors still hold
    assert pooled <= shm.POOL_BYTES


def _arena_files(prefix: str) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-arena-")]


def test_the_arena_is_reused_and_never_overwrites_a_live_tensor(fast):
    """One arena per process, mapped once; a slot is reused only after its receiver let go."""
    prefix = shm.prefix()
    held = nbrpc.rpc_sync("worker1", fast.echo, args=(BASE,))  # kept: its slot stays in use
    for _ in range(10):
        other = torch.randn(1024, 1024)
        assert torch.equal(nbrpc.rpc_sync("worker1", fast.echo, args=(other,)), other)
    assert torch.equal(held, BASE)  # ten more messages did not touch the held slot
    arenas = _arena_files(prefix)
    assert 1 <= len(arenas) <= len(fast_cluster_processes())  # one per process, no growth
    arena = shm.arena()
    assert arena is not None
    gc.collect()
    deadline = time.monotonic() + 5
    while arena.in_use() and time.monotonic() < deadline:  # the worker let go of its args
        time.sleep(0.05)
    assert arena.in_use() == 0
    assert torch.equal(held, BASE)
    del held


def test_remote_and_to_here_take_the_arena(fast):
    sent_here = _segments_made()
    sent_there = nbrpc.rpc_sync("worker1", fast.segments_made)
    rref = nbrpc.remote("worker1", fast.echo, args=(BASE,))  # the argument: this arena
    assert torch.equal(rref.to_here(), BASE)  # the value: worker1's arena
    assert _segments_made() == sent_here + 1
    assert nbrpc.rpc_sync("worker1", fast.segments_made) == sent_there + 1


def test_a_restarted_worker_s_arena_goes_and_what_came_from_it_stays(fast):
    """The arena of a worker a restart replaced is unlinked (its written pages are memory:
    it stayed until the shutdown, one more at each restart); a tensor the kernel received
    from it keeps its values."""
    prefix = shm.prefix()
    old = nbrpc.rpc_sync("worker1", os.getpid)
    held = nbrpc.rpc_sync("worker1", fast.echo, args=(BASE,))  # from worker1's arena
    assert any(n.startswith(f"{prefix}-arena-{old}-") for n in _arena_files(prefix))
    nbrpc.restart("worker1")
    _threshold_everywhere(nbrpc.current(), TEST_THRESHOLD)  # the new process's, as before
    assert not any(n.startswith(f"{prefix}-arena-{old}-") for n in _arena_files(prefix))
    assert torch.equal(held, BASE)
    assert torch.equal(nbrpc.rpc_sync("worker1", fast.echo, args=(BASE,)), BASE)


def fast_cluster_processes() -> list[str]:
    return nbrpc.workers()


def test_a_full_arena_falls_back_to_segments():

    prefix = f"nbrpc-test-{os.getpid()}"
    arena = arena_mod.Arena(prefix, capacity=3 * arena_mod.ALIGN)
    try:
        one = torch.ones(arena_mod.ALIGN, dtype=torch.uint8).untyped_storage()
        slots = [arena.put(one) for _ in range(4)]
        assert slots[:3] == [(0, 0), (1, arena_mod.ALIGN), (2, 2 * arena_mod.ALIGN)]
        assert slots[3] is None  # full: the caller takes a segment instead
        storage = arena_mod.attach(arena.name, 1, arena_mod.ALIGN, arena_mod.ALIGN)  # as a receiver
        assert arena.in_use() == 3
        del storage
        gc.collect()
        assert arena.in_use() == 2  # the receiver let go of record 1
        assert arena.put(one) == (1, arena_mod.ALIGN)  # its slot, and only its, is reused
    finally:
        os.unlink(os.path.join(arena_mod.SHM_DIR, arena.name))


def test_a_segment_carries_every_byte():
    """The path a message takes when the arena is full: a segment of its own, copied into
    as a slot is, mapped by the receiver."""
    prefix = f"nbrpc-test-{os.getpid()}"
    sent = torch.randn(3, arena_mod.SPLIT_BYTES // 4 + 7)  # split over the copy's threads
    name = shm.export_segment(sent.untyped_storage(), prefix)
    try:
        got = shm.import_tensor(
            name, sent.untyped_storage().nbytes(), sent.dtype, sent.shape, sent.stride(), 0
        )
        assert torch.equal(got, sent)
        del got
        gc.collect()
    finally:
        for entry in os.listdir(shm.SHM_DIR):  # the segment, or the pool it went to
            if entry.startswith(prefix + "-"):
                os.unlink(os.path.join(shm.SHM_DIR, entry))


def test_a_peer_killed_mid_transfer_leaves_nothing_and_corrupts_nothing():
    nbrpc.shutdown()
    try:
        cluster = nbrpc.init(n=2, shm_threshold=1 << 20, progress=False)
        prefix = shm.prefix()
        code = notebook_code(CELL)
        mine = torch.randn(2048, 1024)  # 8 MB
        kept = nbrpc.rpc_sync("worker1", code.echo, args=(mine,))  # in worker1's arena
        calls = [nbrpc.rpc_async("worker1", code.echo, args=(mine,)) for _ in range(20)]
        os.kill(cluster.workers[1].pid, 9)  # while those transfers are under way
        for fut in calls:
            with contextlib.suppress(nbrpc.WorkerDiedError):
                assert torch.equal(fut.wait(), mine)  # each one that arrived is whole
        assert torch.equal(kept, mine)  # the dead sender's slot: still this tensor's memory
        other = torch.randn(2048, 1024)
        for _ in range(5):  # the kernel's arena keeps serving the live worker
            assert torch.equal(nbrpc.rpc_sync("worker2", code.echo, args=(other,)), other)
        assert _arena_files(prefix)
    finally:
        nbrpc.shutdown()
    left = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-")]
    assert left == [], left  # arenas and segments, the dead worker's included
    assert torch.equal(kept, mine)
    ensure_cluster()


def _shm_descriptors() -> int:
    """This process's file descriptors on files under /dev/shm (a mapping holds one)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held += os.readlink(f"/proc/self/fd/{fd}").startswith(shm.SHM_DIR + "/")
    return held


def test_a_shutdown_lets_go_of_the_gone_clusters_memory_but_what_tensors_use():
    """Each mapping of an arena holds a descriptor; the kernel kept those of a cluster
    that had ended until the next one started (the soak: 7 after a shutdown)."""
    code = notebook_code(CELL)
    kept = []
    nbrpc.shutdown()
    gc.collect()
    before = _shm_descriptors()
    try:
        for _ in range(3):
            nbrpc.init(n=2, progress=False)
            for worker in ("worker1", "worker2"):  # both arenas, and the kernel's
                back = nbrpc.rpc_sync(worker, code.echo, args=(torch.ones(1 << 16),))
            kept.append(back)  # worker2's arena, used by a tensor the kernel keeps
            nbrpc.shutdown()
            gc.collect()
            assert _shm_descriptors() - before == len(kept)
            # and the fast path is off: a tensor pickled now made an arena no sweep removed
            assert not shm.enabled()
        assert all(float(t.sum()) == 1 << 16 for t in kept)
    finally:
        nbrpc.shutdown()
        ensure_cluster()


def test_off_with_an_option():
    nbrpc.shutdown()
    try:
        cluster = nbrpc.init(n=1, shm_threshold=None, progress=False)
        assert not cluster.fast_path
        assert "through TensorPipe only" in cluster.summary()
        before = _segments_made()
        t = torch.randn(1 << 20)
        assert torch.equal(nbrpc.rpc_sync("worker1", torch.clone, args=(t,)), t)
        assert _segments_made() == before
    finally:
        nbrpc.shutdown()
        ensure_cluster()


@pytest.mark.parametrize(
    "nbytes", [1, 4095, arena_mod.SPLIT_BYTES - 1, arena_mod.SPLIT_BYTES + 12345]
)
def test_the_arena_copy_splits_over_threads_and_copies_every_byte(nbytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(3)]
    threads = [  # concurrent copies: one takes the helpers, the others copy alone
        threading.Thread(target=arena_mod.copy, args=(d.data_ptr(), src.data_ptr(), nbytes))
        for d in dsts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in dsts:
        assert torch.equal(d, src)


def test_a_forked_child_copies_with_helpers_of_its_own():
    n = arena_mod.SPLIT_BYTES * 2
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    expected = bytes(src.numpy())
    dst = torch.zeros(n, dtype=torch.uint8)
    arena_mod.copy(dst.data_ptr(), src.data_ptr(), n)  # the parent's helpers exist now
    pid = os.fork()
    if pid == 0:  # their threads are gone here: a copy must not wait on them (no torch ops:
        child = ctypes.create_string_buffer(n)  # OpenMP is not safe after a fork)
        arena_mod.copy(ctypes.addressof(child), src.data_ptr(), n)
        os._exit(0 if child.raw == expected else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(dst.numpy()) == expected
