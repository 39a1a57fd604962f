"""Execute a notebook headless (a real Jupyter kernel) and print what each cell computed.

Used by ``make demo`` and by tests/test_notebooks.py. Exits non-zero when a cell fails.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "") + "\n"
    if output.get("output_type") == "error":
        return f"{output.get('ename')}: {output.get('evalue')}\n"
    return ""


def execute(path: str | Path, timeout: int = 600) -> tuple[nbformat.NotebookNode, bool]:
    """Run every cell of the notebook at ``path`` in a new kernel, in the notebook's folder.

    Returns the notebook with its outputs, and whether a cell failed (the cells after it
    did not run)."""
    nb = nbformat.read(path, as_version=4)
    # the kernel's channels are files only this user can open, not TCP ports that any local
    # process could reach (ipykernel warns that those are unencrypted)
    sockets = tempfile.mkdtemp(prefix="nbrpc-notebook-")
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=f"{sockets}/kernel")
    client = NotebookClient(
        nb, km=kernel, timeout=timeout, resources={"metadata": {"path": str(Path(path).parent)}}
    )
    try:
        client.execute()
        return nb, False
    except CellExecutionError as exc:
        print(exc, file=sys.stderr)
        return nb, True
    finally:
        if kernel.has_kernel:
            kernel.shutdown_kernel()  # as nbclient does with a kernel it started itself
        shutil.rmtree(sockets, ignore_errors=True)


def main(path: str) -> int:
    started = time.monotonic()
    nb, failed = execute(path)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        print(f"--- cell {index}: {first}")
        for output in cell.outputs:
            sys.stdout.write(text_of(output))
    print(f"--- {path}: {'FAILED' if failed else 'ran'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/01_quickstart.ipynb"))
