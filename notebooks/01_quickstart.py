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
# # nbrpc quickstart
#
# The kernel and two worker processes form one `torch.distributed.rpc` group. Everything
# below is defined in this notebook and runs on the workers: functions, a lambda, a class
# behind an `RRef`, a parameter server. Seeds 000 and 001 of the torch RPC docs, with their
# `mp.spawn` start-up replaced by `%rpc_init`.

# %%
# %load_ext nbrpc
# %rpc_init -n 2

# %% [markdown]
# ## `rpc_sync` with a function defined here (seed 000)

# %%
import torch
import torch.distributed.rpc as rpc

import nbrpc


def remote_add(to_add, value):
    return to_add + value


result = rpc.rpc_sync("worker1", remote_add, args=(torch.tensor(1), torch.tensor(2)))
print(f"Remote result: {result}")
assert result.item() == 3

# %% [markdown]
# ## Futures with `rpc_async` (seed 001)

# %%
fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
result = fut1.wait() + fut2.wait()
print("rpc_async:", result)
assert result.tolist() == [5.0, 5.0]

futs = [nbrpc.rpc_async(f"worker{1 + i % 2}", remote_add, args=(i, 10)) for i in range(6)]
print("six futures:", torch.futures.wait_all(futs))

# %% [markdown]
# ## `remote` and `RRef` (seed 001)

# %%
rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
rref2 = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
x = rref1.to_here() + rref2.to_here()
print("rref1 owner:", rref1.owner().name, "| rref2 owner:", rref2.owner().name, "| sum:", x)
assert x.tolist() == [6.0, 6.0]


# %% [markdown]
# ## A parameter server defined in the notebook
#
# `ParameterServer` lives on worker1 behind an `RRef`; a trainer function runs on worker2 and
# pushes gradients to it through the `RRef`'s proxy. The result is checked against the same
# update done here, in one process.


# %%
class ParameterServer:
    def __init__(self, seed):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(10, 10)

    def update_parameters(self, grads, lr):
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p -= lr * g
        return [p.detach().clone() for p in self.model.parameters()]

    def parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]


def train_step(ps_rref, seed):
    torch.manual_seed(seed)
    grads = [torch.randn(10, 10), torch.randn(10)]
    print(f"pushing gradients with norm {grads[0].norm():.3f}")
    return ps_rref.rpc_sync().update_parameters(grads, 0.01)


ps = nbrpc.remote("worker1", ParameterServer, args=(0,))
before = ps.rpc_sync().parameters()
after = nbrpc.rpc_sync("worker2", train_step, args=(ps, 1))

local = ParameterServer(0)
torch.manual_seed(1)
expected = local.update_parameters([torch.randn(10, 10), torch.randn(10)], 0.01)
for got, want in zip(after, expected, strict=True):
    torch.testing.assert_close(got, want)
print("weight change:", (after[0] - before[0]).abs().sum().item(), "(matches the local update)")

# %% [markdown]
# ## A lambda

# %%
square = nbrpc.rpc_sync("worker2", lambda t: t * t, args=(torch.arange(4),))
print("squares:", square)
assert square.tolist() == [0, 1, 4, 9]


# %% [markdown]
# ## Output and errors come back to this cell


# %%
def greet(n):
    for i in range(n):
        print(f"hello {i} from the worker")
    return n


nbrpc.rpc_sync("worker1", greet, args=(2,))


# %%
def divide(a, b):
    ratio = a / b
    return ratio


try:
    nbrpc.rpc_sync("worker2", divide, args=(1, 0))
except ZeroDivisionError as err:  # the worker's exception, with its own type
    print(f"caught {type(err).__name__} from {err.worker}")
    print(err.remote_traceback)

# %% [markdown]
# ## Cells that run on the workers: `%%rpc`
#
# Each worker keeps one namespace for the notebook's module-level names, as each process of
# a script has its module: a function's `global` assignment stays there between calls. A
# `%%rpc` cell runs on the workers themselves, in that namespace: `calls` below lives on
# worker1 and worker2. The cell's last value comes back per worker (docs/cells.md).

# %%
# %%rpc
import os

calls = 0

# %%
# %%rpc
calls += 1
(os.getpid(), calls)

# %%
from IPython import get_ipython

seen = get_ipython().run_cell_magic("rpc", "all", "calls")  # the magic returns a dict
assert seen == {"worker1": 1, "worker2": 1}, seen
nbrpc.push({"scale": 3})  # values into every worker's namespace ...
print("pulled back:", nbrpc.pull("scale"))  # ... and out again

# %% [markdown]
# ## Restart a worker without losing the rest
#
# A worker that died (out of memory, a crash in an extension, `kill`) or hangs is replaced
# by a fresh process under the same name: `%rpc_restart worker2`. The kernel and worker1 keep
# everything; what the old worker2 held is gone, and says so.

# %%
# %rpc_restart worker2
print("worker1 kept its namespace:", nbrpc.pull("scale", workers="worker1"))
print("worker2 starts afresh:", get_ipython().run_cell_magic("rpc", "worker2", "'calls' in dir()"))
print("and answers:", nbrpc.rpc_sync("worker2", remote_add, args=(40, 2)))

# %% [markdown]
# ## Status, shutdown, and a second cluster in the same kernel
#
# `%rpc_shutdown` keeps the controller and starts spare engines (torch already imported) in
# the background, so the next `%rpc_init` only joins them: a fraction of a second instead of
# the first boot's few. `nbrpc.current().boot_seconds` says where a boot's time went.
# `%rpc_shutdown --release` stops the controller and the spares too.

# %%
# %rpc_status

# %%
# %rpc_shutdown
# %rpc_init -n 2 --quiet
print("workers again:", nbrpc.workers())
print("a call on the new cluster:", nbrpc.rpc_sync("worker1", remote_add, args=(40, 2)))
print("phases:", ", ".join(f"{k} {v:.2f} s" for k, v in nbrpc.current().boot_seconds.items()))
# %rpc_shutdown --release
