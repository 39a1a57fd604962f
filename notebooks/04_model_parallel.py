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
# # Model parallel: kernel → worker1 → worker2
#
# Seed 000 scenario 1 and seed 004's layout, on CPU: the first shard runs here, the second on
# worker1, the third on worker2. Forward and backward with distributed autograd, one
# `DistributedOptimizer` step, then the gradients and the updated weights are compared with
# the same model in one process (float64, tolerance 1e-12).

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --quiet

# %%
import torch
import torch.distributed.rpc as rpc

import nbrpc
from nbrpc.optim import DistributedOptimizer


class Shard(torch.nn.Module):
    def __init__(self, seed, n_in, n_out):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(n_in, n_out), torch.nn.ReLU()).double()

    def forward(self, x):
        return self.net(x)

    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]

    def weights(self):
        return [p.detach().clone() for p in self.parameters()]


class SplitModel(torch.nn.Module):
    """shard1 here, shard2 on worker1, shard3 on worker2."""

    def __init__(self):
        super().__init__()
        self.shard1 = Shard(1, 16, 32)
        self.shard2 = nbrpc.remote("worker1", Shard, args=(2, 32, 32))
        self.shard3 = nbrpc.remote("worker2", Shard, args=(3, 32, 4))

    def forward(self, x):
        x = self.shard1(x)
        x = self.shard2.rpc_sync().forward(x)
        return self.shard3.rpc_sync().forward(x)

    def parameter_rrefs(self):
        return (
            [rpc.RRef(p) for p in self.shard1.parameters()]
            + self.shard2.rpc_sync().param_rrefs()
            + self.shard3.rpc_sync().param_rrefs()
        )


model = SplitModel()
opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
x = torch.randn(8, 16, dtype=torch.float64)
target = torch.randn(8, 4, dtype=torch.float64)

with nbrpc.autograd.context() as ctx:
    loss = torch.nn.functional.mse_loss(model(x), target)
    nbrpc.autograd.backward(ctx, [loss])
    grads_here = [nbrpc.autograd.get_gradients(ctx)[p] for p in model.shard1.parameters()]
    opt.step(ctx)
    trace = nbrpc.trace_backward(ctx)
print(f"loss {loss.item():.6f}")

# %% [markdown]
# The same model in one process:

# %%
twin = torch.nn.Sequential(Shard(1, 16, 32), Shard(2, 32, 32), Shard(3, 32, 4))
twin_loss = torch.nn.functional.mse_loss(twin(x), target)
twin_loss.backward()
for g, p in zip(grads_here, twin[0].parameters(), strict=True):
    torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
torch.optim.SGD(twin.parameters(), lr=0.05).step()

torch.testing.assert_close(loss, twin_loss, rtol=1e-12, atol=1e-12)
for mine, ref in (
    (model.shard1.parameters(), twin[0].parameters()),
    (model.shard2.rpc_sync().weights(), twin[1].parameters()),
    (model.shard3.rpc_sync().weights(), twin[2].parameters()),
):
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)
print("loss, gradients and updated weights equal the one-process twin (float64, 1e-12)")
hops = sum(e["kind"] == "rpc" for e in trace["edges"])
print(
    f"the backward pass ran {len(trace['nodes'])} functions on "
    f"{len(trace['workers'])} processes, with {hops} hops between them"
)

# %%
# %rpc_shutdown
