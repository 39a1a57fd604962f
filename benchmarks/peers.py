"""Importable code for the baselines (workers import it by name, no pickling by value)."""

import torch
import torch.distributed.rpc as rpc


def echo(x):
    return x


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
