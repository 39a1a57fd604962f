"""`make test`: nbrpc as a user installs it, from its wheel, without the test extra.

Run by the Makefile with the interpreter of a fresh virtualenv that holds only
torch==2.13.0 and the wheel (and what the wheel declares). It boots a one-worker cluster,
makes a call, loads the IPython extension, and fails on any Python warning either prints:
an undeclared runtime dependency shows up here (torch's "Failed to initialize NumPy").
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import warnings
warnings.simplefilter("always")
import torch
import nbrpc
with nbrpc.init(n=1, progress=False):
    assert nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
from IPython.core.interactiveshell import InteractiveShell
InteractiveShell.instance().run_line_magic("load_ext", "nbrpc")
nbrpc.shutdown(release=True)
print("package check: a call and %load_ext nbrpc work from the wheel")
"""


def link_torch(venv: str) -> None:
    """Put this interpreter's torch (torch==2.13.0, as the Makefile installs it) into the
    fresh ``venv``: the very files ``pip install torch==2.13.0`` unpacks there, hard-linked
    (about 1 s instead of 45 s of unzipping 900 MB). Its metadata comes along, so pip sees
    torch installed and installs only what torch and the wheel declare."""
    import importlib.metadata

    from torch_venv import link_files  # tools/, this script's folder, is on sys.path

    link_files(importlib.metadata.distribution("torch"), venv)


def main() -> int:
    if sys.argv[1:2] == ["--link-torch"]:
        link_torch(sys.argv[2])
        return 0
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    warnings = [line for line in done.stderr.splitlines() if "Warning:" in line]
    sys.stdout.write(done.stdout)
    if done.returncode != 0 or warnings:
        sys.stderr.write(done.stderr[-4000:])
        sys.stderr.write(
            "\npackage check failed: "
            + ("warnings above" if warnings else f"exit status {done.returncode}")
            + " (installed from the wheel, without the test extra)\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
