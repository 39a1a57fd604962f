"""CUDA RPC: the tutorial's benchmark (seeds/004) and a CUDA tensor round trip, nbrpc
against a plain torch RPC script, measured in the same run.

    python benchmarks/cuda_rpc.py [--quick]      (make bench runs it when CUDA is there)

Two processes share this host's GPUs the way ``gpus="auto"`` places them: one GPU, both on
``cuda:0``; two or more, ``cuda:0`` and ``cuda:1`` as in the tutorial.

- torch: a two-process script (``mp.spawn``, a static group, ``set_device_map``) that
  imports no nbrpc: the baseline a user would otherwise write;
- nbrpc: ``nbrpc.init(n=1, gpus="auto")``, the kernel process and one worker.

Figures, each a median over repeats after a warm-up, in issue 47's order (items 1, 3, 4,
5, 2):
- the tutorial's 10 forward/backward passes through two ``Linear(1000, 1000)`` shards, the
  output staged through CPU memory ("cpu") and sent device to device ("cuda");
- a 64 MB CUDA tensor sent to the other process and back (device map both ways); its
  floor is one device-to-device copy of 64 MB in one process (``clone``);
- small calls, each the median of 400 ``rpc_sync`` calls after 50 warm-up calls: the
  builtin ``torch.add(t, 1)`` with ``t`` a 1-element CPU tensor, a small Python function
  (first), and the builtin with a CUDA tensor (last: the reply comes back on the
  caller's device), staged on a lane and, lanes paused, through TensorPipe's CUDA channel;
- one kernel (a fresh process): a CPU cluster on this host, its small calls, whether the
  kernel started CUDA, a GPU cluster after it (its small calls, on the transports the CPU
  first join chose), a CPU one again.

Prints a table and writes ``benchmarks/results/cuda.json`` as each part ends; a part that
fails is named there and in the table, the others keep their figures, and the exit status
is 1. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.peers import SeedShard, add_one, echo  # noqa: E402
from benchmarks.stats import stats, timed  # noqa: E402
from nbrpc._network import CUDA_TRANSPORTS  # noqa: E402

ECHO_MB = 64
ROWS = ("torch script", "nbrpc", "nbrpc, check=False")
SMALL_CALLS, SMALL_WARMUP = 400, 50


def devices() -> tuple[str, str]:
    """Where the two processes compute: (caller, callee)."""
    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def small_calls(rpc_sync, local: str | None) -> dict:
    """Each small call's seconds (median of :data:`SMALL_CALLS`), through ``rpc_sync``
    (torch's or nbrpc's) to worker1; ``local``: the caller's device for the CUDA row
    (None: only the CPU ones, issue 47's item 1; the CUDA one is its item 2)."""
    t = torch.ones(1)
    calls = {
        "small call, builtin, CPU tensor": (torch.add, (t, 1)),
        "small call, Python function": (add_one, (t,)),
    }
    if local is not None:
        calls = {"small call, builtin, CUDA tensor": (torch.add, (t.to(local), 1))}
    out = {}
    for label, (func, args) in calls.items():

        def call(func=func, args=args) -> None:
            rpc_sync("worker1", func, args=args)

        out[label] = stats(timed(call, SMALL_CALLS, SMALL_WARMUP))
    return out


def measure(
    remote,
    rpc_sync,
    backward,
    local: str,
    callee: str,
    repeats: int,
    small: bool = True,
    cuda_small: bool = True,
) -> dict:
    """In issue 47's order: (``small``) the CPU small calls, the tutorial's measure() for
    both modes, the echo, (``cuda_small``) the CUDA small call; ``remote``/``rpc_sync``/
    ``backward`` are torch's or nbrpc's (``backward(context_id, roots)``)."""
    import torch.distributed.autograd as dist_autograd  # nbrpc.autograd.context is this

    out = small_calls(rpc_sync, None) if small else {}
    for mode in ("cpu", "cuda"):
        lm = SeedShard(local, mode, 0)
        rm = remote("worker1", SeedShard, args=(callee, mode, 1))
        torch.manual_seed(2)
        x = torch.randn(1000, 1000).to(local)

        def ten_passes(lm=lm, rm=rm, x=x) -> None:
            for _ in range(10):
                with dist_autograd.context() as ctx:
                    y = rm.rpc_sync().forward(lm(x))
                    backward(ctx, [y.sum()])
            torch.cuda.synchronize(local)

        out[f"10 passes, {mode}"] = stats(timed(ten_passes, repeats))
    big = torch.randn(ECHO_MB * 1024 * 1024 // 4, device=local)

    def round_trip() -> None:
        back = rpc_sync("worker1", echo, args=(big,))
        assert back.device == big.device
        torch.cuda.synchronize(local)

    out[f"{ECHO_MB}MB round trip"] = stats(timed(round_trip, 4 * repeats))
    if cuda_small:
        out.update(small_calls(rpc_sync, local))
    return out


def _raw_process(rank: int, url: str, repeats: int, result: str) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    local, callee = devices()
    options = rpc.TensorPipeRpcBackendOptions(init_method=url)
    mine, theirs = (local, callee) if rank == 0 else (callee, local)
    options.set_device_map(f"worker{1 - rank}", {mine: theirs})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        figures = measure(rpc.remote, rpc.rpc_sync, dist_autograd.backward, local, callee, repeats)
        Path(result).write_text(json.dumps(figures))
    rpc.shutdown()


def _in_own_process(lines: str, timeout: float) -> dict:
    """Run ``lines`` (Python, with this repo importable; ``RESULT`` names the JSON file it
    writes, ``TMP`` a folder of its own) in a process of its own: what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        head = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nRESULT, TMP = {result!r}, {tmp!r}\n"
        subprocess.run([sys.executable, "-c", head + lines], check=True, timeout=timeout)
        return json.loads(Path(result).read_text())


def run_raw(repeats: int) -> dict:
    """The torch script, in processes of its own (nbrpc's hooks are process-wide)."""
    return _in_own_process(
        "import torch.multiprocessing as mp\n"
        "from benchmarks.cuda_rpc import _raw_process\n"
        "if __name__ == '__main__':\n"
        f"    mp.spawn(_raw_process, args=('file://' + TMP + '/store', {repeats}, RESULT), "
        "nprocs=2)\n",
        timeout=900,
    )


def run_nbrpc(repeats: int) -> dict:
    """nbrpc's calls, with its ``autograd.backward`` as a notebook calls it (first checking
    the graph for a pass that would hang: one more RPC round) and with ``check=False``."""
    import functools

    import nbrpc
    from nbrpc import autograd

    cluster = nbrpc.init(n=1, gpus="auto", progress=False)
    try:
        local = "cuda:0"
        callee = cluster.device_maps["worker0"]["worker1"][local]
        unchecked = functools.partial(autograd.backward, check=False)
        nb = nbrpc.remote, nbrpc.rpc_sync
        return {
            "nbrpc": measure(*nb, autograd.backward, local, callee, repeats, cuda_small=False),
            "nbrpc, check=False": measure(
                *nb, unchecked, local, callee, repeats, small=False, cuda_small=False
            ),
        }
    finally:
        nbrpc.shutdown()


#: issue 47's item 2 measures both ways a small CUDA tensor can travel
TENSORPIPE_CUDA = "small call, builtin, CUDA tensor, lanes paused (TensorPipe's CUDA channel)"


def run_nbrpc_cuda_small() -> dict:
    """Issue 47's item 2, last: the small call with a CUDA tensor, on a cluster like the
    first (this process's kernel joined with its maps): staged on a lane (the default),
    then with lanes paused, through TensorPipe's CUDA channel, in the same processes."""
    import nbrpc
    from nbrpc._wire import lanes

    nbrpc.init(n=1, gpus="auto", progress=False)
    try:
        out = small_calls(nbrpc.rpc_sync, "cuda:0")
        lanes.pause(True)
        try:
            (tensorpipe,) = small_calls(nbrpc.rpc_sync, "cuda:0").values()
        finally:
            lanes.pause(False)
        out[TENSORPIPE_CUDA] = tensorpipe
        return out
    finally:
        nbrpc.shutdown()


def one_kernel(repeats: int = 3) -> dict:
    """Issue 47's item 5, in a kernel of its own (what its first join fixes is the point):
    a CPU cluster on this host and its small calls, the kernel's CPU seconds over 2 idle
    seconds, whether the kernel started CUDA, a GPU cluster after it (how long it took to
    start or be refused, and in which words; its small calls, the CUDA one included, the
    tutorial and the round trip: issue 63's "after a CPU first cluster"), a CPU cluster
    again and its small calls."""
    import time

    import nbrpc
    from nbrpc import autograd

    def calls(cluster: str, local: str | None = None) -> None:
        for figure, value in small_calls(nbrpc.rpc_sync, None).items():
            out[f"{figure} [{cluster}]"] = value
        if local is not None:
            for figure, value in small_calls(nbrpc.rpc_sync, local).items():
                out[f"{figure} [{cluster}]"] = value

    out: dict = {}
    nbrpc.init(n=1, progress=False)
    calls("CPU cluster")
    idle = time.process_time()
    time.sleep(2.0)
    out["kernel CPU s over 2 idle s, CPU cluster"] = round(time.process_time() - idle, 3)
    out["CUDA started in the kernel"] = torch.cuda.is_initialized()
    nbrpc.shutdown()
    t0 = time.monotonic()
    try:
        nbrpc.init(n=1, gpus="auto", progress=False)
    except Exception as exc:
        out["a GPU cluster after it"] = f"{type(exc).__name__}: {exc}"
        out["answered in s"] = time.monotonic() - t0
    else:
        out["a GPU cluster after it"] = "started"
        out["answered in s"] = time.monotonic() - t0
        try:
            calls("GPU cluster after a CPU one", devices()[0])
            local = devices()[0]
            callee = nbrpc.current().device_maps["worker0"]["worker1"][local]
            after = measure(
                nbrpc.remote, nbrpc.rpc_sync, autograd.backward, local, callee, repeats,
                small=False, cuda_small=False,
            )  # fmt: skip
            for figure, value in after.items():
                out[f"{figure} [GPU cluster after a CPU one]"] = value
        finally:
            nbrpc.shutdown()
    nbrpc.init(n=2, progress=False)
    out["a CPU cluster again"] = nbrpc.workers()[1:]
    try:
        calls("CPU cluster again")
    finally:
        nbrpc.shutdown()
    return out


def run_one_kernel(repeats: int, transports: str = "") -> dict:
    """:func:`one_kernel` in a process of its own (``transports``: the kernel's, through
    ``NBRPC_TENSORPIPE_TRANSPORTS``; empty: nbrpc's choice)."""
    return _in_own_process(
        (
            f"import os\nos.environ['NBRPC_TENSORPIPE_TRANSPORTS'] = {transports!r}\n"
            if transports
            else ""
        )
        + "import json\nfrom benchmarks.cuda_rpc import one_kernel\n"
        f"open(RESULT, 'w').write(json.dumps(one_kernel({repeats})))\n",
        timeout=150,  # within gpu_check's limit for the whole benchmark
    )


def floor(repeats: int) -> dict:
    big = torch.randn(ECHO_MB * 1024 * 1024 // 4, device="cuda:0")

    def copy() -> None:
        big.clone()
        torch.cuda.synchronize("cuda:0")

    return stats(timed(copy, 4 * repeats))


def report(results: dict) -> None:
    """The table, from whatever parts finished (a part that failed is named instead)."""
    print(
        f"\nCUDA RPC on {results['gpu']} (torch {results['torch']}): caller "
        f"{results['devices'][0]}, callee {results['devices'][1]}; medians, ratio to torch"
    )
    for part, why in results.get("failed", {}).items():
        print(f"FAILED {part}: {why}")
    raw = results.get("torch script")
    if raw is None:
        return  # nothing to compare with
    for figure in raw:
        unit, scale = ("s", 1) if figure.startswith("10") else ("ms", 1e3)
        if figure.startswith("small"):
            unit, scale = ("µs", 1e6)
        print(f"{figure}:")
        for name in ROWS:
            if figure not in results.get(name, {}):
                continue
            value = results[name][figure]["median"]
            ratio = value / raw[figure]["median"]
            print(f"  {name:<22}{value * scale:>9.3f} {unit:<3}{ratio:>6.2f}x")
    if TENSORPIPE_CUDA in results.get("nbrpc", {}):
        value = results["nbrpc"][TENSORPIPE_CUDA]["median"]
        script = raw["small call, builtin, CUDA tensor"]["median"]
        print(f"{TENSORPIPE_CUDA}:\n  {'nbrpc':<22}{value * 1e6:>9.3f} µs {value / script:>6.2f}x")
    for name in ROWS:
        if name not in results:
            continue
        row = results[name]
        speedup = row["10 passes, cpu"]["median"] / row["10 passes, cuda"]["median"]
        print(f"device map against CPU staging, {name}: {speedup:.1f}x faster")
    if "floor" in results:
        copy = results["floor"]["median"] * 1e3
        print(f"floor: a {ECHO_MB} MB device-to-device copy in one process, {copy:.3f} ms")
    for part in ("one kernel", "one kernel, shm"):
        one = results.get(part, {})
        if one:
            print(f"{part}, a CPU cluster first (a fresh process):")
        for key, value in one.items():
            if isinstance(value, dict):  # "FIGURE [CLUSTER]", against the script's
                script = raw[key.split(" [")[0]]["median"]
                ratio = value["median"] / script
                print(f"  {key:<64}{value['median'] * 1e6:>12.1f} µs {ratio:>6.2f}x")
            else:
                print(f"  {key}: {value}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA benchmark skipped: torch.cuda.is_available() is False on this machine")
        return 0
    repeats = 3 if args.quick else 10
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "devices": devices(),
        "failed": {},
    }
    # issue 47's order (1, 3, 4, then 5, then 2); each part's figures are written as it
    # ends, and a part that fails is named, so a late failure or a step's time limit on a
    # lent GPU loses no figure already measured
    parts = (
        ("torch script", lambda: {"torch script": run_raw(repeats)}),
        ("nbrpc", lambda: run_nbrpc(repeats)),  # items 1, 3, 4
        ("one kernel", lambda: {"one kernel": run_one_kernel(repeats)}),  # 5
        (
            "one kernel, shm",  # issue 63's risk 3: the CUDA transports at a CPU first join
            lambda: {"one kernel, shm": run_one_kernel(repeats, ",".join(CUDA_TRANSPORTS))},
        ),
        ("floor", lambda: {"floor": floor(repeats)}),
        (
            "small CUDA calls",
            lambda: {"nbrpc": {**results.get("nbrpc", {}), **run_nbrpc_cuda_small()}},
        ),  # 2
    )
    for name, part in parts:
        try:
            results.update(part())
        except Exception as exc:
            traceback.print_exc()
            results["failed"][name] = f"{type(exc).__name__}: {exc}"
        (out / "cuda.json").write_text(json.dumps(results, indent=2))
    report(results)
    print(f"wrote {out / 'cuda.json'}")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
