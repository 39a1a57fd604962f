"""tools/gpu_check.py: the GPU checks in one command, each step under its own limit."""

from __future__ import annotations

import pytest
import torch
from conftest import load_tool


def test_each_step_ends_by_itself_or_at_its_limit_and_says_which(tmp_path):
    gpu_check = load_tool("gpu_check")
    done = gpu_check.run_step("ok", ["-c", "print('one'); print('last line')"], 30, tmp_path)
    assert done.startswith("ok: passed in "), done
    assert done.endswith("; last line"), done
    failed = gpu_check.run_step("bad", ["-c", "raise SystemExit(3)"], 30, tmp_path)
    assert failed.startswith("bad: failed (exit 3)"), failed
    slow = gpu_check.run_step("slow", ["-c", "import time; time.sleep(30)"], 1, tmp_path)
    assert slow.startswith("slow: ended at its limit (1 s) in 1 s"), slow
    assert (tmp_path / "ok.log").read_text() == "one\nlast line\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks run")
def test_without_cuda_it_says_so_and_succeeds(capsys):
    assert load_tool("gpu_check").main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_the_steps_run_in_the_issues_order_and_name_files_that_exist():
    gpu_check = load_tool("gpu_check")
    assert [name for name, _, _ in gpu_check.STEPS] == ["tests", "benchmark", "notebook"]
    for _, argv, _ in [*gpu_check.STEPS, gpu_check.COMPAT]:
        for part in argv:
            if part.endswith((".py", ".ipynb")):
                assert (gpu_check.ROOT / part).exists(), part


def test_the_wheelhouse_asks_for_what_gpu_check_imports_and_not_for_what_a_gpu_host_has():
    wheelhouse = load_tool("wheelhouse")
    names = {wheelhouse.requirement_name(r) for r in wheelhouse.requirements()}
    for needed in ("ipyparallel", "ipykernel", "cloudpickle", "ipywidgets", "nbval", "pytest"):
        assert needed in names, names
    assert not names & {"torch", "numpy", "matplotlib"}, names
    assert not names & {"ruff", "mypy", "jupyterlab", "playwright"}, names  # make lint's, CI's
    assert "numpy" in {wheelhouse.requirement_name(r) for r in wheelhouse.requirements(())}


def test_the_wheelhouse_drops_what_the_target_has_and_finds_two_versions_of_one(tmp_path):
    wheelhouse = load_tool("wheelhouse")
    for name in (
        "numpy-2.5.2-cp312-cp312-manylinux_2_28_x86_64.whl",
        "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl",
        "typing_extensions-4.15.0-py3-none-any.whl",
        "typing_extensions-4.14.0-py3-none-any.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    removed = wheelhouse.prune(tmp_path, ("numpy",))
    assert [path.name for path in removed] == ["numpy-2.5.2-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert wheelhouse.twice(tmp_path) == ["typing-extensions"]
    assert wheelhouse.requirement_name("pytest-timeout>=2.3") == "pytest-timeout"
    assert wheelhouse.requirement_name("Jupyter_Client [test]") == "jupyter-client"


def test_the_quick_checks_limits_fit_ten_minutes_with_the_install_before_them():
    gpu_check = load_tool("gpu_check")
    limits = {name: limit for name, _, limit in gpu_check.STEPS}
    limits["benchmark"] = gpu_check.QUICK_BENCHMARK_S
    assert sum(limits.values()) <= 570, limits
    assert all("-x" not in argv for _, argv, _ in gpu_check.STEPS)
