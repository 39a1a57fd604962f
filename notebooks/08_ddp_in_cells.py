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
import matplotlib

matplotlib.use("Agg")
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

# %%
# %rpc_shutdown
