"""Boot to first calls, 2 workers, each measured in a fresh process (``make bench`` runs it).

    python benchmarks/boot.py [ROUNDS]        prints one JSON line

Peers, in a fresh random order each round; every timer starts after the process has
imported what its user imports first (``import torch`` / ``import nbrpc``, as a notebook's
``%load_ext nbrpc`` does) and stops when every worker has answered a call:
- ``plain torch script``: the seeds' way, ``torch.multiprocessing.spawn`` of 2 workers and
  ``init_rpc`` in all three processes, then ``rpc_sync`` to each worker;
- ``nbrpc first boot``: ``nbrpc.init(n=2)`` in a new kernel, then a call to each worker;
- ``nbrpc re-run``: in that kernel, ``nbrpc.shutdown()``, a pause while the warm spares
  start (a person re-running a cell), then ``nbrpc.init(n=2)`` and the calls;
- ``nbrpc re-run at once``: the same without the pause (spares still starting);
- ``first boot after %load_ext``: an IPython shell runs ``%load_ext nbrpc`` (which warms
  up in the background), a pause while the warm-up ends (a person reading the next cell),
  then ``%rpc_init -n 2`` and a call to each worker. The same run measures the warm
  processes' idle CPU (10 s, as a share of one core) and memory (PSS: their share of the
  memory they use, shared pages split), under ``warm-up cost``;
- ``ipyparallel default start``: ``ipp.Cluster(n=2)`` started and connected with its
  defaults, then ``apply`` on each engine.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap

PLAIN = """
import json, sys, tempfile, time
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

def run_worker(rank, url, world):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=url)
    rpc.init_rpc(f"worker{rank + 1}", rank=rank + 1, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()

if __name__ == "__main__":
    n = 2
    t0 = time.perf_counter()
    url = f"file://{tempfile.mkdtemp()}/store"
    ctx = mp.spawn(run_worker, args=(url, n + 1), nprocs=n, join=False)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=url)
    rpc.init_rpc("worker0", rank=0, world_size=n + 1, rpc_backend_options=opts)
    for i in range(1, n + 1):
        rpc.rpc_sync(f"worker{i}", min, args=(1, 2))
    took = time.perf_counter() - t0
    rpc.shutdown()
    ctx.join()
    print(json.dumps({"plain torch script": took}))
"""

NBRPC = """
import json, time
import nbrpc
from nbrpc._engines import local

def boot():
    t0 = time.perf_counter()
    cluster = nbrpc.init(n=2, progress=False)
    for name in ("worker1", "worker2"):
        nbrpc.rpc_sync(name, min, args=(1, 2))
    return time.perf_counter() - t0, dict(cluster.boot_seconds)

out = {}
out["nbrpc first boot"], out["phases, first boot"] = boot()
nbrpc.shutdown()
deadline = time.monotonic() + 60
while local.kept().registered_spares() < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
out["nbrpc re-run"], out["phases, re-run"] = boot()
nbrpc.shutdown()
out["nbrpc re-run at once"], out["phases, re-run at once"] = boot()
nbrpc.shutdown(release=True)
print(json.dumps(out))
"""

LOADEXT = """
import json, time
import psutil
from IPython.core.interactiveshell import InteractiveShell
import nbrpc
from nbrpc._engines import local

shell = InteractiveShell.instance()
t0 = time.perf_counter()
shell.run_line_magic("load_ext", "nbrpc")
deadline = time.monotonic() + 120
ready = lambda: local.kept() is not None and local.kept().registered_spares() >= 2
while not ready() and time.monotonic() < deadline:
    time.sleep(0.05)
warmed = time.perf_counter() - t0
time.sleep(1.0)
warm = psutil.Process().children(recursive=True)  # the watchdog too
busy = lambda: sum(sum(p.cpu_times()[:2]) for p in warm)
cpu0, t_idle = busy(), time.perf_counter()
time.sleep(10)
idle = (busy() - cpu0) / (time.perf_counter() - t_idle)
pss = sum(p.memory_full_info().pss for p in warm) / 2**20
t0 = time.perf_counter()
shell.run_line_magic("rpc_init", "-n 2 --quiet")
for name in ("worker1", "worker2"):
    nbrpc.rpc_sync(name, min, args=(1, 2))
took = time.perf_counter() - t0
phases = dict(nbrpc.current().boot_seconds)
nbrpc.shutdown(release=True)
print(json.dumps({
    "first boot after %load_ext": took,
    "phases, first boot after %load_ext": phases,
    "warm-up cost": {"background s": warmed, "idle CPU %": 100 * idle, "PSS MB": pss,
                     "processes": len(warm)},
}))
"""

IPYPARALLEL = """
import json, logging, time
import ipyparallel as ipp
t0 = time.perf_counter()
cluster = ipp.Cluster(n=2, controller_ip="127.0.0.1", log_level=logging.ERROR)
client = cluster.start_and_connect_sync()
client.wait_for_engines(2, timeout=120)
for i in client.ids:
    client[i].apply_sync(min, 1, 2)
took = time.perf_counter() - t0
client.close()
cluster.stop_cluster_sync()
print(json.dumps({"ipyparallel default start": took}))
"""


def _run(source: str, folder: str, name: str) -> dict:
    path = os.path.join(folder, f"boot_{name}.py")  # not nbrpc.py: it would shadow nbrpc
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    out = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, timeout=600, cwd=folder
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    peers = {"plain": PLAIN, "nbrpc": NBRPC, "loadext": LOADEXT, "ipyparallel": IPYPARALLEL}
    samples: dict[str, list] = {}
    order = list(peers)
    shuffle = random.Random(1).shuffle
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            shuffle(order)
            for name in order:
                for key, value in _run(peers[name], folder, name).items():
                    samples.setdefault(key, []).append(value)
    result: dict = {}
    for key, values in samples.items():
        if key.startswith("phases"):  # the phases of the round whose total is the median
            totals = [v["total"] for v in values]
            result[key] = values[totals.index(sorted(totals)[len(totals) // 2])]
        elif key == "warm-up cost":  # each figure's median
            result[key] = {k: statistics.median(v[k] for v in values) for k in values[0]}
        else:
            result[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
            }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
