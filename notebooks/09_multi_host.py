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
# # Workers on other hosts
#
# `%rpc_init --hosts` starts workers on other machines over ssh, through ipyparallel's SSH
# launcher. Each entry is `[user@]address` as `ssh` takes it; a host listed twice gets two
# workers, and workers are named in list order. Before any engine starts, nbrpc checks each
# host: ssh login (key only: BatchMode), the same Python, torch, cloudpickle, ipyparallel
# and nbrpc versions, and that the host reaches this kernel. docs/multi-host.md says what
# each host needs and what the ports are.
#
# Put your hosts here. Under `make test` these variables name two fake hosts: network
# namespaces with their own address, hostname, `/dev/shm` and sshd (tools/fakehosts.py).

# %%
import os
import socket
import time

import torch

import nbrpc

HOSTS = os.environ.get("NBRPC_HOSTS", "gpu1,gpu1,gpu2")
SSH_ARGS = os.environ.get("NBRPC_SSH_ARGS", "")  # e.g. "-F ~/.ssh/cluster_config"

# %%
# %load_ext nbrpc
# %rpc_init --hosts $HOSTS --ssh-args "$SSH_ARGS"

# %% [markdown]
# The kernel listens on one address that the hosts reach (here worked out from the route
# towards the first host; `--listen ADDR` sets it). Where does each worker run?

# %%
placed = {w: nbrpc.rpc_sync(w, socket.gethostname) for w in nbrpc.workers()[1:]}
hosts = HOSTS.split(",")
print(placed)
assert len(placed) == len(hosts)
assert placed["worker1"] == placed["worker2"]  # the first host, listed twice
assert placed["worker3"] != placed["worker1"]  # another host

# %% [markdown]
# Notebook code runs there as it does on local workers, prints included.


# %%
def where_am_i(x):
    print("running on", socket.gethostname())
    return x * 2


nbrpc.rpc_sync("worker3", where_am_i, args=(torch.arange(3),))

# %% [markdown]
# An object owned on one host, used from another: `worker3` reads an RRef owned by `worker1`.

# %%
weights = nbrpc.remote("worker1", torch.ones, args=((4,),))
doubled = nbrpc.rpc_sync("worker3", lambda r: r.to_here() * 2, args=(weights,))
assert torch.equal(doubled, torch.full((4,), 2.0))
doubled

# %% [markdown]
# Tensors between hosts travel over TensorPipe's sockets: a 64 MB round trip.

# %%
big = torch.randn(16 << 20)
t0 = time.perf_counter()
back = nbrpc.rpc_sync("worker3", lambda t: t + 1, args=(big,))
print(f"64 MB to {placed['worker3']} and back: {(time.perf_counter() - t0) * 1e3:.0f} ms")
assert torch.equal(back, big + 1)

# %% [markdown]
# Distributed autograd across both hosts: the first layer lives on `worker1`, the second
# on `worker3`; the gradients equal those of the same model in one process.

# %%
torch.manual_seed(0)
first, second = torch.nn.Linear(8, 4).double(), torch.nn.Linear(4, 1).double()
r_first = nbrpc.remote("worker1", lambda m: m, args=(first,))
r_second = nbrpc.remote("worker3", lambda m: m, args=(second,))
x = torch.randn(16, 8, dtype=torch.float64)


def forward(module_rref, inputs):
    return module_rref.local_value()(inputs)


def gradients(module_rref, ctx):
    grads = nbrpc.autograd.get_gradients(ctx)
    return [grads[p] for p in module_rref.local_value().parameters()]


with nbrpc.autograd.context() as ctx:
    hidden = nbrpc.rpc_sync("worker1", forward, args=(r_first, x))
    loss = nbrpc.rpc_sync("worker3", forward, args=(r_second, hidden)).sum()
    nbrpc.autograd.backward(ctx, [loss])
    remote = nbrpc.rpc_sync("worker1", gradients, args=(r_first, ctx))
    remote += nbrpc.rpc_sync("worker3", gradients, args=(r_second, ctx))

second(first(x)).sum().backward()
local = [p.grad for p in [*first.parameters(), *second.parameters()]]
assert all(torch.allclose(r, g, atol=1e-12) for r, g in zip(remote, local, strict=True))
print("gradients across hosts equal the one-process model's")

# %% [markdown]
# The status shows each worker's host.

# %%
[(row["name"], row["host"], row["state"]) for row in nbrpc.status()]

# %% [markdown]
# Shutdown stops the engines, removes what they left on each host (their run directory,
# shared memory) and closes the ssh connections. `%rpc_init` works again in this kernel.

# %%
# %rpc_shutdown --release
