"""The quickstart in a real Jupyter kernel: what shows up in which cell.

nbval (``make test`` runs it over ``notebooks/``) checks that every cell runs and that the
notebooks' own asserts hold; this test checks the outputs a person reads, run by the
runner ``make demo`` uses (tools/run_notebook.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append(f"ERROR {out['ename']}: {out['evalue']}")
    return "".join(parts)


@pytest.fixture(scope="module")
def quickstart():
    nb, failed = load_tool("run_notebook").execute(ROOT / "notebooks" / "01_quickstart.ipynb", 300)
    assert not failed
    return {
        cell.source.splitlines()[0]: _text(cell) for cell in nb.cells if cell.cell_type == "code"
    }


def test_rpc_init_cell_shows_progress_and_summary(quickstart):
    out = quickstart["%load_ext nbrpc"]
    # the progress widget; where widgets do not render (here: its text/plain), what happens
    assert "nbrpc: starting 2 workers (worker1, worker2)" in out
    assert "nbrpc RPC group: 3 processes, ready" in out
    for name in ("worker0", "worker1", "worker2"):
        assert name in out


def test_remote_print_lands_in_the_calling_cell(quickstart):
    out = quickstart["def greet(n):"]
    assert "[worker1] hello 0 from the worker\n[worker1] hello 1 from the worker\n" in out
    assert out.rstrip().endswith("2")  # the result comes after the output


def test_trainer_print_lands_in_the_parameter_server_cell(quickstart):
    assert "[worker2] pushing gradients with norm" in quickstart["class ParameterServer:"]


def test_remote_traceback_shows_the_notebook_line(quickstart):
    out = quickstart["def divide(a, b):"]
    assert "caught ZeroDivisionError from worker2" in out
    assert "ratio = a / b" in out


def test_second_cluster_in_the_same_kernel(quickstart):
    out = quickstart["%rpc_shutdown"]
    assert "workers again: ['worker0', 'worker1', 'worker2']" in out
    assert "a call on the new cluster: 42" in out
    assert "phases: controller 0.00 s, engines" in out  # the controller was kept
    assert "controller and spare engines released" in out


def test_no_cell_failed(quickstart):
    assert not [src for src, out in quickstart.items() if "ERROR " in out]


def test_the_demo_prints_each_cells_output_says_which_failed_and_leaves_nothing(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os\nprint('computed', 6 * 7, os.getcwd())"),
        nbformat.v4.new_code_cell("1 / 0"),
        nbformat.v4.new_code_cell("print('never runs')"),
    ]
    path = tmp_path / "nb" / "demo.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "run_notebook.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 1, run
    assert f"--- cell 0: import os\ncomputed 42 {path.parent}\n" in run.stdout
    assert "ZeroDivisionError: division by zero" in run.stdout
    assert "never runs" not in run.stdout
    assert f"--- {path}: FAILED in " in run.stdout
    # the kernel listened on files in a private folder, not on TCP ports, and they are gone
    assert "without encryption" not in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nb"]
