"""The checks that need a GPU, in one command, each under a time limit of its own.

    python tools/gpu_check.py [--out DIR] [--compat] [--quick] [--rehearse]

Runs, with this interpreter and its torch (a CUDA build), from the repository's root, in
issue 63's order, each part in a fresh process:

1. ``env``: the GPUs (UUIDs, MIG), ``/dev/shm``, cores, torch (``tools/gpu_risks.py``);
2. the risks: membership changes under GPU traffic, ``then`` callbacks and streams,
   staging order, a host whose NVML lists no GPU (``tools/gpu_risks.py``; these four run
   side by side, each in its own process under its own limit);
3. ``cpu-gpu-cpu``: CPU, GPU, CPU clusters in one kernel (``tests/test_devices.py``'s);
4. ``tests``: the rest of ``tests/test_devices.py``, the CUDA paths;
5. ``benchmark``: ``benchmarks/cuda_rpc.py``, the plain torch script's rows and nbrpc's
   (``--quick``: fewer repeats);
6. ``streams``: the default stream on lanes (``tools/gpu_risks.py``);
7. with ``--compat``: torch's CUDA test classes that apply on this machine's GPUs
   (docs/compatibility.md).

Each part's output goes to ``DIR/logs/<part>.log``; ``DIR/gpu.log`` holds them all, one
after the other, ``DIR/gpu.json`` every figure (each risk's ``FIGURES`` line, the
benchmark's ``cuda.json``), and ``DIR/summary.txt`` one line per part (how it ended, its
seconds, its last line). All three are rewritten as each part ends, so a command ended at
its limit keeps what was measured. A part that runs past its limit is ended, and the
next one runs. Without CUDA it says so and exits 0, as the benchmark does; with
``--rehearse`` it runs the parts anyway (their CUDA parts skip, saying why), which shows,
before any time on a GPU host is spent, whether this interpreter has what they import and
launch: the wheels ``tools/wheelhouse.py`` gathers for a host with no package index,
installed the way it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: pytest's plugins, named: the ones a GPU host's image installs (other versions, built for
#: its own pytest) are not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``)
PLUGINS = ("-p", "pytest_timeout")
RISKS = "tools/gpu_risks.py"
ONE_KERNEL = "one_kernel_goes_from_a_cpu_cluster"
#: a part: (name, argv after the interpreter, seconds)
Part = tuple[str, list[str], int]


def pytest(*args: str) -> list[str]:
    # -v: the name of a test is in the log before it runs (one ended at the limit is named)
    return ["-m", "pytest", *PLUGINS, "tests/test_devices.py", "-v", "-rs", *args]


#: the parts in the order they run; a list inside runs side by side. No ``-x``: one
#: failure does not hide what the other tests would have shown.
STEPS: list[Part | list[Part]] = [
    ("env", [RISKS, "env"], 60),
    [
        ("membership", [RISKS, "membership"], 150),
        ("callbacks", [RISKS, "callbacks"], 120),
        ("staging", [RISKS, "staging"], 120),
        ("nvml", [RISKS, "nvml"], 150),
    ],
    ("cpu-gpu-cpu", pytest("-k", ONE_KERNEL), 150),
    ("tests", pytest("-k", f"not {ONE_KERNEL}"), 240),
    ("benchmark", ["benchmarks/cuda_rpc.py"], 360),
    ("streams", [RISKS, "streams"], 90),
]
QUICK_BENCHMARK_S = 300
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


def figures_of(log: Path) -> dict:
    """The ``FIGURES {json}`` line a risk printed last, if any."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("FIGURES "):
            try:
                return json.loads(line[len("FIGURES ") :])
            except ValueError:
                return {"unreadable": line[:200]}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the logs go (default: a new temporary folder)")
    parser.add_argument("--compat", action="store_true", help="torch's CUDA test classes too")
    parser.add_argument("--quick", action="store_true", help="the benchmark's fewer repeats")
    parser.add_argument("--only", help="these parts alone, by name, comma-separated")
    parser.add_argument(
        "--rehearse", action="store_true", help="run the steps without CUDA too (they skip it)"
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.rehearse:
        print(f"no CUDA device (torch {torch.__version__}): nothing to check here")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="nbrpc-gpu-"))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    head = (
        f"{gpu} x{torch.cuda.device_count()}, torch "
        f"{torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} cores"
    )
    print(head, flush=True)
    only = set(args.only.split(",")) if args.only else None
    steps = [*STEPS, COMPAT] if args.compat else list(STEPS)
    summary = [head]
    figures: dict = {"machine": head}
    done: list[str] = []
    for step in steps:
        group = step if isinstance(step, list) else [step]
        group = [p for p in group if only is None or p[0] in only]
        if not group:
            continue
        started = time.time()
        group = [
            (n, [*a, "--quick"], QUICK_BENCHMARK_S)
            if n == "benchmark" and args.quick
            else (n, a, s)
            for n, a, s in group
        ]
        with ThreadPoolExecutor(len(group)) as pool:
            lines = list(pool.map(lambda p: run_step(*p, logs), group))
        for (name, _, _), line in zip(group, lines, strict=True):
            summary.append(line)
            done.append(name)
            print(line, flush=True)
            figures[name] = figures_of(logs / f"{name}.log")
        benchmark = any(n == "benchmark" for n, _, _ in group)
        if benchmark and RESULTS.exists() and RESULTS.stat().st_mtime >= started:
            shutil.copy(RESULTS, logs / RESULTS.name)  # this run's, beside the logs
            figures["benchmark"] = json.loads(RESULTS.read_text())
        (out / "summary.txt").write_text("\n".join(summary) + "\n")
        (out / "gpu.json").write_text(json.dumps(figures, indent=1, default=str))
        with open(out / "gpu.log", "w") as f:
            for name in done:
                f.write(
                    f"\n===== {name} =====\n" + (logs / f"{name}.log").read_text(errors="replace")
                )
    print(f"logs in {out}")
    return 0 if all(": passed" in line for line in summary[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
