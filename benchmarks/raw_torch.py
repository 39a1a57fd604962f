"""Baseline: plain torch RPC between bare processes, no nbrpc imported anywhere.

Run by ``benchmarks/run.py`` as a subprocess (nbrpc's hooks are process-wide, so this
baseline needs processes of its own). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

WORKER = """
import sys, torch.distributed.rpc as rpc
sys.path.insert(0, sys.argv[3])
rpc.init_rpc(f"worker{sys.argv[1]}", rank=int(sys.argv[1]), world_size=2,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=sys.argv[2]))
rpc.shutdown()
"""


def main() -> int:
    small_n = int(sys.argv[1])
    sizes = [tuple(int(v) for v in arg.split(":")) for arg in sys.argv[2:]]  # MB:repeats
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import torch
    import torch.distributed.rpc as rpc

    from benchmarks.peers import echo
    from benchmarks.stats import stats, timed

    url = f"file://{tempfile.mkdtemp()}/store"
    t0 = time.perf_counter()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, "1", url, root])
    opts = rpc.TensorPipeRpcBackendOptions(init_method=url)
    rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)
    rpc.rpc_sync("worker1", min, args=(1, 2))
    boot = time.perf_counter() - t0

    tiny = torch.ones(1)
    calls = {"small": timed(lambda: rpc.rpc_sync("worker1", echo, args=(tiny,)), small_n, 50)}
    for mb, repeats in sizes:
        big = torch.randn(mb * 1024 * 1024 // 4)
        calls[f"{mb}MB"] = timed(
            lambda big=big: rpc.rpc_sync("worker1", echo, args=(big,)), repeats
        )
    rpc.shutdown()
    worker.wait(timeout=60)
    print(json.dumps({"boot_s": boot, "calls": {k: stats(v) for k, v in calls.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
