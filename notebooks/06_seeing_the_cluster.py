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
# # Seeing the cluster
#
# Three views nobody else draws inside a notebook: the processes and what they are doing,
# **who owns which remote object and who holds it**, and **how a backward pass crossed the
# processes**. Each is a live widget; each is also plain data (`nbrpc.status()`,
# `nbrpc.ownership()`, `nbrpc.trace_backward()`), and prints as text where widgets cannot
# render.

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --quiet

# %% [markdown]
# `%rpc_status` shows the **cluster view**: one card per process, updated every second while
# the kernel is idle *or busy*: calls running and done, RRefs owned and held.

# %%
# %rpc_status

# %% [markdown]
# ## A workload: a parameter server and a model split over two workers
#
# `worker1` owns a parameter server; `worker2` owns the second half of a model and holds an
# RRef to the server (it pulls weights from it). The kernel holds RRefs to both.

# %%
import gc
import time

import torch
import torch.distributed.rpc as rpc

import nbrpc
from nbrpc import autograd
from nbrpc.optim import DistributedOptimizer
from nbrpc.widgets import BackwardView, OwnershipView


class ParameterServer:
    def __init__(self, n_in, n_out):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.model(x)

    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.model.parameters()]


class Head(torch.nn.Module):
    """The second half of the model; it keeps an RRef to the parameter server."""

    def __init__(self, ps, n_in):
        super().__init__()
        torch.manual_seed(1)
        self.ps = ps  # a user reference held on worker2
        self.lin = torch.nn.Linear(n_in, 1)

    def forward(self, h):
        return self.lin(torch.relu(h))

    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


ps = nbrpc.remote("worker1", ParameterServer, args=(8, 16))
head = nbrpc.remote("worker2", Head, args=(ps, 16))
scratch = nbrpc.remote("worker2", torch.zeros, args=((1000,),))

# %% [markdown]
# The **ownership view**: each RRef is a box in its owner's lane, with an arrow to every
# process that holds a reference to it. Hover a box to highlight its arrows. It redraws by
# itself when RRefs are created or released.

# %%
owners = OwnershipView()
owners

# %%
rows = {r["created_by"]: r for r in nbrpc.ownership()}
for r in rows.values():
    print(f"{r['id']:>6}  {r['type']:<16} owner {r['owner']:<8} held by {r['holders']}")
server = rows["remote(worker1, ParameterServer)"]
assert server["owner"] == "worker1" and server["holders"] == ["worker0", "worker2"]
assert rows["remote(worker2, Head)"]["owner"] == "worker2"
print("RRef ids:", " ".join(r["id"] for r in rows.values()))

# %% [markdown]
# ## A distributed backward pass, drawn
#
# One training step: the kernel sends a batch through `worker1` and `worker2`, runs the
# backward pass across both with timing on, and steps a `DistributedOptimizer` over the
# parameters both workers own. The **backward view** has one lane per process; orange
# arrows are gradients crossing processes (send → recv), with each function's time.

# %%
torch.manual_seed(2)
x, y = torch.randn(32, 8), torch.randn(32, 1)
params = ps.rpc_sync().param_rrefs() + head.rpc_sync().param_rrefs()
opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)

with autograd.context() as ctx:
    h = ps.rpc_sync().forward(x)
    out = head.rpc_sync().forward(h)
    loss = torch.nn.functional.mse_loss(out, y)
    autograd.backward(ctx, [loss], timed=True)
    opt.step(ctx)
    trace = nbrpc.trace_backward(ctx)

hops = [e for e in trace["edges"] if e["kind"] == "rpc"]
print(f"loss {loss.item():.4f}; {len(trace['nodes'])} autograd functions, {len(hops)} hops")
assert {n["worker"] for n in trace["nodes"]} == {"worker0", "worker1", "worker2"}
assert len(hops) == 3  # h: worker1 → kernel → worker2; out: worker2 → kernel
BackwardView(trace)

# %% [markdown]
# ## Where the time went: a timeline of every call
#
# `nbrpc.record()` records every call any process of the cluster makes: who called whom,
# the function, when it was sent and ran (on one clock), the bytes each way and the path
# its tensors took, whether it raised, and the call it was made inside. Here: two more
# training steps. The **timeline view** has one lane per process, a bar per call on the
# process that ran it and an arrow from its caller; hover a bar for its row.
# (`%%rpc_timeline` at the top of a cell does the same for that cell.)

# %%
import tempfile

from nbrpc.widgets import TimelineView

with nbrpc.record() as rec:
    for _ in range(2):
        with autograd.context() as ctx:
            loss = torch.nn.functional.mse_loss(
                head.rpc_sync().forward(ps.rpc_sync().forward(x)), y
            )
            autograd.backward(ctx, [loss])
            opt.step(ctx)

calls = rec.calls
for c in calls[:4]:
    took = (c["end_s"] - c["start_s"]) * 1e3
    print(f"{c['caller']} -> {c['callee']}: {c['function']} ({took:.1f} ms, {c['bytes_in']} B in)")
print(f"timeline calls: {len(calls)}")
assert {(c["callee"], c["function"]) for c in calls} >= {
    ("worker1", "ParameterServer.forward"),
    ("worker2", "Head.forward"),
}
trace_path = rec.save(f"{tempfile.mkdtemp()}/steps.json")  # open in ui.perfetto.dev
TimelineView(rec)

# %% [markdown]
# And what every thread is doing *now*: `nbrpc.stacks()` (or `%rpc_stacks`) reads each
# worker's Python stacks from outside the process, so a worker whose every thread is busy,
# or stuck in C++ holding the GIL, answers too. Each thread says which call it serves.


# %%
def train_for(seconds):
    t = time.time()
    while time.time() - t < seconds:
        pass
    return seconds


busy = nbrpc.rpc_async("worker1", train_for, args=(2.0,))
time.sleep(0.3)
(worker1,) = nbrpc.stacks("worker1")
serving = [t for t in worker1["threads"] if t["serving"]]
print(
    "a thread of worker1: serving",
    serving[0]["serving"],
    "in",
    serving[0]["frames"][-1]["function"],
)
assert serving[0]["frames"][-1]["function"] == "train_for"
busy.wait()

# %% [markdown]
# ## Releasing an RRef
#
# Dropping the kernel's last reference to `scratch` frees it on its owner; the ownership
# view above redraws without it.

# %%
gone = rows["remote(worker2, torch.zeros)"]["id"]
del scratch
gc.collect()
deadline = time.monotonic() + 10
while any(r["id"] == gone for r in nbrpc.ownership()) and time.monotonic() < deadline:
    time.sleep(0.1)
assert all(r["id"] != gone for r in nbrpc.ownership())
print("released:", gone)

# %% [markdown]
# ## Debugging a worker from the cell that called it
#
# `breakpoint()` (or `pdb.set_trace()`) in code that runs on a worker opens pdb right here.
# The prompt names the worker, `(Pdb worker1)`; commands go into the input box under the
# cell, and pdb's answers print in the cell. `c` lets the call return its result, `q` ends
# it with `nbrpc.DebuggerQuitError`, the stop button leaves pdb and interrupts the call.
# The call's timeout does not run while pdb waits for you. Where nobody can type (this
# notebook run by nbval or `make demo`), the breakpoint is skipped with a warning line and
# the call goes on. Try `p scale`, `l`, then `c`:


# %%
def scaled(t, k):
    scale = k * 2
    breakpoint()
    return t * scale


print("scaled:", nbrpc.rpc_sync("worker1", scaled, args=(torch.ones(3), 2)))

# %% [markdown]
# After a worker raised, `%rpc_debug` opens pdb on the frame that raised, on that worker:
# `up` and `down` walk its frames, `p` prints its locals (here `p total`), `c` leaves. The
# worker keeps the traceback of its last failure only, until the next one.


# %%
def normalise(values):
    total = sum(values)
    return [v / total for v in values]


try:
    nbrpc.rpc_sync("worker2", normalise, args=([0, 0],))
except ZeroDivisionError as exc:
    print(f"{type(exc).__name__} raised on {exc.worker}")

# %%
# %rpc_debug

# %% [markdown]
# ## Progress from the workers
#
# A loop on a worker shows its progress in the cell that called it, live: `tqdm.auto`
# there draws a widget bar labelled with the worker (the text bar where widgets do not
# render), and a line a worker rewrites with `\r` updates in place. What C and C++ code
# on a worker writes to its file descriptors shows too, as that worker's stderr.

# %%
# %%rpc
import os
import time

from tqdm.auto import tqdm

for _ in tqdm(range(10), desc="epoch 1"):
    time.sleep(0.1)
written = os.write(2, b"a line from C on this worker\n")

# %% [markdown]
# Where widgets do not render (nbconvert to HTML, a terminal), the same views print as text:

# %%
print(repr(owners))

# %%
# %rpc_shutdown
