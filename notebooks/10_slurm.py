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
# # Workers from Slurm
#
# On a cluster run by Slurm, nodes come from the scheduler. `%rpc_init --slurm -n N` asks
# Slurm for one job of N tasks (ipyparallel's Slurm launcher writes the `sbatch` script;
# its `srun` starts one engine per task), waits for it in the queue showing Slurm's reason,
# and joins the engines as `worker1..N` in task order. Inside an allocation (a notebook
# server started by `sbatch`, Open OnDemand) the workers are a step of that job instead.
# docs/slurm.md says what the nodes need.
#
# Under `make test` this runs against a real Slurm (Debian's slurmctld, slurmd and munge)
# on two fake hosts: network namespaces with their own address, hostname and PID
# namespace (tools/fakeslurm.py). Elsewhere, it uses your cluster's `sbatch`.

# %%
import os
import socket
import subprocess

import torch

import nbrpc

PARTITION = os.environ.get("NBRPC_SLURM_PARTITION", "debug")

# %% [markdown]
# Four workers on two nodes, ten minutes at most. While the job waits, the progress shows
# its id, state and Slurm's reason (`Priority`, `Resources`, ...); `--queue-timeout S`
# gives up after S seconds, and the stop button gives up at once; either way the job is
# cancelled.

# %%
# %load_ext nbrpc
# %rpc_init --slurm -n 4 --nodes 2 --partition $PARTITION --time 10 --queue-timeout 120


# %%
def slurm_env(name):
    return os.environ[name]  # runs on the worker: its own environment


nodes = {w: nbrpc.rpc_sync(w, socket.gethostname) for w in nbrpc.workers()[1:]}
tasks = {w: nbrpc.rpc_sync(w, slurm_env, args=("SLURM_PROCID",)) for w in nodes}
print(nodes)
print(tasks)
assert len(set(nodes.values())) == 2
assert [tasks[w] for w in ("worker1", "worker2", "worker3", "worker4")] == ["0", "1", "2", "3"]

# %% [markdown]
# Each row of `nbrpc.status()` names the worker's node; the summary names the job.

# %%
print(nbrpc.current().summary())
job = nbrpc.rpc_sync("worker1", slurm_env, args=("SLURM_JOB_ID",))
print(subprocess.run(["squeue", "-j", job], capture_output=True, text=True).stdout)

# %% [markdown]
# Everything else works as with local workers: calls, RRefs across nodes, `%%rpc` cells,
# distributed autograd. A tensor made on one node, doubled on the other:


# %%
def double(rref):
    return rref.to_here() * 2


ones = nbrpc.remote("worker1", torch.ones, args=((3,),))
twice = nbrpc.rpc_sync("worker4", double, args=(ones,))
print(twice)
assert twice.tolist() == [2.0, 2.0, 2.0]

# %%
# %%rpc worker1,worker3
import os
import socket

print(socket.gethostname(), "task", os.environ["SLURM_PROCID"], "job", os.environ["SLURM_JOB_ID"])

# %% [markdown]
# `%rpc_shutdown` ends the job: nothing of it stays in `squeue`, no engine on any node.

# %%
# %rpc_shutdown

# %%
left = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout
print(f"in squeue after the shutdown: {left.strip() or 'nothing'}")
