"""nbrpc against its baselines, measured in the same run, interleaved.

    python benchmarks/run.py [--quick]      (make bench)

Figures (medians and p90 over interleaved repeats):
- small call: round trip of a 1-element tensor, in blocks of 20 calls per peer. nbrpc
  with a notebook-defined function, on its lane (the default) and through TensorPipe
  (lanes paused in the kernel: the route ``--no-fast-calls`` takes); torch RPC with an
  importable function and with a builtin (``torch.add``), in the same processes;
  ipyparallel ``apply_sync`` to the same engine; the floor, a pipe ping-pong between two
  processes; torch RPC between bare processes (``raw_torch.py``). Rows name their route.
  The row with the importable ``echo`` (the function torch's rows call) shows what
  sending a notebook function by value costs.
- 1000 concurrent small calls: ``rpc_async`` 1000 times to one worker, then wait for all;
  nbrpc on its lane and through TensorPipe, torch RPC in the same processes.
- idle CPU: what the cluster's 3 processes use together, idle for 5 s, lanes open.
- CPU per small call (``lane_cpu.py``): the kernel's main thread and process, the worker's
  lane thread and process, for nbrpc on its lane and torch RPC; and a lane call's steps,
  each timed alone on the side that runs it.
- every size from 1 KB to 256 MB against the plain torch script (``sizes.py``, its own
  table).
- tensor round trips of 4, 64 and 256 MB float32: nbrpc (its shared-memory fast path on,
  the default) and nbrpc with TensorPipe only, torch RPC, ipyparallel, bare torch; the
  floor is one in-process copy (``clone``) of that size. The fast path is switched per
  call in every process, so the torch RPC row is torch's own transport.
- boot to a call answered by each of 2 workers, in fresh processes (``boot.py``): nbrpc's
  first boot and its re-run, against a plain torch script (``mp.spawn``) and
  ipyparallel's default start.
- 04's model split over 3 processes against the same model in one process.
- CUDA RPC, when there is a CUDA device (``cuda_rpc.py``, its own table; otherwise a line
  saying why not): the CUDA-RPC tutorial's benchmark and a 64 MB CUDA round trip, against
  a plain torch script.
- Ray, when it is installed (``pip install -e '.[ray]'``; otherwise skipped with a line
  saying so): a tiny actor call, 64 MB as a torch tensor and as a numpy array, and boot to
  a call answered by each of 2 actors (``ray_peer.py``, in its own processes).
Ratios are against torch RPC in the same processes (the baseline a user would otherwise
write). Results: ``benchmarks/results/latest.json`` and the plot ``docs/benchmarks.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

import nbrpc  # noqa: E402
from benchmarks import lane_cpu  # noqa: E402
from benchmarks.peers import Shard, echo  # noqa: E402
from benchmarks.stats import stats  # noqa: E402
from nbrpc import _torch  # noqa: E402
from nbrpc._wire import lanes, recording, shm  # noqa: E402

#: torch's own rpc_sync / rpc_async: nbrpc routes ``torch.distributed.rpc.rpc_sync`` & co.
#: to its own calls in every process it runs in, so the baseline calls torch's originals
TORCH_SYNC, TORCH_ASYNC = _torch.rpc_sync, _torch.rpc_async

SIZES_MB = (4, 64, 256)


def notebook_echo():
    """An echo defined the way a notebook cell defines it (``__main__``, not importable)."""
    namespace = {"__name__": "__main__"}
    exec("def echo(x):\n    return x\n", namespace)
    return namespace["echo"]


def interleaved(
    calls: dict, repeats: int, modes: dict | None = None, switch=None, block: int = 1
) -> dict:
    """Every peer once per round, in a fresh random order each round: no peer always runs
    right after a noisy one (an ipyparallel apply leaves its engine busy for a moment).
    ``block``: calls per peer in a row within a round (a loop of calls in a notebook runs
    back to back; one call right after another peer's pays for that peer's leftovers).
    ``modes``: the mode a peer runs in (others: None), set by ``switch(mode)`` outside the
    timed call when it changes."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    shuffle = random.Random(0).shuffle
    modes = modes or {}
    mode = None
    for _ in range(max(repeats // block, 1)):
        shuffle(order)
        for name, call in order:
            if modes.get(name) != mode:
                mode = modes.get(name)
                switch(mode)
            for _ in range(block):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    return {name: stats(samples) for name, samples in times.items()}


def _pipe_echo(conn) -> None:
    while True:
        msg = conn.recv_bytes()
        if not msg:
            return
        conn.send_bytes(msg)


def floor_small(n: int) -> dict:
    """The physical floor of a round trip here: a pipe ping-pong between two processes."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(child,), daemon=True)
    proc.start()
    payload = b"x" * 64
    samples = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        parent.send_bytes(payload)
        parent.recv_bytes()
        if i >= 100:
            samples.append(time.perf_counter() - t0)
    parent.send_bytes(b"")
    proc.join(5)
    return stats(samples)


def bench_boot(rounds: int) -> dict:
    """Boot to first calls, each peer in fresh processes (``benchmarks/boot.py``)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "boot.py"), str(rounds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def bench_calls(small_n: int, big_n: dict[int, int]) -> dict:
    """Small calls and tensor round trips, every peer interleaved, on one running cluster."""
    cluster = nbrpc.current()
    engine = cluster.engines.client[cluster.records[1].engine_id]  # worker1's ipyparallel engine
    nb_echo = notebook_echo()
    tiny = torch.ones(1)
    for _ in range(50):  # warm up pipes and caches
        nbrpc.rpc_sync("worker1", nb_echo, args=(tiny,))
        TORCH_SYNC("worker1", echo, args=(tiny,))
        engine.apply_sync(echo, tiny)

    def recording_on(mode: str | None) -> None:  # what nbrpc.record() turns on, in both
        switch = recording.start if mode == "recording" else recording.stop
        switch("bench")
        rpc.rpc_sync("worker1", switch, args=("bench",))

    small_nbrpc = lambda: nbrpc.rpc_sync("worker1", nb_echo, args=(tiny,))  # noqa: E731
    modes = {
        "nbrpc, recording a timeline": "recording",
        "nbrpc, TensorPipe only": "tensorpipe",
    }

    def switch(mode: str | None) -> None:
        recording_on(mode)
        lanes.pause(mode == "tensorpipe")

    results = {
        "small": interleaved(
            {
                "nbrpc": small_nbrpc,
                "nbrpc, importable function": lambda: nbrpc.rpc_sync("worker1", echo, (tiny,)),
                "nbrpc, recording a timeline": small_nbrpc,
                "nbrpc, TensorPipe only": small_nbrpc,
                "torch rpc": lambda: TORCH_SYNC("worker1", echo, args=(tiny,)),
                "torch rpc builtin": lambda: TORCH_SYNC("worker1", torch.add, args=(tiny, 0)),
                "ipyparallel apply": lambda: engine.apply_sync(echo, tiny),
            },
            small_n,
            modes=modes,
            switch=switch,
            block=20,
        )
    }
    for mode in (None, "tensorpipe"):
        switch(mode)
        name = "nbrpc, TensorPipe only" if mode else "nbrpc"
        results["small"][name]["route"] = route_of(small_nbrpc)
    switch(None)
    results["1000 concurrent"] = concurrent_calls(nb_echo, tiny, 5 if small_n < 1000 else 15)
    prefix, threshold = shm.prefix(), cluster.shm_threshold

    def fast_path(on: bool) -> None:  # every process: shared memory on, or TensorPipe only
        for worker in ("worker1", "worker2"):
            rpc.rpc_sync(worker, shm.configure, args=(prefix, threshold if on else None))
        shm.configure(prefix, threshold if on else None)

    for mb, repeats in big_n.items():
        big = torch.randn(mb * 1024 * 1024 // 4)
        warm = big.clone()  # memory already mapped: the cost of the copy alone
        peers = {
            "nbrpc": (True, lambda big=big: nbrpc.rpc_sync("worker1", nb_echo, args=(big,))),
            "nbrpc, TensorPipe only": (
                False,
                lambda big=big: nbrpc.rpc_sync("worker1", nb_echo, args=(big,)),
            ),
            "torch rpc": (False, lambda big=big: TORCH_SYNC("worker1", echo, args=(big,))),
            "ipyparallel apply": (False, lambda big=big: engine.apply_sync(echo, big)),
            "floor": (False, lambda big=big: big.clone()),
            "copy into mapped memory": (False, lambda big=big, warm=warm: warm.copy_(big)),
        }
        times: dict[str, list[float]] = {name: [] for name in peers}
        order = list(peers.items())
        for i in range(repeats + 1):  # the first round warms up (recycled segments, pipes)
            random.Random(i).shuffle(order)
            for name, (on, call) in order:
                fast_path(on)
                t0 = time.perf_counter()
                call()
                if i:
                    times[name].append(time.perf_counter() - t0)
        results[f"{mb}MB"] = {name: stats(v) for name, v in times.items()}
        for name in ("nbrpc", "nbrpc, TensorPipe only"):
            fast_path(peers[name][0])
            results[f"{mb}MB"][name]["route"] = route_of(peers[name][1])
        fast_path(True)
        del big, warm
    return results


def concurrent_calls(nb_echo, tiny, repeats: int) -> dict:
    """1000 ``rpc_async`` calls to worker1 in flight at once, then waited for (each peer
    interleaved, ``repeats`` times)."""

    def burst(start) -> None:
        futures = [start() for _ in range(1000)]
        for fut in futures:
            fut.wait()

    peers = {
        "nbrpc": (False, lambda: nbrpc.rpc_async("worker1", nb_echo, args=(tiny,))),
        "nbrpc, TensorPipe only": (
            True,
            lambda: nbrpc.rpc_async("worker1", nb_echo, args=(tiny,)),
        ),
        "torch rpc": (False, lambda: TORCH_ASYNC("worker1", echo, args=(tiny,))),
    }
    times: dict[str, list[float]] = {name: [] for name in peers}
    order = list(peers.items())
    for i in range(repeats + 1):  # the first round warms up (the pool's threads start)
        random.Random(i).shuffle(order)
        for name, (paused, start) in order:
            lanes.pause(paused)
            t0 = time.perf_counter()
            burst(start)
            if i:
                times[name].append(time.perf_counter() - t0)
    lanes.pause(False)
    return {name: stats(v) for name, v in times.items()}


def route_of(call) -> str:
    """The way one call of ``call`` went, as the timeline records it: its route and its
    tensors' path (``lane``, ``arena+tensorpipe``, ...)."""
    with nbrpc.record() as rec:
        call()
    row = rec.calls[0]
    return "+".join(sorted({p for p in (row["path_in"], row["path_out"], row["route"]) if p}))


def idle_cpu(cluster, seconds: float = 5.0) -> float:
    """Percent of one core the cluster's processes (the kernel included) use together
    while idle, lanes open."""
    import psutil

    procs = [psutil.Process(r.pid) for r in cluster.records]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(seconds)
    after = [sum(p.cpu_times()[:2]) for p in procs]
    return 100 * (sum(after) - sum(before)) / seconds


def bench_cuda(quick: bool) -> dict:
    """``cuda_rpc.py`` in processes of its own (it prints its own table), or why not."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: torch.cuda.is_available() is False here"}
    command = [sys.executable, str(ROOT / "benchmarks" / "cuda_rpc.py")]
    done = subprocess.run(command + (["--quick"] if quick else []), timeout=1800)
    if done.returncode != 0:
        return {"skipped": f"cuda_rpc.py failed (exit {done.returncode}); its output is above"}
    return json.loads((ROOT / "benchmarks" / "results" / "cuda.json").read_text())


def report(results: dict) -> None:
    def fmt(seconds: float) -> str:
        if seconds < 1e-3:
            return f"{seconds * 1e6:7.0f} µs"
        if seconds < 1:
            return f"{seconds * 1e3:7.1f} ms"
        return f"{seconds:7.2f} s "

    for figure, rows in results["calls"].items():
        base = rows["torch rpc"]["median"]
        floor = rows["floor"]["median"] if "floor" in rows else None
        what = "calls, all done" if figure == "1000 concurrent" else "round trip"
        print(f"{figure} {what:<26} median        p90   vs torch rpc   vs floor   route")
        for name, row in rows.items():
            versus = f"{row['median'] / floor:8.1f}x" if floor else " " * 9
            print(
                f"  {name:<34}{fmt(row['median'])} {fmt(row['p90'])}   "
                f"{row['median'] / base:8.2f}x  {versus}   {row.get('route', '')}"
            )
    small = results["calls"]["small"]
    bare = small["torch rpc, bare processes"]["median"]
    print(
        f"  nbrpc's small call is {small['nbrpc']['median'] / bare:.2f}x a plain torch script's "
        "(goal: at most 0.35x)"
    )
    print(f"  idle, the cluster's 3 processes use {results['idle CPU %']:.2f} % of one core")
    lane_cpu.report(results["cpu per call"])
    print(
        "  recording a timeline (nbrpc.record()) costs a small call "
        f"{small['nbrpc, recording a timeline']['median'] / small['nbrpc']['median']:.2f}x "
        "(goal: at most 1.10x)"
    )
    boot = results["boot"]
    base = base_boot = boot["plain torch script"]["median"]
    print("boot, 2 workers, to a call answered by each   median   min..max   vs plain torch script")
    for name, row in boot.items():
        if name.startswith("phases") or name == "warm-up cost":
            continue
        spread = f"{row['min']:.2f}..{row['max']:.2f} s" if "min" in row else ""
        print(f"  {name:<34}{row['median']:6.2f} s  {spread:<14}{row['median'] / base:6.2f}x")
    for name in ("phases, first boot", "phases, re-run", "phases, first boot after %load_ext"):
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in boot[name].items())
        print(f"  {name}: {phases}")
    cost = boot["warm-up cost"]
    print(
        f"  warm-up after %load_ext: ready {cost['background s']:.2f} s in the background; "
        f"idle, its {cost['processes']:.0f} processes use {cost['idle CPU %']:.2f} % of a core "
        f"and {cost['PSS MB']:.0f} MB (PSS)"
    )
    if "skipped" in results.get("cuda", {}):
        print(f"CUDA RPC: skipped: {results['cuda']['skipped']}")
    ray = results.get("ray", {})
    if "skipped" in ray:
        print(f"Ray: skipped: {ray['skipped']}")
    elif ray:
        calls = results["calls"]
        print(f"Ray {ray['version']} (actor calls)             median        p90   vs torch rpc")
        for name, figure in (
            ("small", "small"),
            ("64MB torch tensor", "64MB"),
            ("64MB numpy array", "64MB"),
        ):
            base = calls[figure]["torch rpc"]["median"]
            row = ray[name]
            print(
                f"  {name:<34}{fmt(row['median'])} {fmt(row['p90'])}   {row['median'] / base:8.2f}x"
            )
        boot_ray = ray["boot"]
        print(
            f"  boot, 2 actors to a call each   {boot_ray['median']:6.2f} s  "
            f"{boot_ray['min']:.2f}..{boot_ray['max']:.2f} s  "
            f"{boot_ray['median'] / base_boot:6.2f}x the plain torch script"
        )
    split = results["model_split_step_s"]
    print("04's model, one forward+backward+SGD step (64x512 -> 1024 -> 1024 -> 16, float32):")
    for name, row in split.items():
        print(f"  {name:<28}{fmt(row['median'])} {fmt(row['p90'])}")
    ratio = split["split over 3 processes"]["median"] / split["one process"]["median"]
    print(f"  ratio split / one process (median): {ratio:.2f}")
    if "sizes" in results:
        from benchmarks import sizes

        sizes.report(results)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = list(results["calls"])
    peers = [
        "nbrpc",
        "nbrpc, TensorPipe only",
        "torch rpc",
        "torch rpc, bare processes",
        "ipyparallel apply",
        "Ray actor",
        "Ray actor, numpy",
        "floor",
    ]
    colors = ["#e65100", "#ffb74d", "#37474f", "#90a4ae", "#6a1b9a", "#0277bd", "#81d4fa"]
    colors.append("#2e7d32")
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.1
    for i, (peer, color) in enumerate(zip(peers, colors, strict=True)):
        values = []
        for figure in figures:
            row = results["calls"][figure].get(peer)
            base = results["calls"][figure]["torch rpc"]["median"]
            values.append(row["median"] / base if row else float("nan"))
        ax.bar(
            [j + (i - 3.5) * width for j in range(len(figures))],
            values,
            width,
            label=peer,
            color=color,
        )
    ax.axhline(1.0, color="#37474f", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(figures)), [f"{f} round trip" for f in figures])
    ax.set_ylabel("time / torch RPC (same processes)")
    ax.set_title("nbrpc and its baselines, medians (lower is faster)")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    small_n, boots = (200, 1) if args.quick else (2000, 5)
    big_n = {4: 10, 64: 4, 256: 2} if args.quick else {4: 40, 64: 15, 256: 5}

    small_floor = floor_small(small_n)
    bare = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "raw_torch.py"), str(small_n)]
        + [f"{mb}:{n}" for mb, n in big_n.items()],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    raw = json.loads(bare.stdout.strip().splitlines()[-1])
    results: dict = {"boot": bench_boot(boots)}
    cluster = nbrpc.init(n=2, progress=False)
    results["calls"] = bench_calls(small_n, big_n)
    results["idle CPU %"] = idle_cpu(cluster)
    results["cpu per call"] = lane_cpu.measure(small_n, notebook_echo(), torch.ones(1))
    results["model_split_step_s"] = bench_model_split(10 if args.quick else 50)
    nbrpc.shutdown()

    ray = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "ray_peer.py"),
            str(small_n),
            str(big_n[64]),
            str(boots),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    try:
        results["ray"] = json.loads(ray.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        results["ray"] = {"skipped": f"Ray failed: {ray.stderr.strip()[-500:]}"}
    if "small" in results["ray"]:
        results["calls"]["small"]["Ray actor"] = results["ray"]["small"]
        results["calls"]["64MB"]["Ray actor"] = results["ray"]["64MB torch tensor"]
        results["calls"]["64MB"]["Ray actor, numpy"] = results["ray"]["64MB numpy array"]
    results["cuda"] = bench_cuda(args.quick)
    from benchmarks import sizes  # (it imports this module)

    results["sizes"] = sizes.measure(args.quick)["sizes"]
    results["calls"]["small"]["floor"] = small_floor
    for figure, row in raw["calls"].items():
        results["calls"][figure]["torch rpc, bare processes"] = row
    report(results)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2))
    plot(results, ROOT / "docs" / "benchmarks.png")
    print(f"wrote {out / 'latest.json'} and docs/benchmarks.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
