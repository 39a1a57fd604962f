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
# # Why RPC: conditional communication
#
# Seed 002: worker1 looks at its data and decides whether worker2 needs it. With RPC the
# decision simply makes a call, or not; worker2 prepares nothing. With point-to-point
# `send`/`recv`, worker2 must post a `recv` in advance, and when worker1 decides not to
# send, that `recv` can only end by timing out (bounded here to 2 s so it never hangs).

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --quiet

# %%
import torch

import nbrpc


class Inbox:  # lives on worker2; state on a worker belongs in an object behind an RRef
    def __init__(self):
        self.items = []

    def deliver(self, tensor):
        self.items.append(tensor)
        return len(self.items)

    def count(self):
        return len(self.items)


def decide_and_maybe_send(inbox, seed):
    torch.manual_seed(seed)
    data = torch.randn(4)
    if data.sum() > 0:  # the decision is made here, on worker1
        inbox.rpc_sync().deliver(data)
        return "sent"
    return "kept"


inbox = nbrpc.remote("worker2", Inbox)
decisions = [
    nbrpc.rpc_sync("worker1", decide_and_maybe_send, args=(inbox, seed)) for seed in range(6)
]
received = inbox.rpc_sync().count()
print("worker1 decided:", decisions)
print("worker2 received:", received)
assert received == decisions.count("sent")

# %% [markdown]
# The same with `send`/`recv` between the two workers (a gloo process group on loopback):

# %%
import tempfile


def p2p(rank, store_path, seed):
    import datetime
    import os
    import time

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=10)
    )
    try:
        if rank == 0:  # worker1: decides, then sends or not
            torch.manual_seed(seed)
            data = torch.randn(4)
            if data.sum() > 0:
                dist.send(data, dst=1)
                return "sent"
            time.sleep(3)  # worker1 carries on with its own work
            return "kept"
        buf = torch.zeros(4)  # worker2 had to prepare a recv it may never get
        t0 = time.monotonic()
        try:
            dist.irecv(buf, src=0).wait(datetime.timedelta(seconds=2))
            return "received"
        except RuntimeError as err:
            waited = time.monotonic() - t0
            return f"recv gave up after {waited:.1f} s ({str(err).splitlines()[0][-40:]})"
    finally:
        dist.destroy_process_group()


seed = decisions.index("kept")  # a case where worker1 keeps its data
store_path = tempfile.mkdtemp() + "/p2p"
futs = [
    nbrpc.rpc_async("worker1", p2p, args=(0, store_path, seed)),
    nbrpc.rpc_async("worker2", p2p, args=(1, store_path, seed)),
]
sender, receiver = [f.wait() for f in futs]
print("worker1:", sender, "| worker2:", receiver)
assert sender == "kept"
assert receiver.startswith("recv gave up after 2.")  # it waited out its whole 2 s

# %%
# %rpc_shutdown
