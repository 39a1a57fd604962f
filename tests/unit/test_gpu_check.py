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


def parts(gpu_check):
    """Every part, those run side by side too, in order."""
    return [p for step in gpu_check.STEPS for p in (step if isinstance(step, list) else [step])]


def test_the_steps_run_in_the_issues_order_and_name_files_that_exist():
    gpu_check = load_tool("gpu_check")
    assert [name for name, _, _ in parts(gpu_check)] == [
        "env",
        "membership",
        "callbacks",
        "staging",
        "nvml",
        "cpu-gpu-cpu",
        "tests",
        "benchmark",
        "streams",
    ]
    risks = load_tool("gpu_risks")
    for name, argv, _ in parts(gpu_check):
        if argv[0] == gpu_check.RISKS:
            assert argv[1] in risks.PARTS, name
    for _, argv, _ in [*parts(gpu_check), gpu_check.COMPAT]:
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
    """Parts side by side take their longest limit."""
    gpu_check = load_tool("gpu_check")
    limits = {}
    for step in gpu_check.STEPS:
        group = step if isinstance(step, list) else [step]
        limits[group[0][0]] = max(limit for _, _, limit in group)
    limits["benchmark"] = gpu_check.QUICK_BENCHMARK_S
    assert sum(limits.values()) <= 1000, limits
    assert all("-x" not in argv for _, argv, _ in parts(gpu_check))


def test_the_benchmark_keeps_each_part_s_figures_when_a_later_part_fails(
    tmp_path, monkeypatch, capsys
):
    """benchmarks/cuda_rpc.py on a lent GPU: a part that fails (here nbrpc's, and the small
    CUDA calls) is named in cuda.json and the table, and the parts that ran keep their
    figures, written as each ended; the command's status says something failed."""
    import json

    from benchmarks import cuda_rpc

    figure = {"median": 0.001}
    raw = {
        "10 passes, cpu": figure,
        "10 passes, cuda": figure,
        "small call, builtin, CPU tensor": figure,
        "small call, builtin, CUDA tensor": figure,
    }

    def broken(*args):
        raise RuntimeError("the GPU cluster did not start")

    monkeypatch.setattr(cuda_rpc, "ROOT", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_rpc, "run_raw", lambda repeats: raw)
    monkeypatch.setattr(cuda_rpc, "run_nbrpc", broken)
    monkeypatch.setattr(
        cuda_rpc,
        "run_one_kernel",
        lambda repeats, transports="": {"a GPU cluster after it": "started"},
    )
    monkeypatch.setattr(cuda_rpc, "floor", lambda repeats: figure)
    monkeypatch.setattr(cuda_rpc, "run_nbrpc_cuda_small", broken)
    monkeypatch.setattr("sys.argv", ["cuda_rpc.py", "--quick"])
    assert cuda_rpc.main() == 1
    saved = json.loads((tmp_path / "benchmarks" / "results" / "cuda.json").read_text())
    assert saved["torch script"] == raw
    assert saved["floor"] == figure
    assert saved["one kernel"] == {"a GPU cluster after it": "started"}
    assert set(saved["failed"]) == {"nbrpc", "small CUDA calls"}
    assert "did not start" in saved["failed"]["nbrpc"]
    shown = capsys.readouterr().out
    assert "FAILED nbrpc: RuntimeError: the GPU cluster did not start" in shown
    assert "a GPU cluster after it: started" in shown
