"""`make lint`: each tutorial's .ipynb matches its reviewed source, notebooks/NN_name.py.

The .py (jupytext percent format) is what ruff checks and a diff shows; the .ipynb is what
JupyterLab opens and nbval runs. Either may be edited: `make notebooks` syncs the pair
(the newer file wins). This check fails when they differ in any cell's type, source or
tags, or when a committed .ipynb carries outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cells(nb) -> list[tuple[str, str, list]]:
    return [(c.cell_type, c.source.strip(), c.metadata.get("tags", [])) for c in nb.cells]


def main() -> int:
    problems = []
    sources = sorted(NOTEBOOKS.glob("*.py"))
    for ipynb in sorted(NOTEBOOKS.glob("*.ipynb")):
        if not ipynb.with_suffix(".py").exists():
            problems.append(f"{ipynb.name} has no source {ipynb.with_suffix('.py').name}")
    for source in sources:
        ipynb = source.with_suffix(".ipynb")
        if not ipynb.exists():
            problems.append(f"{source.name} has no {ipynb.name}")
            continue
        want = _cells(jupytext.read(source))
        committed = nbformat.read(ipynb, as_version=4)
        have = _cells(committed)
        if want != have:
            first = next(
                (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
                min(len(want), len(have)),
            )
            problems.append(f"{ipynb.name} differs from {source.name} from cell {first} on")
        if any(c.get("outputs") or c.get("execution_count") for c in committed.cells):
            problems.append(f"{ipynb.name} carries outputs: commit notebooks without them")
    for problem in problems:
        print(f"notebooks: {problem}", file=sys.stderr)
    if problems:
        print("Run `make notebooks` to sync each pair, then commit both files.", file=sys.stderr)
        return 1
    print(f"notebooks: {len(sources)} pairs in sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
