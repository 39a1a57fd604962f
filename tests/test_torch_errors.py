"""torch's errors that pass through nbrpc, as a notebook shows them: the cell's lines and
the error, no frame of nbrpc's modules, torch's C++ frames once, the type and the message
torch gives (``except RuntimeError`` and torch's ``assertRaisesRegex`` still match); a
TorchScript function the workers do not know says so, and the fix. A real kernel, cells
typed as a person types them."""

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


def shown(kernel) -> str:
    """The last cell's error as the notebook shows it."""
    return "\n".join(line for tb in kernel.tracebacks for line in tb)


def test_a_torchscript_function_only_the_kernel_knows_names_itself_and_the_fix(kernel):
    kernel.run(SCRIPT_ADD)
    _, errors = kernel.execute(
        "rpc.rpc_sync('worker1', my_script_add, args=(torch.ones(2), torch.ones(2)))"
    )
    assert errors[0].startswith("RuntimeError: attempted to get undefined function my_script_add")
    text = shown(kernel)
    assert "Cell In[" in text, text  # the cell's own line
    assert not [f for f in NBRPC_FRAMES if f in text], text
    assert text.count("frame #0:") == 1, text  # torch's C++ frames, once
    assert "worker1 does not know the TorchScript function my_script_add" in text, text
    assert "%%rpc" in text, text
    out = kernel.run(  # the type and words are torch's: code written for torch matches them
        "try:\n"
        "    rpc.rpc_async('worker2', my_script_add, args=(torch.ones(2), torch.ones(2))).wait()\n"
        "except RuntimeError as e:\n"
        "    print('CAUGHT', type(e).__name__, str(e).splitlines()[0])"
    )
    assert "CAUGHT RuntimeError attempted to get undefined function my_script_add" in out


def test_the_fix_the_note_gives_works(kernel):
    cell = SCRIPT_ADD.replace("my_script_add", "my_script_sum")  # compiled once on each side
    kernel.run(cell)
    kernel.run("%%rpc\nimport torch\n" + cell)  # as the note says
    out = kernel.run(
        "print(rpc.rpc_sync('worker1', my_script_sum, args=(torch.ones(2), torch.ones(2))))"
    )
    assert "tensor([2., 2.])" in out


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
    text = shown(kernel)
    assert not [f for f in NBRPC_FRAMES if f in text], text
    assert len(text.splitlines()) <= 20, text
