"""A pytest plugin: each tutorial as nbval ran it, outputs included, in build/executed-notebooks.

``make test`` runs the tutorials once, as tests (``pytest --nbval-lax notebooks``); the
documentation site (``make docs``, tools/docs_site.py) renders these copies instead of
running them a second time. nbval keeps what a cell printed and drew on its item
(``IPyNbCell.test_outputs``: set as the cell runs, the error included when it raises).
This plugin reads it after each cell and writes the tutorial once its last cell ran:
``build/executed-notebooks/NAME.ipynb``, the notebook with those outputs, and in its metadata
(``nbrpc_run``) how the run went: ``{"failed": N}`` from the first cell that failed,
``{"skipped": "why"}`` for a tutorial skipped whole (09 and 10 without root). A run of part of
a tutorial's cells (``-k``, a cell's node id) writes nothing: the last whole run stays.
tests/conftest.py registers it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest

#: metadata key tools/docs_site.py reads
RUN_KEY = "nbrpc_run"


def _is_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "test_outputs")


@dataclass
class _Run:
    """One tutorial's run: the code cells selected, and what each did."""

    notebook: Any  # nbval's IPyNbFile
    selected: int = 0
    outputs: dict[int, list] = field(default_factory=dict)  # code cell number -> outputs
    ran: int = 0
    failed: int | None = None  # the first code cell (counted from 1) that failed
    skipped: str | None = None


class NotebookOutputs:
    """The plugin: ``out`` is the folder the executed copies go to."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.runs: dict[Any, _Run] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            if _is_cell(item):
                run = self.runs.setdefault(item.parent, _Run(item.parent))
                run.selected += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        run = self.runs.get(item.parent) if _is_cell(item) else None
        if run is None:
            return
        report = outcome.get_result()
        if report.skipped and call.when == "setup" and run.skipped is None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            run.skipped = str(reason).removeprefix("Skipped: ")
        if report.failed and run.failed is None:
            run.failed = item.cell_num + 1
        if call.when == "teardown":
            run.ran += 1
            if item.test_outputs is not None:
                run.outputs[item.cell_num] = list(item.test_outputs)
            if run.ran == run.selected:
                self._write(run)

    def _write(self, run: _Run) -> None:
        nb = copy.deepcopy(run.notebook.nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        if run.selected != len(code):
            return  # part of the tutorial ran: keep the last whole run
        count = 0
        for number, cell in enumerate(code):
            outputs = run.outputs.get(number)
            if outputs is None:
                cell.outputs, cell.execution_count = [], None
                continue
            count += 1
            cell.outputs = [_output(out, count) for out in outputs]
            cell.execution_count = count
        how: dict[str, Any] = {}
        if run.skipped and not run.outputs:
            how["skipped"] = run.skipped
        if run.failed is not None:
            how["failed"] = run.failed
        nb.metadata[RUN_KEY] = how
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / Path(str(run.notebook.fspath)).name
        nbformat.validate(nb)
        nbformat.write(nb, path)


def _output(out: Any, count: int) -> Any:
    """nbval's record of one output as nbformat's output (an ``execute_result``'s count is
    the cell's here, not the kernel's)."""
    out = copy.deepcopy(out)
    kind = out["output_type"]
    if kind == "execute_result":
        out["execution_count"] = count
    if kind in ("display_data", "execute_result"):
        out.setdefault("metadata", {})
    return nbformat.from_dict(out)
