"""Importable code for the baselines (workers import it by name, no pickling by value)."""

import torch
import torch.distributed.rpc as rpc


def echo(x):
    return x


def add_one(x):
    """A small Python function (the small-call row of cuda_rpc.py)."""
    return x + 1


class Shard(torch.nn.Module):
    """04_model_parallel's shard."""

    def __init__(self, seed: int, n_in: int, n_out: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(n_in, n_out), torch.nn.ReLU())

    def forward(self, x):
        return self.net(x)

    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


class SeedShard(torch.nn.Module):
    """The CUDA-RPC tutorial's shard (seeds/004): one Linear(1000, 1000) on ``device``;
    ``comm_mode="cpu"`` stages its output through CPU memory, ``"cuda"`` returns it where
    it is (a device map then sends it device to device)."""

    def __init__(self, device: str, comm_mode: str, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.device = device
        self.linear = torch.nn.Linear(1000, 1000).to(device)
        self.comm_mode = comm_mode

    def forward(self, x):
        y = self.linear(x.to(self.device))
        return y.cpu() if self.comm_mode == "cpu" else y
