"""Ray, measured as a peer in the same run as nbrpc (``make bench``; optional).

    python benchmarks/ray_peer.py SMALL_N BIG_N BOOT_ROUNDS

Prints one JSON line: the round trip of a tiny actor call (a 1-element tensor), of a 64 MB
float32 torch tensor and of the same data as a numpy array (Ray's zero-copy object store
path), and boot to a call answered by each of 2 actors, each boot in a fresh process.
Runs in its own process, so Ray's raylet, GCS and workers never share a run with nbrpc's
cluster. Without Ray installed it prints ``{"skipped": "..."}``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stats import stats

BOOT = """
import time, torch, ray
t0 = time.perf_counter()
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

@ray.remote
class Echo:
    def echo(self, x):
        return x

actors = [Echo.remote() for _ in range(2)]
ray.get([a.echo.remote(1) for a in actors])
print(time.perf_counter() - t0)
ray.shutdown()
"""


def main() -> int:
    small_n, big_n, boot_rounds = (int(a) for a in sys.argv[1:4])
    try:
        import numpy as np
        import ray
        import torch
    except ImportError:
        print(json.dumps({"skipped": "Ray is not installed (pip install -e '.[ray]')"}))
        return 0

    boots = []
    for _ in range(boot_rounds):
        out = subprocess.run(
            [sys.executable, "-c", BOOT], capture_output=True, text=True, check=True, timeout=300
        )
        boots.append(float(out.stdout.strip().splitlines()[-1]))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

    @ray.remote
    class Echo:
        def echo(self, x):
            return x

    actor = Echo.remote()
    tiny = torch.ones(1)
    for _ in range(50):
        ray.get(actor.echo.remote(tiny))
    small = []
    for _ in range(small_n):
        t0 = time.perf_counter()
        ray.get(actor.echo.remote(tiny))
        small.append(time.perf_counter() - t0)
    big = torch.randn(64 * 1024 * 1024 // 4)
    as_numpy = big.numpy()
    tensor_times, numpy_times = [], []
    for i in range(big_n + 1):  # the first round warms the object store
        t0 = time.perf_counter()
        ray.get(actor.echo.remote(big))
        t1 = time.perf_counter()
        ray.get(actor.echo.remote(as_numpy))
        t2 = time.perf_counter()
        if i:
            tensor_times.append(t1 - t0)
            numpy_times.append(t2 - t1)
    ray.shutdown()
    print(
        json.dumps(
            {
                "small": stats(small),
                "64MB torch tensor": stats(tensor_times),
                "64MB numpy array": stats(numpy_times),
                "boot": {
                    "median": statistics.median(boots),
                    "min": min(boots),
                    "max": max(boots),
                },
                "version": ray.__version__,
                "numpy": np.__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
