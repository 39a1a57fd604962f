# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -lines_to_next_cell
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Cells on the workers, collectives and DDP (seed 003)
#
# Seed 003 starts every DDP example with `mp.spawn` and `init_process_group` in each
# process. Here the notebook starts the workers once. They form an RPC group with the
# kernel and, with `--process-group gloo`, a `torch.distributed` process group among
# themselves (rank = worker index − 1; the kernel is not a member). `%%rpc` cells then run
# on the workers, in namespaces that persist from cell to cell (docs/cells.md).

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --process-group gloo

# %% [markdown]
# ## `%%rpc` basics
#
# A cell runs on every worker at once. Names it defines stay there for the next cell. Its
# last value comes back once per worker.

# %%
# %%rpc
import os

import torch
import torch.distributed as dist

rank, world = dist.get_rank(), dist.get_world_size()
print(f"pid {os.getpid()}: rank {rank} of {world}")
(rank, world)

# %% [markdown]
# ## Collectives: `all_reduce` and `broadcast`

# %%
# %%rpc
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)  # sum over the group: 1 + 2
b = torch.tensor([42.0 if rank == 0 else 0.0])
dist.broadcast(b, src=0)  # rank 0's value everywhere
(t.item(), b.item())

# %%
from IPython import get_ipython

import nbrpc

sums = get_ipython().run_cell_magic("rpc", "all", "(t.item(), b.item())")
assert sums == {"worker1": (3.0, 42.0), "worker2": (3.0, 42.0)}, sums
print("all_reduce and broadcast agree on both workers:", sums)

# %% [markdown]
# ## DDP training on two workers
#
# Seed 003's `demo_basic`, as cells. Each rank trains on its own batches. DDP averages the
# gradients across the group in `backward()`, so both workers take the same steps.

# %%
# %%rpc
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)  # DDP also broadcasts rank 0's initial weights
model = torch.nn.Sequential(
    torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
).double()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)  # each rank's own data
losses = []
for _ in range(30):
    x = torch.randn(16, 10, generator=g, dtype=torch.float64)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(16, 1, generator=g, dtype=torch.float64)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(f"rank {rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

# %% [markdown]
# ## Checked against one process
#
# The twin is the same model in the kernel, one process. At each step it averages the
# gradients of the two ranks' batches, which is what DDP computes. Its weights must equal
# each worker's.

# %%
import torch


def twin_weights(world=2, steps=30):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    for _ in range(steps):
        total = 0
        for g in gens:
            x = torch.randn(16, 10, generator=g, dtype=torch.float64)
            noise = 0.1 * torch.randn(16, 1, generator=g, dtype=torch.float64)
            y = x[:, :1] * 2 - x[:, 1:2] + noise
            total = total + torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (total / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


twin = twin_weights()
weights = get_ipython().run_cell_magic(
    "rpc", "all", "[p.detach().clone() for p in model.parameters()]"
)
for params in weights.values():
    for got, want in zip(params, twin, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
print("both workers' weights equal the one-process twin (float64, 1e-10)")

# %% [markdown]
# ## Each worker's loss

# %%
import matplotlib.pyplot as plt
from IPython.display import display

losses = nbrpc.pull("losses")
fig, ax = plt.subplots(figsize=(6, 2.5))
for worker, values in losses.items():
    ax.plot(values, label=f"{worker} (its own batches)")
ax.set_xlabel("step")
ax.set_ylabel("MSE loss")
ax.set_title("DDP on two workers, from %%rpc cells")
ax.legend()
fig.tight_layout()
display(fig)
plt.close(fig)
assert all(v[-1] < v[0] for v in losses.values()), losses

# %% [markdown]
# ## DDP and RPC together (pytorch/examples' `ddp_rpc` layout)
#
# Three workers in one RPC group: a parameter server `ps` holding an embedding table as a
# `RemoteModule`, and two trainers in a DDP group for the dense part. Each trainer's
# backward pass crosses to `ps` through distributed autograd. `DistributedOptimizer` then
# steps both the remote embedding and the local DDP layer.

# %%
# %rpc_shutdown
layout = nbrpc.init(  # as %rpc_init --names ps,trainer0,trainer1 --process-group gloo ...
    names=["ps", "trainer0", "trainer1"],
    process_group="gloo",
    process_group_workers=["trainer0", "trainer1"],  # ... --process-group-workers ...
)
print(layout.summary())

# %%
# %%rpc ps
import torch

torch.manual_seed(0)  # the embeddings' initial values: the same on every run

# %%
# %%rpc trainer0,trainer1
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS, EMBEDDING_DIM = 100, 16
rank = dist.get_rank()


class HybridModel(torch.nn.Module):
    """The sparse part on the parameter server (RemoteModule), the dense part in DDP."""

    def __init__(self, remote_emb):
        super().__init__()
        self.remote_emb = remote_emb
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, 8))

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb.forward(indices, offsets))


emb = RemoteModule(
    "ps/cpu", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
)
model = HybridModel(emb)
params = emb.remote_parameters() + [RRef(p) for p in model.fc.parameters()]
opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
g = torch.Generator().manual_seed(7 + rank)
hybrid_losses = []
for _ in range(40):
    offsets = torch.arange(0, 16)  # 16 bags of one index each
    indices = torch.randint(0, NUM_EMBEDDINGS, (16,), generator=g)
    target = indices % 8  # learnable: each index's class
    with dist_autograd.context() as ctx:
        loss = torch.nn.functional.cross_entropy(model(indices, offsets), target)
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    hybrid_losses.append(loss.item())
(sum(hybrid_losses[:5]) / 5, sum(hybrid_losses[-5:]) / 5)

# %%
fc = get_ipython().run_cell_magic(
    "rpc", "trainer0,trainer1", "[p.detach().clone() for p in model.fc.parameters()]"
)
for a, b in zip(fc["trainer0"], fc["trainer1"], strict=True):
    assert torch.equal(a, b)  # DDP kept the dense layer identical on both trainers
before_after = nbrpc.pull("hybrid_losses", workers="trainer0,trainer1")
for worker, values in before_after.items():
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    print(f"{worker}: loss {first:.2f} -> {last:.2f}")
    assert last < first, (worker, first, last)
print("the embedding lives on:", {r["owner"] for r in nbrpc.ownership() if r["type"]})

# %%
# %rpc_shutdown
