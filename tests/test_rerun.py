"""PyTorch's RPC code re-run as a notebook re-runs it, in a real kernel: ranks after a
re-init, the kernel's name kept, errors through nested calls and RRef proxies."""

from __future__ import annotations

import pytest
from conftest import running_kernel

NESTED = """
import torch.distributed.rpc as rpc

def inner():
    return [][1]

def relay(to):
    return rpc.rpc_sync(to, inner)

class C:
    def f(self):
        return [][1]

def my_rank():
    return nbrpc.rank(), rpc.get_worker_info().id

def gather():  # torch's own collective over RPC, which its barriers use
    from torch.distributed.rpc import api
    return sorted(api._all_gather(rpc.get_worker_info().name, timeout=30).values())

def gather_everywhere():
    from torch.distributed.rpc import api
    futs = [rpc.rpc_async(w, gather) for w in nbrpc.workers()[1:]]
    return [sorted(api._all_gather(nbrpc.workers()[0], timeout=30).values())] + [
        f.wait() for f in futs
    ]
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(
        "%load_ext nbrpc",
        "%rpc_init --names ps --self master --quiet",
        "import nbrpc\n" + NESTED,
        closing="%rpc_shutdown",
    ) as k:
        yield k


@pytest.mark.parametrize(
    "call",
    [
        "rpc.rpc_sync('ps', relay, args=('master',))",
        "rpc.remote('ps', C).rpc_sync().f()",
        "rpc.remote('ps', C).rpc_async().f().wait()",
        "rpc.remote('ps', C).remote().f().to_here()",
    ],
)
def test_an_error_keeps_its_type_and_shows_once_per_hop(kernel, call):
    _, errors = kernel.execute(call)
    assert errors == ["IndexError: list index out of range"]
    text = "\n".join(line for tb in kernel.tracebacks for line in tb)
    assert text.count("IndexError: list index out of range") == 1 + text.count(
        "Remote traceback"
    ), text
    assert "nbrpc #" not in text
    assert "failures.py" not in text
    assert "rref_proxy.py" not in text
    assert "RuntimeError" not in text
    hops = 2 if "relay" in call else 1
    assert text.count("Remote traceback (most recent call last), on ") == hops, text


def test_ranks_and_the_kernels_name_after_a_re_init(kernel):
    """torch's ids continue after a re-init (the kernel's agent joins once); nbrpc.rank()
    gives the ranks a script has. A later %rpc_init keeps --self without being asked."""
    assert kernel.value("gather_everywhere()") == [["master", "ps"]] * 2
    kernel.run("%rpc_shutdown")
    kernel.run("%rpc_init -n 2 --quiet  # no --self: the kernel stays 'master'")
    assert kernel.value("nbrpc.workers()") == ["master", "worker1", "worker2"]
    assert kernel.value("[nbrpc.rank(), nbrpc.rank('worker2')]") == [0, 2]
    mine = kernel.value("[rpc.rpc_sync(w, my_rank) for w in ('worker1', 'worker2')]")
    assert [rank for rank, _ in mine] == [1, 2]
    assert [torch_id for _, torch_id in mine] == [2, 3]  # after ps (1): docs/architecture.md
    everyone = ["master", "worker1", "worker2"]
    for _ in range(2):  # torch's _all_gather spans the cluster, also in a re-run kernel
        assert kernel.value("gather_everywhere()") == [everyone] * 3
    _, errors = kernel.execute("%rpc_init -n 1 --self agent")
    assert errors[0].startswith("AlreadyInitializedError") or "kernel restart" in errors[0]
    kernel.run("%rpc_shutdown")
    _, errors = kernel.execute("%rpc_init -n 1 --self agent")
    assert "torch fixes a process's name for its lifetime" in errors[0]
    assert "Without --self, %rpc_init keeps 'master'" in errors[0]
    assert "starting" not in kernel.stderr  # refused before any progress was drawn
    kernel.run("%rpc_init --names ps --quiet")
    assert kernel.value("nbrpc.rank('ps')") == 1
    # the same names as the first cluster: the new ps counts its gathers from 0, and so
    # must the kernel (torch numbers them per set of names)
    assert kernel.value("gather_everywhere()") == [["master", "ps"]] * 2
