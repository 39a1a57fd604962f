"""The same-host fast path: large CPU tensors through shared memory, same semantics."""

import gc
import os

import pytest
import torch
from conftest import STAGE_CELL, ensure_cluster, notebook_code

import nbrpc
from nbrpc import _shm, autograd

CELL = """
import torch

def echo(*xs):
    return xs if len(xs) > 1 else xs[0]

def describe(t):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())

def scribble(t):
    t.fill_(-1.0)  # the callee's own tensor: the caller's must not change
    return float(t.sum())

def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
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
    return _shm._state["sent"]


TEST_THRESHOLD = 1 << 20  # small tensors keep the tests fast; the code path is the same


def _threshold_everywhere(cluster, threshold):
    prefix = _shm._state["prefix"]
    for record in cluster.records[1:]:
        nbrpc.rpc_sync(record.name, _shm.configure, args=(prefix, threshold))
    _shm.configure(prefix, threshold)


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
    prefix = _shm._state["prefix"]
    for _ in range(20):
        out = nbrpc.rpc_sync("worker1", fast.echo, args=(BASE,))
        del out
    gc.collect()
    names = [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(prefix + "-")]
    in_flight = [n for n in names if "-pool-" not in n]
    pooled = sum(int(n.split("-pool-")[1].split("-")[0]) for n in names if "-pool-" in n)
    live_here = [t for t in CASES.values()]  # the cases are the kernel's own memory
    assert len(in_flight) <= 2 * len(live_here), in_flight  # only what tensors still hold
    assert pooled <= _shm.POOL_BYTES


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
