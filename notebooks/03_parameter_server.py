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
# A `ParameterServer` class defined here lives on worker1. A trainer on worker2 pulls the
# weights, computes gradients on the data made here, and pushes them back. Then a second
# trainer joins the running cluster (`%rpc_scale`), and the two share the data. The loss,
# measured on all the data, falls.

# %%
# %load_ext nbrpc
# %rpc_init -n 2 --quiet

# %%
import threading

import torch

import nbrpc

torch.manual_seed(0)
true_w = torch.tensor([[2.0], [-3.0], [0.5]])
X = torch.randn(600, 3)
y = X @ true_w + 0.01 * torch.randn(600, 1)


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


def run_epochs(trainers, epochs, steps=5):
    """Each trainer takes its shard of the data (one slice per trainer) for ``epochs``."""
    shards = {
        name: (X[i :: len(trainers)], y[i :: len(trainers)]) for i, name in enumerate(trainers)
    }
    for _ in range(epochs):
        futs = [
            nbrpc.rpc_async(name, train, args=(ps, *shard, steps)) for name, shard in shards.items()
        ]
        torch.futures.wait_all(futs)
        w = ps.rpc_sync().get_weights()
        history.append(((X @ w - y) ** 2).mean().item())
        print(
            f"epoch {len(history) - 1} ({len(trainers)} trainers): "
            f"loss on all data {history[-1]:.4f}"
        )


ps = nbrpc.remote("worker1", ParameterServer, args=(3, 0.05))
history = []
run_epochs(["worker2"], 4)
print("updates applied on the server:", ps.rpc_sync().update_count())
assert ps.rpc_sync().update_count() == 4 * 5

# %% [markdown]
# ## A second trainer, without starting over
#
# `%rpc_scale 3` starts worker3 where the others came from and joins it to the running
# group: worker1 keeps its process and the `ParameterServer` with its weights, worker2
# keeps its process. The new trainer pulls the weights the first one trained.

# %%
# %rpc_scale 3

# %%
run_epochs(["worker2", "worker3"], 4)
print("updates applied on the server:", ps.rpc_sync().update_count())
assert ps.rpc_sync().update_count() == 4 * 5 + 4 * 2 * 5  # the same server, on and on
assert history[-1] < history[0] / 10, history

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(len(history)), history, marker="o")
ax.axvline(3.5, color="gray", linestyle=":")
ax.set_xlabel("epoch (a second trainer from epoch 4)")
ax.set_ylabel("mean squared error")
ax.set_yscale("log")
ax.set_title("parameter server: 1, then 2 trainers")
plt.show()
print("learned weights:", ps.rpc_sync().get_weights().flatten().tolist())

# %% [markdown]
# ## PyTorch's parameter-server tutorial, as written
#
# PyTorch's `rpc_param_server_tutorial` is a script: each process imports it once, so the
# parameter server's process holds one `param_server` and one `global_lock`, and both
# trainers reach the same model. Pasted into a notebook, its code runs unchanged on nbrpc:
# each worker keeps one namespace for the notebook's module-level names, as a script's
# process has its module (docs/cells.md). Only the start-up is replaced (`%rpc_init`
# instead of `mp.spawn` and `init_rpc`), and random tensors in MNIST's shapes stand in for
# the download.

# %%
# %rpc_shutdown
# %rpc_init --names parameter_server,trainer_1,trainer_2 --quiet

# %%
from threading import Lock

import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer


class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device = torch.device(
            "cuda:0" if torch.cuda.is_available() and self.num_gpus > 0 else "cpu"
        )
        print(f"Putting first 2 convs on {str(device)}")  # noqa: RUF010 (as written)
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")
        print(f"Putting rest of layers on {str(device)}")  # noqa: RUF010
        self.dropout1 = nn.Dropout2d(0.25).to(device)
        self.dropout2 = nn.Dropout2d(0.5).to(device)
        self.fc1 = nn.Linear(9216, 128).to(device)
        self.fc2 = nn.Linear(128, 10).to(device)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)  # noqa: RUF005 (the tutorial's own code)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        model = Net(num_gpus=num_gpus)
        self.model = model
        self.input_device = torch.device(
            "cuda:0" if torch.cuda.is_available() and num_gpus > 0 else "cpu"
        )

    def forward(self, inp):
        inp = inp.to(self.input_device)
        out = self.model(inp)
        out = out.to("cpu")
        return out

    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        cpu_grads = {}
        for k, v in grads.items():
            k_cpu, v_cpu = k.to("cpu"), v.to("cpu")
            cpu_grads[k_cpu] = v_cpu
        return cpu_grads

    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs


param_server = None
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(num_gpus,)
        )

    def get_global_param_rrefs(self):
        remote_params = remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)
        return remote_params

    def forward(self, x):
        model_output = remote_method(ParameterServer.forward, self.param_server_rref, x)
        return model_output


def run_training_loop(rank, num_gpus, train_loader, test_loader):
    net = TrainerNet(num_gpus=num_gpus)
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    for i, (data, target) in enumerate(train_loader):
        with dist_autograd.context() as cid:
            model_output = net(data)
            target = target.to(model_output.device)
            loss = F.nll_loss(model_output, target)
            if i % 5 == 0:
                print(f"Rank {rank} training batch {i} loss {loss.item()}")
            dist_autograd.backward(cid, [loss])
            assert (
                remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
            )
            opt.step(cid)
    print("Training complete!")
    print("Getting accuracy....")
    get_accuracy(test_loader, net)


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    device = torch.device("cuda:0" if model.num_gpus > 0 and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):  # noqa: B007
            out = model(data)
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct
    print(f"Accuracy {correct_sum / len(test_loader.dataset)}")


# %% [markdown]
# The tutorial's `run_worker` would call `run_training_loop` on each trainer after its
# `init_rpc`; here the notebook starts both loops at once. Random images in MNIST's
# shapes (1x28x28, ten classes), 6 batches of 8 per trainer.

# %%
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
images, labels = torch.randn(48, 1, 28, 28), torch.randint(0, 10, (48,))
train_loader = DataLoader(TensorDataset(images, labels), batch_size=8)
test_loader = DataLoader(TensorDataset(images[:16], labels[:16]), batch_size=8)


def server_state():
    """On the parameter server: how many ParameterServer objects exist there, how often
    the first weight of its model moved, and whether the weights are finite."""
    import gc

    servers = [o for o in gc.get_objects() if type(o) is ParameterServer]
    first = next(param_server.parameters())
    return len(servers), first._version, bool(torch.isfinite(first).all())


# One trainer after the other: run at once, they race on the one model (one's optimizer
# step changes weights that the other's backward still needs: torch says "modified by an
# inplace operation"), as the tutorial's processes would.
for rank in (1, 2):
    rpc.rpc_sync(f"trainer_{rank}", run_training_loop, args=(rank, 0, train_loader, test_loader))
servers, moved, finite = rpc.rpc_sync("parameter_server", server_state)
at_creation = next(Net().parameters())._version  # the in-place initialisation
print(f"parameter servers: {servers}; its weights stepped {moved - at_creation} times")
assert servers == 1 and finite
assert moved - at_creation == 2 * len(train_loader)  # both trainers stepped the one model

# %%
# %rpc_shutdown
