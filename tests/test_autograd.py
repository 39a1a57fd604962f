"""Distributed autograd and the optimizer across real workers, against one process."""

import threading
import warnings

import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import STAGE_CELL, notebook_code

import nbrpc
from nbrpc import _torch, autograd
from nbrpc.optim import DistributedOptimizer

pytestmark = pytest.mark.usefixtures("cluster")


@pytest.fixture(scope="module")
def cell():
    return notebook_code(STAGE_CELL)


def _split(cell):
    stage0 = cell.Stage(0, 6, 5)
    stage1 = nbrpc.remote("worker1", cell.Stage, args=(1, 5, 4))
    stage2 = nbrpc.remote("worker2", cell.Stage, args=(2, 4, 3))
    return stage0, stage1, stage2


def _local_twin(cell):
    return cell.Stage(0, 6, 5), cell.Stage(1, 5, 4), cell.Stage(2, 4, 3)


def test_split_kernel_worker1_worker2_matches_one_process(cell, capfd):
    x = torch.randn(8, 6, dtype=torch.float64)
    stage0, stage1, stage2 = _split(cell)
    with autograd.context() as ctx:
        h = stage0(x)
        h = stage1.rpc_sync().forward(h)
        out = stage2.rpc_sync().forward(h)
        loss = out.pow(2).sum()
        autograd.backward(ctx, [loss])
        local_grads = autograd.get_gradients(ctx)
        g0 = [local_grads[p] for p in stage0.parameters()]
        g1 = nbrpc.rpc_sync("worker1", cell.grads_of, args=(stage1, ctx))
        g2 = nbrpc.rpc_sync("worker2", cell.grads_of, args=(stage2, ctx))

        params = [rpc.RRef(p) for p in stage0.parameters()]
        params += stage1.rpc_sync().param_rrefs() + stage2.rpc_sync().param_rrefs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # pytest's filters, then nbrpc's (as at boot)
            _torch.quiet_internal_deprecations()
            opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
            opt.step()  # inside the context: no id needed
    # torch's TorchScript deprecation notices, here or as [workerN] stderr, are noise in a cell
    assert [str(w.message) for w in caught] == []
    assert "deprecated" not in capfd.readouterr().err

    t0, t1, t2 = _local_twin(cell)
    ref_loss = t2(t1(t0(x))).pow(2).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for got, module in ((g0, t0), (g1, t1), (g2, t2)):
        for g, p in zip(got, module.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
    local_sgd = torch.optim.SGD([*t0.parameters(), *t1.parameters(), *t2.parameters()], lr=0.1)
    local_sgd.step()
    for module_rref, twin in ((stage1, t1), (stage2, t2)):
        for w, p in zip(module_rref.rpc_sync().weights(), twin.parameters(), strict=True):
            torch.testing.assert_close(w, p.detach(), rtol=1e-12, atol=1e-12)
    for w, p in zip(stage0.parameters(), t0.parameters(), strict=True):
        torch.testing.assert_close(w.detach(), p.detach(), rtol=1e-12, atol=1e-12)


def test_seed_001_backward_form_inside_context():
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    with autograd.context() as ctx:
        loss = nbrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        autograd.backward([loss])  # seed 001's older form
        grads = autograd.get_gradients(ctx)
    torch.testing.assert_close(grads[t1], torch.ones(3, 3))
    torch.testing.assert_close(grads[t2], torch.ones(3, 3))


def test_backward_without_context_says_what_to_do():
    loss = (torch.ones(2, requires_grad=True) * 2).sum()
    with pytest.raises(autograd.AutogradContextError, match=r"with nbrpc\.autograd\.context"):
        autograd.backward([loss])


def test_gradients_of_a_finished_context():
    with autograd.context() as ctx:
        pass
    with pytest.raises(autograd.AutogradContextError, match="has ended"):
        autograd.get_gradients(ctx)


def test_local_backward_across_workers_says_what_to_use(cell):
    """torch 2.13 ends it in an internal assertion ("please report a bug to PyTorch"); the
    wording is pinned here, where workers exist (_torch.LOCAL_BACKWARD_ACROSS_WORKERS)."""
    x = torch.ones(3, requires_grad=True)
    with nbrpc.autograd.context():
        loss = nbrpc.rpc_sync("worker1", torch.mul, args=(x, 2)).sum()
        with pytest.raises(nbrpc.AutogradContextError, match=r"nbrpc\.autograd\.backward"):
            loss.backward()


def test_a_context_never_left_is_released_at_the_shutdown():
    """A stop button pressed as torch's ``context()`` was entered or left can leave a
    context torch holds, the kernel's thread "inside" it (the soak found one after a
    ``--release``): every later ``with context()`` on that thread then fails with torch's
    "Already have an autograd context id for this thread". The shutdown releases it while
    its workers are there; the block's own release, if it still comes, does nothing."""
    import torch.distributed.autograd as dist_autograd
    from conftest import ensure_cluster

    def held() -> int:
        return int(dist_autograd._get_debug_info()["num_autograd_contexts"])

    before = held()
    leftover = dist_autograd.context()
    leftover.__enter__()  # as when the stop came before its with-block began
    nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2, requires_grad=True), 1))
    # another thread's open context (a training thread's) is left to its own block:
    # torch clears a thread's current context on that thread alone
    entered, leave = threading.Event(), threading.Event()

    def elsewhere():
        with dist_autograd.context():
            entered.set()
            leave.wait(30)

    other = threading.Thread(target=elsewhere)
    other.start()
    assert entered.wait(30)
    assert held() == before + 2
    nbrpc.shutdown()
    assert held() == before + 1, "the shutdown left this thread's context, or took the other's"
    leave.set()
    other.join(30)
    assert held() == before
    leftover.__exit__(None, None, None)  # its block's end, late: nothing to do
    ensure_cluster()
    with dist_autograd.context():  # the thread is in no context: a new one, as before
        x = torch.ones(2, requires_grad=True)
        got = nbrpc.rpc_sync("worker1", torch.add, args=(x, 1))
    assert got.tolist() == [2.0, 2.0]
    assert held() == before
