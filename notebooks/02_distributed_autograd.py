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
# # Distributed autograd
#
# Seed 001's examples with `%rpc_init` as the start-up, then a gradient check: a computation
# that crosses two workers, differentiated with distributed autograd, against the same
# computation in this process.

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --quiet

# %%
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import optim
from torch.distributed.optim import DistributedOptimizer

import nbrpc

with dist_autograd.context() as context_id:
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
    dist_autograd.backward(context_id, [loss])
    grads = dist_autograd.get_gradients(context_id)
    print(grads[t1])
    assert torch.equal(grads[t1], torch.ones(3, 3))
    assert torch.equal(grads[t2], torch.ones(3, 3))

# %% [markdown]
# Seed 001's older form, `backward(roots)` inside the block, works through `nbrpc.autograd`:

# %%
with nbrpc.autograd.context() as context_id:
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    loss = t1 + t2
    nbrpc.autograd.backward([loss.sum()])
    grads = nbrpc.autograd.get_gradients(context_id)
    print(grads[t1])
    assert torch.equal(grads[t2], torch.ones(3, 3))


# %% [markdown]
# Seed 001's `DistributedOptimizer` example. As printed it fails in torch itself
# (`requires_grad not set on root`: `torch.ones(2)` does not require grad, and an optimizer
# needs leaf tensors). Here the two parameters are leaf tensors that live on worker1, the
# loss is computed where they live, and the step is checked against plain SGD.


# %%
def make_param(value):
    return torch.full((2,), float(value), requires_grad=True)


def weighted_sum(a, b):
    return (a.local_value() * 2 + b.local_value()).sum()


rref1 = rpc.remote("worker1", make_param, args=(3,))
rref2 = rpc.remote("worker1", make_param, args=(1,))
with dist_autograd.context() as context_id:
    loss = rpc.rpc_sync("worker1", weighted_sum, args=(rref1, rref2))
    dist_autograd.backward(context_id, [loss])
    dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
    dist_optim.step(context_id)
print("loss:", loss.item(), "| parameters after one step:", rref1.to_here(), rref2.to_here())
assert torch.allclose(rref1.to_here(), torch.full((2,), 3 - 0.05 * 2))
assert torch.allclose(rref2.to_here(), torch.full((2,), 1 - 0.05 * 1))


# %% [markdown]
# ## Gradient check across workers
#
# `f(x) = sum(tanh(W2 · sin(W1 · x)))` with `W1` on worker1 and `W2` on worker2 (float64),
# against the same `f` computed here.


# %%
class Layer(torch.nn.Module):
    def __init__(self, seed, act):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4, bias=False).double()
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


def grads_of(rref, context_id):
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in rref.local_value().parameters()]


layer1 = nbrpc.remote("worker1", Layer, args=(1, torch.sin))
layer2 = nbrpc.remote("worker2", Layer, args=(2, torch.tanh))
x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

with nbrpc.autograd.context() as ctx:
    out = layer2.rpc_sync().forward(layer1.rpc_sync().forward(x)).sum()
    nbrpc.autograd.backward(ctx, [out])
    gx = nbrpc.autograd.get_gradients(ctx)[x]
    g1 = nbrpc.rpc_sync("worker1", grads_of, args=(layer1, ctx))
    g2 = nbrpc.rpc_sync("worker2", grads_of, args=(layer2, ctx))
    trace = nbrpc.trace_backward(ctx)

local1, local2 = Layer(1, torch.sin), Layer(2, torch.tanh)
xl = x.detach().clone().requires_grad_()
local2(local1(xl)).sum().backward()
torch.testing.assert_close(gx, xl.grad, rtol=1e-12, atol=1e-12)
torch.testing.assert_close(g1[0], local1.lin.weight.grad, rtol=1e-12, atol=1e-12)
torch.testing.assert_close(g2[0], local2.lin.weight.grad, rtol=1e-12, atol=1e-12)
print("cross-worker gradients equal the one-process gradients (float64, 1e-12)")

# %% [markdown]
# `nbrpc.trace_backward` returns that backward pass as plain data: functions per worker,
# and the hops between them.

# %%
from collections import Counter

for w in trace["workers"]:
    names = Counter(n["name"] for n in trace["nodes"] if n["worker"] == w["name"])
    print(w["name"], dict(names))
by_id = {n["id"]: n for n in trace["nodes"]}
for e in trace["edges"]:
    if e["kind"] == "rpc":
        print("gradient hop:", by_id[e["src"]]["worker"], "->", by_id[e["dst"]]["worker"])

# %%
# %rpc_shutdown
