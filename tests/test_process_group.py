"""A torch.distributed process group among the workers: collectives and DDP from %%rpc
cells, checked against one process; membership, re-init, bad input, a dead member."""

import os
import signal

import pytest
import torch
from conftest import ensure_cluster, wait_until
from IPython.core.interactiveshell import InteractiveShell

import nbrpc


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbrpc")
    return ip


@pytest.fixture
def gloo_cluster(cluster):
    nbrpc.shutdown()
    try:
        yield nbrpc.init(n=2, process_group="gloo", progress=False)
    finally:
        nbrpc.shutdown()
        ensure_cluster()


def rpc(shell, source, targets="all"):
    return shell.run_cell_magic("rpc", targets, source)


DDP_CELL = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + dist.get_rank())
losses = []
for step in range(3):
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
[p.detach().clone() for p in model.parameters()]
"""


def _ddp_twin(world_size: int = 2) -> list[torch.Tensor]:
    """One process: the same model, each step's gradient averaged over the ranks' batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world_size)]
    for _ in range(3):
        batches = [
            (
                torch.randn(8, 4, generator=g, dtype=torch.float64),
                torch.randn(8, 1, generator=g, dtype=torch.float64),
            )
            for g in gens
        ]
        opt.zero_grad()
        loss = sum(((model(x) - y) ** 2).mean() for x, y in batches) / world_size
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_collectives_and_ddp_in_cells_match_one_process(shell, gloo_cluster):
    assert gloo_cluster.process_group["ranks"] == {"worker1": 0, "worker2": 1}
    summary = gloo_cluster.summary()  # the group's own ranks, told apart from nbrpc.rank()
    line = "process group (gloo): worker1 (dist.get_rank() 0), worker2 (dist.get_rank() 1)"
    assert line in summary, summary
    out = rpc(
        shell,
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(t)\n"
        "b = torch.tensor([42.0 if dist.get_rank() == 0 else 0.0])\n"
        "dist.broadcast(b, src=0)\n"
        "(dist.get_rank(), dist.get_world_size(), t.item(), b.item())",
    )
    assert out == {"worker1": (0, 2, 3.0, 42.0), "worker2": (1, 2, 3.0, 42.0)}
    weights = rpc(shell, DDP_CELL)
    twin = _ddp_twin()
    for worker in ("worker1", "worker2"):
        for got, want in zip(weights[worker], twin, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    losses = nbrpc.pull("losses")
    assert losses["worker1"] != losses["worker2"]  # each rank trained on its own batches


def test_a_subset_of_workers_in_rank_order_and_a_fresh_group_per_cluster(shell, cluster):
    nbrpc.shutdown()
    try:
        c = nbrpc.init(n=2, process_group="gloo", process_group_workers=["worker2"], progress=False)
        assert c.process_group["ranks"] == {"worker2": 0}
        out = rpc(shell, "import torch.distributed as dist\ndist.is_initialized()")
        assert out == {"worker1": False, "worker2": True}
        nbrpc.shutdown()
        c = nbrpc.init(n=2, process_group="gloo", progress=False)  # re-created, same kernel
        assert rpc(shell, "import torch.distributed as dist\ndist.get_world_size()") == {
            "worker1": 2,
            "worker2": 2,
        }
    finally:
        nbrpc.shutdown()
        ensure_cluster()


def test_bad_process_group_input_is_refused_and_the_kernel_boots_again(cluster):
    with pytest.raises(nbrpc.ConfigError, match="--process-group 'mpi': use gloo"):
        nbrpc.Cluster(n=2, process_group="mpi")
    with pytest.raises(nbrpc.ConfigError, match="needs --process-group"):
        nbrpc.Cluster(n=2, process_group_workers=["worker1"])
    nbrpc.shutdown()
    try:
        with pytest.raises(
            nbrpc.ConfigError, match=r"trainer9: trainer9 is not a worker of this.*never a member"
        ):
            nbrpc.init(
                n=2, process_group="gloo", process_group_workers=["trainer9"], progress=False
            )
        if not torch.cuda.is_available():  # here: refused before any worker enters it
            with pytest.raises(nbrpc.ConfigError, match="nccl needs a CUDA device"):
                nbrpc.init(n=1, process_group="nccl", progress=False)
        again = nbrpc.init(n=1, progress=False)
        assert nbrpc.rpc_sync("worker1", min, args=(3, 4)) == 3
        assert again.process_group is None
    finally:
        nbrpc.shutdown()
        ensure_cluster()


def test_a_member_dies_and_the_group_is_rebuilt(shell, gloo_cluster):
    victim = gloo_cluster.workers[2].pid
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: "worker2" in gloo_cluster.dead_workers(), timeout=15)
    nbrpc.shutdown()
    c = nbrpc.init(n=2, process_group="gloo", progress=False)
    try:
        out = rpc(
            shell,
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
        )
        assert out == {"worker1": 2.0, "worker2": 2.0}
        assert c.process_group["ranks"] == {"worker1": 0, "worker2": 1}
    finally:
        nbrpc.shutdown()
