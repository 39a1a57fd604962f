"""Every tensor size, against the plain torch script a user would otherwise write.

    python benchmarks/sizes.py [--quick]        (make bench-sizes; make bench runs it too)

A CPU float32 tensor of each size in :data:`SIZES` goes to ``operator.pos`` on a worker
and back (one round trip: the argument one way, the reply the other):

- **plain script**: two bare processes, ``torch.distributed.rpc`` with TensorPipe, no
  nbrpc imported (the script of ``mp.spawn`` tutorials), measured before and after the
  nbrpc rows of the same run, its samples together;
- **nbrpc, torch's spelling**: ``torch.distributed.rpc.rpc_sync`` in a process where
  nbrpc runs (``nbrpc.init(n=1)``: nbrpc routes torch's names to its own calls);
- **nbrpc, a notebook function**: ``nbrpc.rpc_sync`` of an ``echo`` defined in
  ``__main__``, as a cell defines it (sent by value);
- **torch, same processes**: torch's own ``rpc_sync`` from the same kernel process, the
  baseline ``benchmarks/run.py`` used before (slower than the plain script: this process
  runs nbrpc's threads too).

Ratios are against the plain script; the route column says how nbrpc's call went (the
timeline's route and its tensors' path). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (label, bytes, repeats): 1 KB to 256 MB
SIZES = (
    ("1 KB", 1 << 10, 200),
    ("16 KB", 16 << 10, 200),
    ("64 KB", 64 << 10, 200),
    ("256 KB", 256 << 10, 150),
    ("1 MB", 1 << 20, 100),
    ("4 MB", 4 << 20, 40),
    ("16 MB", 16 << 20, 15),
    ("64 MB", 64 << 20, 6),
    ("256 MB", 256 << 20, 3),
)

PLAIN_WORKER = """
import sys, torch.distributed.rpc as rpc
rpc.init_rpc("worker1", rank=1, world_size=2,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=sys.argv[1]))
rpc.shutdown()
"""


def plain_script(sizes: list[tuple[str, int, int]]) -> dict[str, list[float]]:
    """The plain script's round trips by size, in processes of its own (run as
    ``python sizes.py --plain LABEL:BYTES:REPEATS ...``)."""
    out = subprocess.run(
        [sys.executable, __file__, "--plain", *[f"{lb}:{nb}:{n}" for lb, nb, n in sizes]],
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _plain_main(specs: list[str]) -> int:
    import torch
    import torch.distributed.rpc as rpc

    sys.path.insert(0, str(ROOT))
    from benchmarks.stats import timed

    url = f"file://{tempfile.mkdtemp()}/store"
    worker = subprocess.Popen([sys.executable, "-c", PLAIN_WORKER, url])
    rpc.init_rpc(
        "worker0",
        rank=0,
        world_size=2,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=url),
    )
    samples = {}
    for spec in specs:
        label, nbytes, repeats = spec.rsplit(":", 2)
        t = torch.randn(int(nbytes) // 4)
        samples[label] = timed(
            lambda t=t: rpc.rpc_sync("worker1", operator.pos, args=(t,)), int(repeats), 3
        )
    rpc.shutdown()
    worker.wait(timeout=60)
    print(json.dumps(samples))
    return 0


def measure(quick: bool = False) -> dict:
    """Every size: the plain script (before and after) and nbrpc's rows, as medians."""
    import torch
    import torch.distributed.rpc as rpc

    sys.path.insert(0, str(ROOT))
    import nbrpc
    from benchmarks.run import TORCH_SYNC, notebook_echo, route_of
    from benchmarks.stats import stats, timed

    sizes = [(lb, nb, max(3, n // 4) if quick else n) for lb, nb, n in SIZES]
    before = plain_script(sizes)
    nbrpc.init(n=1, progress=False)
    echo = notebook_echo()
    rows: dict[str, dict] = {}
    for label, nbytes, repeats in sizes:
        t = torch.randn(nbytes // 4)
        peers = {
            "nbrpc, torch's spelling": lambda t=t: rpc.rpc_sync("worker1", operator.pos, (t,)),
            "nbrpc, a notebook function": lambda t=t: nbrpc.rpc_sync("worker1", echo, (t,)),
            "torch, same processes": lambda t=t: TORCH_SYNC("worker1", operator.pos, (t,)),
        }
        times: dict[str, list[float]] = {name: [] for name in peers}
        for call in peers.values():  # warm
            timed(call, 0, 3)
        for _ in range(repeats):  # interleaved, one call each per round
            for name, call in peers.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        rows[label] = {name: stats(v) for name, v in times.items()}
        for name in ("nbrpc, torch's spelling", "nbrpc, a notebook function"):
            rows[label][name]["route"] = route_of(peers[name])
        del t
    nbrpc.shutdown()
    after = plain_script(sizes)
    for label, _, _ in sizes:
        rows[label]["plain script"] = stats(before[label] + after[label])
    return {"sizes": rows, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}


def report(results: dict) -> None:
    """The table: each size's plain script, and nbrpc's rows as ratios of it."""
    names = ("nbrpc, torch's spelling", "nbrpc, a notebook function", "torch, same processes")
    print(
        "tensor round trip   plain script   torch's spelling   notebook function"
        "   torch, same processes   route (nbrpc)"
    )
    worst = 0.0
    for label, rows in results["sizes"].items():
        base = rows["plain script"]["median"]
        ratios = [rows[name]["median"] / base for name in names]
        worst = max(worst, *ratios[:2])
        print(
            f"  {label:<16}{base * 1e3:9.3f} ms   {ratios[0]:14.2f}x   {ratios[1]:15.2f}x"
            f"   {ratios[2]:19.2f}x   {rows[names[1]].get('route', '')}"
        )
    print(f"  nbrpc's slowest size: {worst:.2f}x the plain script (goal: at most 1.0x)")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        return _plain_main(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    results = measure(args.quick)
    report(results)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "sizes.json").write_text(json.dumps(results, indent=2))
    medians = {k: {n: r["median"] for n, r in v.items()} for k, v in results["sizes"].items()}
    print(json.dumps(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
