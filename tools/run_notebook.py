"""Execute a notebook headless (a real Jupyter kernel) and print what each cell computed.

Used by ``make demo``. Exits non-zero when a cell fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
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


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    started = time.monotonic()
    failed = False
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = True
        print(exc, file=sys.stderr)
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
