"""The checks that need a GPU, in one command, each under a time limit of its own.

    python tools/gpu_check.py [--out DIR] [--compat] [--quick] [--rehearse]

Runs, with this interpreter and its torch (a CUDA build), from the repository's root, in
issue 47's order:

1. ``tests/test_devices.py`` and ``tests/test_torch_seam.py``: the CUDA paths (lanes on a
   GPU cluster, replies from every process to every other, maps by hand, refusals);
2. ``benchmarks/cuda_rpc.py``: its figures against the plain torch script, measured in
   the same run (``--quick``: fewer repeats);
3. the CUDA-RPC notebook (``notebooks/07_cuda_rpc_benchmark.ipynb``) under nbval;
4. with ``--compat``: torch's CUDA test classes that apply on this machine's GPUs
   (docs/compatibility.md).

Each step's output goes to ``DIR/<step>.log`` (default: a new temporary directory); a
summary (one line per step: how it ended, its seconds, its last result line) is printed
and written to ``DIR/summary.txt``, and the benchmark's figures are copied to
``DIR/cuda.json``. A step that runs past its limit is ended, and the next
one runs. Without CUDA it says so and exits 0, as the benchmark does; with ``--rehearse``
it runs the steps anyway (their CUDA parts skip, saying why), which shows, before any time
on a GPU host is spent, whether this interpreter has what they import and launch: the
wheels ``tools/wheelhouse.py`` gathers for a host with no package index, installed the way
it prints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: pytest's plugins, named: the ones a GPU host's image installs (other versions, built for
#: its own pytest) are not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``)
PLUGINS = ("-p", "pytest_timeout", "-p", "nbval.plugin")
#: (name, argv after the interpreter, seconds), in the order they run. With ``--quick`` the
#: limits add up to 9.5 min (:data:`QUICK_BENCHMARK_S` for the benchmark): a GPU host lent
#: for 10 minutes at a time runs them all, and the wheels' install before them, in one go.
#: No ``-x``: one failure does not hide what the other tests would have shown.
STEPS: list[tuple[str, list[str], int]] = [
    (
        "tests",
        # -v: the name of a test is in the log before it runs (one ended at the limit is named)
        [
            "-m",
            "pytest",
            *PLUGINS,
            "tests/test_devices.py",
            "tests/test_torch_seam.py",
            "-v",
            "-rs",
        ],
        300,
    ),
    ("benchmark", ["benchmarks/cuda_rpc.py"], 360),
    (
        "notebook",
        ["-m", "pytest", *PLUGINS, "--nbval-lax", "notebooks/07_cuda_rpc_benchmark.ipynb", "-q"],
        90,
    ),
]
QUICK_BENCHMARK_S = 180
#: the benchmark's figures, copied beside the logs
RESULTS = ROOT / "benchmarks" / "results" / "cuda.json"
COMPAT = (
    "compat",
    [
        "tools/compat.py",
        "--classes",
        "CudaDistAutogradTest,CudaRemoteModuleTest,CudaDdpComparisonTest,"
        "TensorPipeAgentCudaRpcTest",
    ],
    540,
)


def run_step(name: str, argv: list[str], limit: int, out: Path) -> str:
    """One step, its output in ``out/NAME.log``; its summary line."""
    log = out / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            start_new_session=True,  # its workers too, when it runs past its limit
        )
        try:
            code = proc.wait(timeout=limit)
            how = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            how = f"ended at its limit ({limit} s)"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    last = next((line.strip("= ") for line in reversed(lines) if line), "")
    return f"{name}: {how} in {time.monotonic() - t0:.0f} s; {last[:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the logs go (default: a new temporary folder)")
    parser.add_argument("--compat", action="store_true", help="torch's CUDA test classes too")
    parser.add_argument("--quick", action="store_true", help="the benchmark's fewer repeats")
    parser.add_argument(
        "--rehearse", action="store_true", help="run the steps without CUDA too (they skip it)"
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.rehearse:
        print(f"no CUDA device (torch {torch.__version__}): nothing to check here")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="nbrpc-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    head = (
        f"{gpu} x{torch.cuda.device_count()}, torch "
        f"{torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} cores"
    )
    print(head, flush=True)
    steps = [*STEPS, COMPAT] if args.compat else list(STEPS)
    summary = [head]
    for name, step_argv, limit in steps:
        if name == "benchmark" and args.quick:
            step_argv, limit = [*step_argv, "--quick"], QUICK_BENCHMARK_S
        started = time.time()
        summary.append(run_step(name, step_argv, limit, out))
        print(summary[-1], flush=True)
        if name == "benchmark" and RESULTS.exists() and RESULTS.stat().st_mtime >= started:
            shutil.copy(RESULTS, out / RESULTS.name)  # this run's, beside the logs
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print(f"logs in {out}")
    return 0 if all(": passed" in line for line in summary[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
