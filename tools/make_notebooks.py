"""Writes the tutorial notebooks from the cell sources below (outputs stay empty).

Notebooks are committed without outputs; edit them in JupyterLab or here, then run
``python tools/make_notebooks.py`` to regenerate. Kept so a diff of a tutorial reads as code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent / "notebooks"


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(text.strip())


QUICKSTART = [
    md("""
# nbrpc quickstart

The kernel and two worker processes form one `torch.distributed.rpc` group. Everything
below is defined in this notebook and runs on the workers: functions, a lambda, a class
behind an `RRef`, a parameter server. Seeds 000 and 001 of the torch RPC docs, with their
`mp.spawn` start-up replaced by `%rpc_init`.
"""),
    code("""
%load_ext nbrpc
%rpc_init -n 2
"""),
    md("## `rpc_sync` with a function defined here (seed 000)"),
    code("""
import torch
import torch.distributed.rpc as rpc

import nbrpc


def remote_add(to_add, value):
    return to_add + value


result = rpc.rpc_sync("worker1", remote_add, args=(torch.tensor(1), torch.tensor(2)))
print(f"Remote result: {result}")
assert result.item() == 3
"""),
    md("## Futures with `rpc_async` (seed 001)"),
    code("""
fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
result = fut1.wait() + fut2.wait()
print("rpc_async:", result)
assert result.tolist() == [5.0, 5.0]

futs = [nbrpc.rpc_async(f"worker{1 + i % 2}", remote_add, args=(i, 10)) for i in range(6)]
print("six futures:", torch.futures.wait_all(futs))
"""),
    md("## `remote` and `RRef` (seed 001)"),
    code("""
rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
rref2 = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
x = rref1.to_here() + rref2.to_here()
print("rref1 owner:", rref1.owner().name, "| rref2 owner:", rref2.owner().name, "| sum:", x)
assert x.tolist() == [6.0, 6.0]
"""),
    md("""
## A parameter server defined in the notebook

`ParameterServer` lives on worker1 behind an `RRef`; a trainer function runs on worker2 and
pushes gradients to it through the `RRef`'s proxy. The result is checked against the same
update done here, in one process.
"""),
    code("""
class ParameterServer:
    def __init__(self, seed):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(10, 10)

    def update_parameters(self, grads, lr):
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads):
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
for got, want in zip(after, expected):
    torch.testing.assert_close(got, want)
print("weight change:", (after[0] - before[0]).abs().sum().item(), "(matches the local update)")
"""),
    md("## A lambda"),
    code("""
square = nbrpc.rpc_sync("worker2", lambda t: t * t, args=(torch.arange(4),))
print("squares:", square)
assert square.tolist() == [0, 1, 4, 9]
"""),
    md("## Output and errors come back to this cell"),
    code("""
def greet(n):
    for i in range(n):
        print(f"hello {i} from the worker")
    return n


nbrpc.rpc_sync("worker1", greet, args=(2,))
"""),
    code("""
def divide(a, b):
    ratio = a / b
    return ratio


try:
    nbrpc.rpc_sync("worker2", divide, args=(1, 0))
except ZeroDivisionError as err:  # the worker's exception, with its own type
    print(f"caught {type(err).__name__} from {err.worker}")
    print(err.remote_traceback)
"""),
    md("## Status, shutdown, and a second cluster in the same kernel"),
    code("""
%rpc_status
"""),
    code("""
%rpc_shutdown
%rpc_init -n 2 --quiet
print("workers again:", nbrpc.workers())
print("a call on the new cluster:", nbrpc.rpc_sync("worker1", remote_add, args=(40, 2)))
%rpc_shutdown
"""),
]

NOTEBOOKS = {"01_quickstart.ipynb": QUICKSTART}


def main() -> int:
    for name, cells in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nbformat.write(nb, ROOT / name)
        print(f"wrote notebooks/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
