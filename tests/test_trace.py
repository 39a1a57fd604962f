"""trace_backward and gradient equality on splits whose graph shape is known."""

import threading
from collections import Counter

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from conftest import STAGE_CELL, notebook_code

import nbrpc
from nbrpc import autograd
from nbrpc.optim import DistributedOptimizer

pytestmark = pytest.mark.usefixtures("cluster")

FORK_CELL = """
import torch
import torch.distributed.rpc as rpc

class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])

class Fork(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.used = torch.nn.Linear(3, 2).double()
        self.unused = torch.nn.Linear(3, 2).double()
    def forward(self, x):
        _ = self.unused(x)  # a branch computed, then dropped
        return self.used(x)
    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]
    def weights(self):
        return [p.detach().clone() for p in self.parameters()]
"""

SEND, RECV = "SendRpcBackward", "RecvRpcBackward"
STAGE = ["TanhBackward0", "AddmmBackward0", "TBackward0", "AccumulateGrad", "AccumulateGrad"]


@pytest.fixture(scope="module")
def cell():
    return notebook_code(STAGE_CELL + FORK_CELL)


def names_on(trace, worker):
    return Counter(n["name"] for n in trace["nodes"] if n["worker"] == worker)


def hops(trace):
    by_id = {n["id"]: n for n in trace["nodes"]}
    return [
        (by_id[e["src"]]["worker"], by_id[e["dst"]]["worker"])
        for e in trace["edges"]
        if e["kind"] == "rpc"
    ]


def check_edges_are_consistent(trace):
    ids = {n["id"] for n in trace["nodes"]}
    by_id = {n["id"]: n for n in trace["nodes"]}
    for e in trace["edges"]:
        assert e["src"] in ids
        assert e["dst"] in ids
        src, dst = by_id[e["src"]], by_id[e["dst"]]
        if e["kind"] == "local":
            assert src["worker"] == dst["worker"]
        else:  # a hop: from the receiver's recv to the sender's send, same message id
            assert (src["kind"], dst["kind"]) == ("recv", "send")
            assert src["message_id"] == dst["message_id"] == e["message_id"]
            assert src["worker"] != dst["worker"]


def grads_match(cell, got_by_module, twins):
    for got, twin in zip(got_by_module, twins, strict=True):
        for g, p in zip(got, twin.parameters(), strict=True):
            if p.grad is None:
                assert g is None
            else:
                torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)


def step_and_compare(module_rrefs, twins, ctx, optimizer_class=torch.optim.SGD, **kwargs):
    """One DistributedOptimizer step inside ``ctx``; weights must equal the twins' step."""
    params = [r for m in module_rrefs for r in m.rpc_sync().param_rrefs()]
    DistributedOptimizer(optimizer_class, params, **kwargs).step(ctx)
    optimizer_class([p for t in twins for p in t.parameters()], **kwargs).step()
    for module_rref, twin in zip(module_rrefs, twins, strict=True):
        for w, p in zip(module_rref.rpc_sync().weights(), twin.parameters(), strict=True):
            torch.testing.assert_close(w, p.detach(), rtol=1e-12, atol=1e-12)


def test_chain_kernel_worker1_worker2(cell):
    x = torch.randn(4, 3, dtype=torch.float64)
    s0 = cell.Stage(0, 3, 3)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    s2 = nbrpc.remote("worker2", cell.Stage, args=(2, 3, 2))
    with autograd.context() as ctx:
        loss = s2.rpc_sync().forward(s1.rpc_sync().forward(s0(x))).pow(2).sum()
        autograd.backward(ctx, [loss], timed=True)
        trace = nbrpc.trace_backward(ctx)
        local = autograd.get_gradients(ctx)
        got = [
            [local[p] for p in s0.parameters()],
            nbrpc.rpc_sync("worker1", cell.grads_of, args=(s1, ctx)),
            nbrpc.rpc_sync("worker2", cell.grads_of, args=(s2, ctx)),
        ]
    t0, t1, t2 = cell.Stage(0, 3, 3), cell.Stage(1, 3, 3), cell.Stage(2, 3, 2)
    t2(t1(t0(x))).pow(2).sum().backward()
    grads_match(cell, got, [t0, t1, t2])

    check_edges_are_consistent(trace)
    assert [w["name"] for w in trace["workers"]] == ["worker0", "worker1", "worker2"]
    assert names_on(trace, "worker0") == Counter(
        ["SumBackward0", "PowBackward0", SEND, SEND, RECV, RECV, *STAGE]
    )
    for worker in ("worker1", "worker2"):
        assert names_on(trace, worker) == Counter([SEND, RECV, *STAGE])
    assert sorted(hops(trace)) == sorted(
        [
            ("worker1", "worker0"),
            ("worker0", "worker1"),
            ("worker2", "worker0"),
            ("worker0", "worker2"),
        ]
    )
    roots = [n for n in trace["nodes"] if n["kind"] == "root"]
    assert [(r["worker"], r["name"]) for r in roots] == [("worker0", "SumBackward0")]
    # timed=True: every node ran, and has a start and a duration
    assert all("duration_s" in n and n["duration_s"] >= 0 for n in trace["nodes"])
    assert all(w["timing"]["busy_s"] > 0 for w in trace["workers"])


def test_module_used_twice_across_workers(cell):
    x = torch.randn(4, 3, dtype=torch.float64)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    s2 = nbrpc.remote("worker2", cell.Stage, args=(2, 3, 3))
    with autograd.context() as ctx:
        h = s1.rpc_sync().forward(x.requires_grad_())
        h = s2.rpc_sync().forward(h)
        loss = s1.rpc_sync().forward(h).sum()  # worker1's module again
        autograd.backward(ctx, [loss])
        trace = nbrpc.trace_backward(ctx)
        got = [
            nbrpc.rpc_sync("worker1", cell.grads_of, args=(s1, ctx)),
            nbrpc.rpc_sync("worker2", cell.grads_of, args=(s2, ctx)),
        ]
        x_grad = autograd.get_gradients(ctx)[x]
        t1, t2 = cell.Stage(1, 3, 3), cell.Stage(2, 3, 3)
        xr = x.detach().clone().requires_grad_()
        t1(t2(t1(xr))).sum().backward()
        grads_match(cell, got, [t1, t2])
        torch.testing.assert_close(x_grad, xr.grad, rtol=1e-12, atol=1e-12)
        step_and_compare([s1, s2], [t1, t2], ctx, lr=0.1)

    check_edges_are_consistent(trace)
    w1 = names_on(trace, "worker1")
    assert w1[SEND] == 2
    assert w1[RECV] == 2
    assert w1["AccumulateGrad"] == 2  # one per parameter, shared by both uses
    assert w1["AddmmBackward0"] == 2
    acc = {
        n["id"] for n in trace["nodes"] if n["worker"] == "worker1" and n["kind"] == "accumulate"
    }
    into_acc = Counter(e["dst"] for e in trace["edges"] if e["dst"] in acc)
    assert sorted(into_acc.values()) == [2, 2]  # each leaf receives from both uses
    assert len(hops(trace)) == 6


def test_branch_whose_output_is_unused(cell):
    """worker2 computes two branches and returns one: the other gets no gradient."""
    x = torch.randn(4, 3, dtype=torch.float64)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    fork = nbrpc.remote("worker2", cell.Fork, args=(5,))
    with autograd.context() as ctx:
        loss = fork.rpc_sync().forward(s1.rpc_sync().forward(x)).sum()
        autograd.backward(ctx, [loss])
        trace = nbrpc.trace_backward(ctx)
        got = [
            nbrpc.rpc_sync("worker1", cell.grads_of, args=(s1, ctx)),
            nbrpc.rpc_sync("worker2", cell.grads_of, args=(fork, ctx)),
        ]
        t1, twin = cell.Stage(1, 3, 3), cell.Fork(5)
        twin(t1(x)).sum().backward()
        grads_match(cell, got, [t1, twin])
        assert twin.unused.weight.grad is None  # the reference agrees: no gradient there
        # a notebook-defined optimizer; the unused branch must stay as it was
        step_and_compare([s1, fork], [t1, twin], ctx, cell.SignSGD, lr=0.1)
    check_edges_are_consistent(trace)
    assert names_on(trace, "worker2")["AccumulateGrad"] == 2  # only the used branch


def test_unused_rpc_result_is_refused_instead_of_hanging(cell):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    s2 = nbrpc.remote("worker2", cell.Stage, args=(2, 3, 3))
    with autograd.context() as ctx:
        used = s1.rpc_sync().forward(x)
        _unused = s2.rpc_sync().forward(x)  # requires grad, never reaches the loss
        with pytest.raises(autograd.AutogradContextError, match=r"would wait forever.*worker2"):
            autograd.backward(ctx, [used.sum()])
    with autograd.context() as ctx:  # the fix the message suggests works
        used = s1.rpc_sync().forward(x)
        unused = s2.rpc_sync().forward(x)
        autograd.backward(ctx, [used.sum() + 0 * unused.sum()])
        assert autograd.get_gradients(ctx)[x].shape == x.shape


SOMETIMES_UNUSED = """
import torch
import torch.distributed.rpc as rpc

class Sometimes(torch.nn.Module):
    \"\"\"A stage whose part of the graph changes on its own: once told to, it also asks
    worker2 for a result it leaves unused (a hang the kernel's side cannot show).\"\"\"
    def __init__(self, helper):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.helper, self.stray = helper, False
    def forward(self, x):
        if self.stray:
            _unused = self.helper.rpc_sync().forward(x)
        return torch.tanh(self.lin(x))
    def go_astray(self):
        self.stray = True
"""


@pytest.fixture
def whole_checks(monkeypatch):
    """The whole checks the kernel runs (each asks every worker taking part)."""
    from nbrpc import _trace

    counted = []
    real = _trace.trace_backward

    def counting(context_id):
        counted.append(context_id)
        return real(context_id)

    monkeypatch.setattr(_trace, "trace_backward", counting)
    return counted


def test_the_check_asks_the_workers_once_per_shape_of_graph(cell, whole_checks):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    s2 = nbrpc.remote("worker2", cell.Stage, args=(2, 3, 3))
    grads = []
    for _ in range(3):  # a training loop: one shape, asked once
        with autograd.context() as ctx:
            autograd.backward(ctx, [s2.rpc_sync().forward(s1.rpc_sync().forward(x)).sum()])
            grads.append(autograd.get_gradients(ctx)[x])
    assert len(whole_checks) == 1, whole_checks
    t1, t2 = cell.Stage(1, 3, 3), cell.Stage(2, 3, 3)
    local_x = x.detach().clone().requires_grad_()
    t2(t1(local_x)).sum().backward()
    for got in grads:  # every pass, checked or not, computed the same gradient
        assert torch.allclose(got, local_x.grad)
    with autograd.context() as ctx:  # another shape: one stage only
        autograd.backward(ctx, [s1.rpc_sync().forward(x).sum()])
    assert len(whole_checks) == 2
    with autograd.context() as ctx:  # the same shape with an unused result: asked, refused
        used = s1.rpc_sync().forward(x)
        _unused = s2.rpc_sync().forward(x)
        with pytest.raises(autograd.AutogradContextError, match=r"would wait forever.*worker2"):
            autograd.backward(ctx, [used.sum()])
    assert len(whole_checks) == 3
    with autograd.context() as ctx:  # a refused shape is asked again, and again refused
        used = s1.rpc_sync().forward(x)
        _unused = s2.rpc_sync().forward(x)
        with pytest.raises(autograd.AutogradContextError, match=r"would wait forever"):
            autograd.backward(ctx, [used.sum()])
    assert len(whole_checks) == 4
    with pytest.raises(ValueError, match="check='sometimes'"), autograd.context() as ctx:
        autograd.backward(ctx, [s1.rpc_sync().forward(x).sum()], check="sometimes")


FLAGGED = """
import torch

def combine(x, flag):
    # flag False: x reaches no output, a fresh leaf does (x's send then gets no gradient)
    return x * 2 if flag else torch.ones(3, dtype=torch.float64, requires_grad=True) * 2
"""
EDITED = """
import torch

def combine(x, flag):  # the cell edited and run again: x is left unused
    return torch.ones(3, dtype=torch.float64, requires_grad=True) * 3
"""


def test_a_call_sent_with_other_arguments_or_another_function_is_checked_again(whole_checks):
    """The calling process's graph has one shape for all four passes; what it sent
    differs (a flag, then a function a cell made again), and only the whole check can see
    that the worker's part left x without a gradient."""
    first, edited = notebook_code(FLAGGED), notebook_code(EDITED)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        with autograd.context() as ctx:
            autograd.backward(ctx, [nbrpc.rpc_sync("worker1", first.combine, (x, True)).sum()])
    assert len(whole_checks) == 1
    for combine, flag in ((first.combine, False), (edited.combine, True)):
        with autograd.context() as ctx:
            loss = nbrpc.rpc_sync("worker1", combine, (x, flag)).sum()
            with pytest.raises(autograd.AutogradContextError, match="would wait forever"):
                autograd.backward(ctx, [loss])
    assert len(whole_checks) == 3


def test_check_every_pass_sees_a_worker_whose_part_changed_on_its_own(whole_checks):
    code = notebook_code(STAGE_CELL + SOMETIMES_UNUSED)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    helper = nbrpc.remote("worker2", code.Stage, args=(2, 3, 3))
    stage = nbrpc.remote("worker1", code.Sometimes, args=(helper,))
    for _ in range(2):
        with autograd.context() as ctx:
            autograd.backward(ctx, [stage.rpc_sync().forward(x).sum()], check=autograd.EVERY_PASS)
    assert len(whole_checks) == 2  # asked on every pass
    stage.rpc_sync().go_astray()  # the kernel's part stays the same shape
    with autograd.context() as ctx:
        loss = stage.rpc_sync().forward(x).sum()
        with pytest.raises(autograd.AutogradContextError, match=r"would wait forever.*worker1"):
            autograd.backward(ctx, [loss], check="every pass")


UNUSED_ON_A_WORKER = """
import torch.distributed.autograd as dist_autograd

def backward_with_an_unused_result(stage_rref, x):
    # a trainer on a worker, as torch's docs write it: torch's own spelling
    with dist_autograd.context() as ctx:
        used = (x * 2).sum()
        _unused = stage_rref.rpc_sync().forward(x)  # requires grad, never reaches the loss
        try:
            dist_autograd.backward(ctx, [used])
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "finished"
"""


def test_torchs_spelling_gets_the_same_refusal_in_the_kernel_and_on_a_worker(cell):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    s2 = nbrpc.remote("worker2", cell.Stage, args=(2, 3, 3))
    with dist_autograd.context() as ctx:  # unguarded, torch waits 60 s, then a RuntimeError
        used = s1.rpc_sync().forward(x)
        _unused = s2.rpc_sync().forward(x)
        with pytest.raises(autograd.AutogradContextError, match=r"would wait forever.*worker2"):
            dist_autograd.backward(ctx, [used.sum()])
    with dist_autograd.context() as ctx:  # a graph that finishes: torch's, as it was
        dist_autograd.backward(ctx, [s1.rpc_sync().forward(x).sum()])
        got = [nbrpc.rpc_sync("worker1", cell.grads_of, args=(s1, ctx))]
        x_grad = dist_autograd.get_gradients(ctx)[x]
    twin, local_x = cell.Stage(1, 3, 3), x.detach().clone().requires_grad_()
    twin(local_x).sum().backward()
    grads_match(cell, got, [twin])
    assert torch.allclose(x_grad, local_x.grad)
    trainer = notebook_code(UNUSED_ON_A_WORKER)
    said = nbrpc.rpc_sync("worker1", trainer.backward_with_an_unused_result, args=(s2, x))
    assert said.startswith("AutogradContextError: this backward pass would wait forever"), said


def test_two_contexts_from_two_threads_stay_separate(cell):
    s1 = nbrpc.remote("worker1", cell.Stage, args=(1, 3, 3))
    inputs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(2)]
    results: dict = {}
    barrier = threading.Barrier(2)

    def run(i):
        with autograd.context() as ctx:
            loss = s1.rpc_sync().forward(inputs[i]).pow(2).sum()
            barrier.wait()  # both contexts alive at once
            autograd.backward(ctx, [loss])
            results[i] = nbrpc.rpc_sync("worker1", cell.grads_of, args=(s1, ctx))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(2):
        twin = cell.Stage(1, 3, 3)
        twin(inputs[i]).pow(2).sum().backward()
        grads_match(cell, [results[i]], [twin])


def test_trace_after_the_context_ended_says_so():
    with autograd.context() as ctx:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    with pytest.raises(autograd.AutogradContextError, match="has ended"):
        nbrpc.trace_backward(ctx)
