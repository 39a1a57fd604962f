"""nbrpc against raw torch RPC, measured in the same run, interleaved.

    python benchmarks/run.py [--quick]

Figures (medians and p90 over repeats):
- boot: ``nbrpc.init(n=2)`` until the first call returns (3 boots, each shut down after).
- small call: round trip of a 1-element tensor; nbrpc with a notebook-defined function vs
  ``torch.distributed.rpc.rpc_sync`` with an importable one.
- 64 MB: round trip of a 64 MB float32 tensor, the same two peers.
- bare torch: the same calls between two bare processes with no nbrpc at all
  (``raw_torch.py``, run first as a subprocess: nbrpc's hooks are process-wide).
Ratios are nbrpc / torch (1.00 = as fast as torch itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

import nbrpc  # noqa: E402
from benchmarks.peers import Shard, echo  # noqa: E402


def notebook_echo():
    """An echo defined the way a notebook cell defines it (``__main__``, not importable)."""
    namespace = {"__name__": "__main__"}
    exec("def echo(x):\n    return x\n", namespace)
    return namespace["echo"]


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "n": len(ordered),
    }


def interleaved(calls: dict, repeats: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: stats(samples) for name, samples in times.items()}


def bench_boot(boots: int) -> dict:
    samples = []
    for _ in range(boots):
        t0 = time.perf_counter()
        nbrpc.init(n=2, progress=False)
        nbrpc.rpc_sync("worker1", min, args=(1, 2))
        samples.append(time.perf_counter() - t0)
        nbrpc.shutdown()
    return stats(samples)


def bench_model_split(steps: int) -> dict:
    """One forward+backward+optimizer step of 04's model: split over 3 processes vs one."""
    from nbrpc.optim import DistributedOptimizer

    x, target = torch.randn(64, 512), torch.randn(64, 16)
    shard1 = Shard(1, 512, 1024)
    shard2 = nbrpc.remote("worker1", Shard, args=(2, 1024, 1024))
    shard3 = nbrpc.remote("worker2", Shard, args=(3, 1024, 16))
    params = [rpc.RRef(p) for p in shard1.parameters()]
    params += shard2.rpc_sync().param_rrefs() + shard3.rpc_sync().param_rrefs()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)

    def split_step():
        with nbrpc.autograd.context() as ctx:
            out = shard3.rpc_sync().forward(shard2.rpc_sync().forward(shard1(x)))
            loss = torch.nn.functional.mse_loss(out, target)
            nbrpc.autograd.backward(ctx, [loss], check=False)
            opt.step(ctx)

    local = torch.nn.Sequential(Shard(1, 512, 1024), Shard(2, 1024, 1024), Shard(3, 1024, 16))
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01)

    def local_step():
        local_opt.zero_grad()
        torch.nn.functional.mse_loss(local(x), target).backward()
        local_opt.step()

    for _ in range(3):
        split_step()
        local_step()
    return interleaved({"split over 3 processes": split_step, "one process": local_step}, steps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    small_n, big_n, boots = (200, 5, 1) if args.quick else (2000, 20, 3)

    bare = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "raw_torch.py"), str(small_n), str(big_n)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    raw = json.loads(bare.stdout.strip().splitlines()[-1])
    results: dict = {"boot_s": bench_boot(boots), "bare_torch": raw}
    nbrpc.init(n=2, progress=False)
    nb_echo = notebook_echo()
    tiny = torch.ones(1)
    big = torch.randn(16 * 1024 * 1024)  # 64 MB float32
    for _ in range(20):  # warm up pipes and caches
        nbrpc.rpc_sync("worker1", nb_echo, args=(tiny,))
        rpc.rpc_sync("worker1", echo, args=(tiny,))
    results["small_call_s"] = interleaved(
        {
            "nbrpc, notebook-defined": lambda: nbrpc.rpc_sync("worker1", nb_echo, args=(tiny,)),
            "torch rpc, importable": lambda: rpc.rpc_sync("worker1", echo, args=(tiny,)),
        },
        small_n,
    )
    results["64MB_round_trip_s"] = interleaved(
        {
            "nbrpc, notebook-defined": lambda: nbrpc.rpc_sync("worker1", nb_echo, args=(big,)),
            "torch rpc, importable": lambda: rpc.rpc_sync("worker1", echo, args=(big,)),
        },
        big_n,
    )
    results["model_split_step_s"] = bench_model_split(10 if args.quick else 50)
    nbrpc.shutdown()

    results["small_call_s"]["torch rpc, bare processes"] = raw["small"]
    results["small_call_s"]["torch rpc builtin, bare"] = raw["builtin"]
    results["64MB_round_trip_s"]["torch rpc, bare processes"] = raw["large"]
    boot = results["boot_s"]
    print(
        f"boot of nbrpc.init(n=2) to first call: median {boot['median']:.2f} s "
        f"(p90 {boot['p90']:.2f} s, n={boot['n']})"
    )
    for key, unit, scale in (("small_call_s", "us", 1e6), ("64MB_round_trip_s", "ms", 1e3)):
        rows = results[key]
        ours, base = rows["nbrpc, notebook-defined"], rows["torch rpc, importable"]
        print(f"{key}:")
        for name, row in rows.items():
            print(
                f"  {name:<26} median {row['median'] * scale:8.1f} {unit}   "
                f"p90 {row['p90'] * scale:8.1f} {unit}   n={row['n']}"
            )
        bare_row = rows["torch rpc, bare processes"]
        print(
            f"  ratio nbrpc / torch in the same processes (median): "
            f"{ours['median'] / base['median']:.2f}"
        )
        print(
            f"  ratio nbrpc / torch in bare processes (median):     "
            f"{ours['median'] / bare_row['median']:.2f}"
        )
    split = results["model_split_step_s"]
    print("04's model, one forward+backward+SGD step (64x512 -> 1024 -> 1024 -> 16, float32):")
    for name, row in split.items():
        print(
            f"  {name:<26} median {row['median'] * 1e3:8.2f} ms   "
            f"p90 {row['p90'] * 1e3:8.2f} ms   n={row['n']}"
        )
    ratio = split["split over 3 processes"]["median"] / split["one process"]["median"]
    print(f"  ratio split / one process (median): {ratio:.2f}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
