"""torch's errors that pass through nbrpc, as a notebook shows them: the cell's lines and
the error, no frame of nbrpc's modules, torch's C++ frames once, the type and the message
torch gives (``except RuntimeError`` and torch's ``assertRaisesRegex`` still match); a
TorchScript function the notebook defines runs on the workers (compiled there under the
kernel's name), also after its cell ran again and on a fresh cluster; one nbrpc cannot
send says so, and the fix. A real kernel, cells typed as a person types them."""

from __future__ import annotations

import pytest
from conftest import running_kernel

SCRIPT_ADD = (
    "@torch.jit.script\n"
    "def my_script_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:\n"
    "    return torch.add(t1, t2)\n"
)
#: what a traceback shows only if it shows nbrpc's own frames
NBRPC_FRAMES = ("nbrpc/", "facade.py", "spelling.py", "failures.py", "rrefs.py", "_torch")


@pytest.fixture(scope="module")
def kernel():
    start = "%load_ext nbrpc\n%rpc_init -n 2 --quiet\nimport torch, torch.distributed.rpc as rpc"
    with running_kernel(start, closing="%rpc_shutdown") as k:
        yield k


def test_a_torchscript_function_the_notebook_defines_runs_on_the_workers(kernel):
    kernel.run(SCRIPT_ADD)
    call = "print(rpc.rpc_sync('worker1', my_script_add, args=(torch.ones(2), torch.ones(2))))"
    assert "tensor([2., 2.])" in kernel.run(call)
    out = kernel.run(
        "one, two = torch.ones(2), 2 * torch.ones(2)\n"
        "print(rpc.rpc_async('worker2', my_script_add, args=(one, two)).wait())\n"
        "print(rpc.remote('worker1', my_script_add, args=(one, 0 * one)).to_here())"
    )
    assert "tensor([3., 3.])" in out
    assert "tensor([1., 1.])" in out
    kernel.run(SCRIPT_ADD.replace("torch.add(t1, t2)", "torch.add(t1, t2) * 10"))  # run again
    assert "mangle" in kernel.run("print(my_script_add.qualified_name)")  # torch renamed it
    assert "tensor([20., 20.])" in kernel.run(call)  # the new one, on the workers too


def test_a_torchscript_function_keeps_working_on_a_fresh_cluster_and_after_a_rerun(kernel):
    kernel.run(SCRIPT_ADD)
    call = "print(rpc.rpc_sync('worker2', my_script_add, args=(torch.ones(2), torch.ones(2))))"
    assert "tensor([2., 2.])" in kernel.run(call)
    kernel.run("%rpc_shutdown")
    kernel.run("%rpc_init -n 2 --quiet")  # fresh workers: they know no TorchScript yet
    assert "tensor([2., 2.])" in kernel.run(call)
    kernel.run(SCRIPT_ADD)  # the cell again, after the re-init
    assert "tensor([2., 2.])" in kernel.run(call)


#: what a worker does where it cannot compile a notebook's TorchScript function (a
#: module it lacks, a TorchScript version that refuses it): simulated by a compile that fails
FAILING_COMPILE = """%%rpc
import nbrpc._torch.script as script
compiles = script.compile_script_as
def refuse(*args):
    raise RuntimeError("cannot compile it here")
script.compile_script_as = refuse
"""
COMPILING_AGAIN = "%%rpc\nscript.compile_script_as = compiles"


def test_a_torchscript_function_a_worker_cannot_compile_names_itself_and_the_fix(kernel):
    kernel.run(SCRIPT_ADD.replace("my_script_add", "my_script_mul").replace("add(", "mul("))
    kernel.run(FAILING_COMPILE)
    try:
        _, errors = kernel.execute(
            "rpc.rpc_sync('worker1', my_script_mul, args=(torch.ones(2), torch.ones(2)))"
        )
        text = kernel.shown_error()
        caught = kernel.run(  # the type and words are torch's: code for torch matches them
            "try:\n"
            "    rpc.rpc_async('worker2', my_script_mul, args=(torch.ones(2),) * 2).wait()\n"
            "except RuntimeError as e:\n"
            "    print('CAUGHT', type(e).__name__, str(e).splitlines()[0])"
        )
    finally:
        kernel.run(COMPILING_AGAIN)
    assert errors[0].startswith("RuntimeError: attempted to get undefined function my_script_mul")
    assert "Cell In[" in text, text  # the cell's own line
    assert not [f for f in NBRPC_FRAMES if f in text], text
    assert text.count("frame #0:") == 1, text  # torch's C++ frames, once
    assert "worker1 does not know the TorchScript function my_script_mul" in text, text
    assert "%%rpc" in text, text
    assert "CAUGHT RuntimeError attempted to get undefined function my_script_mul" in caught
    cell = SCRIPT_ADD.replace("my_script_add", "my_script_mul").replace("add(", "mul(")
    kernel.run("%%rpc\nimport torch\n" + cell)  # the fix the note gives
    out = kernel.run(
        "print(rpc.rpc_sync('worker1', my_script_mul, args=(2 * torch.ones(2), torch.ones(2))))"
    )
    assert "tensor([2., 2.])" in out


def test_a_torchscript_function_that_calls_another_runs_on_the_workers(kernel):
    kernel.run(
        "@torch.jit.script\n"
        "def inner(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x + 1\n\n"
        "@torch.jit.script\n"
        "def outer(x: torch.Tensor) -> torch.Tensor:\n"
        "    return inner(x) * 2\n"
    )
    out = kernel.run("print(rpc.rpc_sync('worker2', outer, args=(torch.ones(2),)))")
    assert "tensor([4., 4.])" in out


@pytest.mark.parametrize(
    "cell",
    [
        "rpc.rpc_sync('worker1', my_script_add, args=(torch.ones(2), 1))",
        "rpc.rpc_async('worker1', my_script_add, args=(torch.ones(2), 1)).wait()",
        "rpc.remote('worker1', my_script_add, args=(torch.ones(2), 1)).to_here()",
    ],
    ids=["rpc_sync", "rpc_async", "remote"],
)
def test_a_torchscript_argument_error_is_torchs_in_a_few_lines(kernel, cell):
    kernel.run(SCRIPT_ADD)
    _, errors = kernel.execute(cell)
    assert errors, "a str where a Tensor goes: torch refuses it"
    assert errors[0].startswith("RuntimeError: my_script_add() Expected a value of type 'Tensor'")
    text = kernel.shown_error()
    assert not [f for f in NBRPC_FRAMES if f in text], text
    assert len(text.splitlines()) <= 20, text
