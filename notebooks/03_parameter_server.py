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
# # A parameter server
#
# A `ParameterServer` class defined here lives on worker1. Trainers on worker2 and worker3
# pull the weights, compute gradients on their own shard of data made here, and push them
# back. The loss, measured on all the data, falls.

# %%
# %load_ext nbrpc
# %rpc_init -n 3 --quiet

# %%
import threading

import torch

import nbrpc

torch.manual_seed(0)
true_w = torch.tensor([[2.0], [-3.0], [0.5]])
X = torch.randn(600, 3)
y = X @ true_w + 0.01 * torch.randn(600, 1)
shards = {"worker2": (X[:300], y[:300]), "worker3": (X[300:], y[300:])}


class ParameterServer:
    def __init__(self, n_features, lr):
        self.w = torch.zeros(n_features, 1)
        self.lr = lr
        self.lock = threading.Lock()
        self.updates = 0

    def get_weights(self):
        with self.lock:
            return self.w.clone()

    def push_gradient(self, grad):
        with self.lock:
            self.w -= self.lr * grad
            self.updates += 1
            return self.updates

    def update_count(self):
        return self.updates


def train(ps, X, y, steps):
    losses = []
    for _ in range(steps):
        w = ps.rpc_sync().get_weights().requires_grad_()
        loss = ((X @ w - y) ** 2).mean()
        loss.backward()
        ps.rpc_sync().push_gradient(w.grad)
        losses.append(loss.item())
    return losses


ps = nbrpc.remote("worker1", ParameterServer, args=(3, 0.05))
history = []
for epoch in range(8):
    futs = [nbrpc.rpc_async(name, train, args=(ps, *shard, 5)) for name, shard in shards.items()]
    torch.futures.wait_all(futs)
    w = ps.rpc_sync().get_weights()
    history.append(((X @ w - y) ** 2).mean().item())
    print(f"epoch {epoch}: loss on all data {history[-1]:.4f}")
print("updates applied on the server:", ps.rpc_sync().update_count())
assert ps.rpc_sync().update_count() == 8 * 2 * 5
assert history[-1] < history[0] / 10, history

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(len(history)), history, marker="o")
ax.set_xlabel("epoch")
ax.set_ylabel("mean squared error")
ax.set_yscale("log")
ax.set_title("parameter server: 2 trainers, 1 server")
plt.show()
print("learned weights:", ps.rpc_sync().get_weights().flatten().tolist())

# %%
# %rpc_shutdown
