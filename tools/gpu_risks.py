"""The GPU risks of issue 63, each checked in a process of its own on a GPU host.

    python tools/gpu_risks.py PART        (PART: env, membership, callbacks, staging,
                                           nvml, streams)

Each part is a notebook's cells as a script: a cluster with ``gpus="auto"``, calls made
the way a person makes them, and a check of what came back. It prints its figures as one
line, ``FIGURES {json}``, which ``tools/gpu_check.py`` gathers, and exits 1 where a check
failed (a part that aborts, as torch does when a CUDA reply finds no stream, exits with
the signal instead). Functions defined here travel by value (this file runs as
``__main__``), as a notebook's do.

- ``env``: the GPUs (UUIDs, MIG), ``/dev/shm``, cores, torch;
- ``membership`` (risk 2): two threads loop ``rpc_async`` calls that return small and
  large CUDA tensors while the cluster shrinks (``%rpc_scale 2``) and workers restart;
  the kernel must live, every process then replies to every other;
- ``callbacks`` (risk 1): a ``then`` callback that sleeps on the GPU, then writes the
  reply in place: the waited value, read on the default stream and on a side stream, is
  the written one; ``add_done_callback`` sees the reply written;
- ``staging`` (risk 6): a reply written after ``torch.cuda._sleep`` on the callee arrives
  written over a lane; an argument made on a side stream of the caller is sent written;
- ``nvml``: (risk 4) CPU, GPU, CPU clusters in one kernel whose NVML lists another GPU
  than CUDA shows (a stand-in library: MIG's view, or some containers'), with nbrpc's
  channel choice and with ``cuda_ipc`` asked for;
- ``streams`` (risk 5): four concurrent calls that each sleep 50 ms on the GPU, lanes on
  and paused; one small reply while the kernel's default stream is busy for 1 s.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import nbrpc  # noqa: E402

#: float32 elements: 128 KB, over a lane's 64 KB, so TensorPipe's CUDA channel carries it
BIG = 1 << 15
#: GPU clock cycles of ``torch.cuda._sleep``: about 0.1 s on an H200 (1.98 GHz)
SLEEP = 200_000_000
FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        FAILED.append(what)


def make(n: int) -> torch.Tensor:
    return torch.full((n,), 2.0, device="cuda:0")


def late(n: int) -> torch.Tensor:
    """A CUDA tensor whose value is written after ~0.1 s of GPU work on this stream."""
    x = torch.zeros(n, device="cuda:0")
    torch.cuda._sleep(SLEEP)
    x.fill_(3.0)
    return x


def plus(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def gpu_sleep_then_small(ms: float) -> torch.Tensor:
    """``ms`` milliseconds of GPU work, then a small CUDA tensor made after it."""
    torch.cuda._sleep(int(SLEEP * ms / 100))
    return torch.ones(4, device="cuda:0")


def cuda_up() -> bool:
    return torch.cuda.is_initialized()


# -- env --------------------------------------------------------------------------------


def env() -> dict:
    def sh(*argv: str) -> str:
        if not shutil.which(argv[0]):
            return f"{argv[0]}: not installed"
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip()

    from nbrpc import _network

    shm = shutil.disk_usage("/dev/shm")
    return {
        "gpus": sh("nvidia-smi", "-L"),
        "mig": sh("nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"),
        "driver": sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "dev_shm_gib": round(shm.total / 2**30, 1),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
        "python": sys.version.split()[0],
        "cuda_ipc_can_start": _network.cuda_ipc_can_start(),
        "cuda uuids": _network.cuda_uuids(),
    }


# -- risk 2: membership changes under GPU traffic ---------------------------------------


def membership() -> dict:
    nbrpc.init(n=3, gpus="auto", progress=False)  # (a cluster with maps cannot grow)
    stop = threading.Event()
    ok: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    wrong: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                names = nbrpc.workers()[1:]
            except nbrpc.NotInitializedError:
                return
            for name in names:
                for n in (4, BIG):
                    try:
                        got = nbrpc.rpc_async(name, make, args=(n,)).wait()
                    except Exception as exc:
                        errors[f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"] += 1
                        continue
                    if not (got.is_cuda and got.sum().item() == 2.0 * n):
                        wrong.append(f"{name} {n}: {got.device}")
                    ok[n] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    steps = {}
    for step, act in (
        ("scale to 2", lambda: nbrpc.scale(2)),
        ("restart worker2", lambda: nbrpc.restart("worker2")),
        ("restart worker1", lambda: nbrpc.restart("worker1")),
    ):
        t0 = time.monotonic()
        act()
        steps[step] = round(time.monotonic() - t0, 2)
        time.sleep(1.0)
        print(step, "done in", steps[step], "s; calls so far", dict(ok), flush=True)
    stop.set()
    for thread in threads:
        thread.join(60)
    check(not any(t.is_alive() for t in threads), "the calling threads ended")
    check(not wrong, f"every CUDA reply right ({wrong[:3]})")
    check(sum(ok.values()) > 100, f"calls went through during the changes: {dict(ok)}")
    every = []
    for name in nbrpc.workers()[1:]:
        for n in (4, BIG):
            got = nbrpc.rpc_sync(name, make, args=(n,))
            every.append(bool(got.is_cuda and got.sum().item() == 2.0 * n))
    check(all(every) and len(every) == 4, f"every worker replies after the changes: {every}")
    for name in nbrpc.workers()[1:]:  # and each worker asks every other process
        for other in nbrpc.workers():
            if other != name:
                got = nbrpc.rpc_sync(name, nbrpc.rpc_sync, args=(other, make, (3,)))
                check(got.is_cuda and got.tolist() == [2.0] * 3, f"{name} asked {other}")
    nbrpc.shutdown()
    return {"steps_s": steps, "ok": dict(ok), "errors": dict(errors)}


# -- risk 1: callbacks and streams -------------------------------------------------------


def callbacks() -> dict:
    from nbrpc._wire import lanes

    nbrpc.init(n=1, gpus="auto", progress=False)
    side = torch.cuda.Stream()
    out = {}
    ways = (("lane", 1000, False), ("tensorpipe", 1000, True), ("tensorpipe, large", BIG, False))
    for route, n, paused in ways:
        lanes.pause(paused)
        for waiter in ("default stream", "side stream"):

            def then(fut: torch.futures.Future) -> tuple[torch.Tensor, float]:
                value = fut.wait()
                seen = value.sum().item()  # the reply, written (3.0 each)
                torch.cuda._sleep(SLEEP)
                value.fill_(7.0)
                return value, seen

            child = nbrpc.rpc_async("worker1", late, args=(n,)).then(then)
            if waiter == "side stream":
                with torch.cuda.stream(side):
                    value, seen = child.wait()
                    got = value.sum().item()
            else:
                value, seen = child.wait()
                got = value.sum().item()
            key = f"then, {route}, waited on the {waiter}"
            out[key] = {"seen in the callback": seen / n, "waited": got / n}
            check(seen == 3.0 * n, f"{key}: the callback saw the reply written ({seen / n})")
            check(got == 7.0 * n, f"{key}: the waited value is the callback's ({got / n})")
        seen_there: list[float] = []
        ran = threading.Event()

        def done(fut: torch.futures.Future, seen_there=seen_there, ran=ran) -> None:
            seen_there.append(fut.value().sum().item())
            ran.set()

        fut = nbrpc.rpc_async("worker1", late, args=(n,))
        fut.add_done_callback(done)
        fut.wait()
        ran.wait(30)
        key = f"add_done_callback, {route}"
        out[key] = seen_there
        check(seen_there == [3.0 * n], f"{key}: the callback saw the reply written {seen_there}")
    lanes.pause(False)
    nbrpc.shutdown()
    return out


# -- risk 6: staging order --------------------------------------------------------------


def staging() -> dict:
    nbrpc.init(n=1, gpus="auto", progress=False)
    side = torch.cuda.Stream()
    out = {}
    with nbrpc.record() as rec:
        for how in ("rpc_sync", "rpc_async"):
            call = nbrpc.rpc_sync if how == "rpc_sync" else nbrpc.rpc_async
            for _ in range(3):
                got = call("worker1", late, args=(1000,))
                got = got if how == "rpc_sync" else got.wait()
                out.setdefault(f"late reply, {how}", []).append(got.sum().item() / 1000)
            for _ in range(3):
                with torch.cuda.stream(side):
                    x = torch.zeros(1000, device="cuda:0")
                    torch.cuda._sleep(SLEEP)
                    x.fill_(5.0)
                    got = call("worker1", plus, args=(x,))
                    got = got if how == "rpc_sync" else got.wait()
                    out.setdefault(f"side-stream argument, {how}", []).append(
                        got.sum().item() / 1000
                    )
    routes = [(r["function"], r["route"]) for r in rec.calls if r["caller"] != "worker1"]
    out["routes"] = routes
    for key, values in out.items():
        if key.startswith("late"):
            check(values == [3.0] * 3, f"{key}: arrived written {values}")
        elif key.startswith("side"):
            check(values == [6.0] * 3, f"{key}: sent written {values}")
    check(any(route == "lane" for _, route in routes), f"lanes carried some: {routes}")
    nbrpc.shutdown()
    return out


# -- risk 4: a host whose NVML lists no GPU ----------------------------------------------

#: a GPU that CUDA does not show: what NVML lists under MIG, where CUDA shows ``MIG-``
#: instances, or in a container that hides the host's GPUs from NVML
OTHER_GPU = "00000000-1111-2222-3333-444444444444"


def fake_nvml(uuid: str | None) -> str:
    """C source of a libnvidia-ml.so.1 as TensorPipe and torch load it, listing one GPU
    with ``uuid`` (None: none)."""
    count, found = (1, 0) if uuid else (0, 2)
    return (
        "#include <string.h>\n"
        "typedef void* dev;\n"
        "int nvmlInit_v2(void) { return 0; }\n"
        "int nvmlInit(void) { return 0; }\n"
        "int nvmlShutdown(void) { return 0; }\n"
        f"int nvmlDeviceGetCount_v2(unsigned int* n) {{ *n = {count}; return 0; }}\n"
        f"int nvmlDeviceGetCount(unsigned int* n) {{ *n = {count}; return 0; }}\n"
        f"int nvmlDeviceGetHandleByIndex_v2(unsigned int i, dev* d) {{ return {found}; }}\n"
        "int nvmlDeviceGetUUID(dev d, char* s, unsigned int n) "
        f'{{ strncpy(s, "GPU-{uuid}", n); return 0; }}\n'
        "int nvmlDeviceGetP2PStatus(dev a, dev b, int i, int* s) { *s = 0; return 0; }\n"
        'const char* nvmlErrorString(int e) { return "stand-in NVML"; }\n'
    )


NVML_KERNEL = """
import torch, nbrpc
def plus(x):
    return x + 1
nbrpc.init(n=2, progress=False)
print("cpu cluster:", nbrpc.rpc_sync("worker1", plus, args=(torch.ones(2),)).tolist(), flush=True)
nbrpc.shutdown()
nbrpc.init(n=1, gpus="auto", progress=False)
x = torch.ones(1 << 15, device="cuda:0")
print("gpu cluster:", nbrpc.rpc_sync("worker1", plus, args=(x,)).sum().item(), flush=True)
nbrpc.shutdown()
nbrpc.init(n=2, progress=False)
print("cpu again:", nbrpc.rpc_sync("worker2", plus, args=(torch.ones(2),)).tolist(), flush=True)
nbrpc.shutdown()
"""


def nvml() -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return {"skipped": "no C compiler to build the stand-in NVML"}
        (Path(tmp) / "nvml.c").write_text(fake_nvml(OTHER_GPU))
        lib = Path(tmp) / "libnvidia-ml.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), f"{tmp}/nvml.c"], check=True)
        path = f"{tmp}:{os.environ.get('LD_LIBRARY_PATH', '')}"
        base = {**os.environ, "LD_LIBRARY_PATH": path}
        base["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"  # torch's NVML use
        (Path(tmp) / "kernel.py").write_text(NVML_KERNEL)
        for name, extra in (
            ("nbrpc's channels", {}),
            ("cuda_ipc asked for", {"NBRPC_TENSORPIPE_CHANNELS": "cuda_ipc,cuda_basic,cma,basic"}),
        ):
            t0 = time.monotonic()
            done = subprocess.run(
                [sys.executable, f"{tmp}/kernel.py"],
                env={**base, **extra},
                capture_output=True,
                text=True,
                timeout=150,
            )
            text = done.stdout + done.stderr
            out[name] = {
                "exit": done.returncode,
                "s": round(time.monotonic() - t0, 1),
                "lines": [line for line in text.splitlines() if ":" in line][-8:],
            }
            print(name, done.returncode, text[-3000:], flush=True)
    ours = out["nbrpc's channels"]
    check(ours["exit"] == 0, "CPU, GPU, CPU clusters where NVML lists no GPU")
    return out


# -- risk 5: streams on lanes ------------------------------------------------------------


def streams() -> dict:
    from nbrpc._wire import lanes

    nbrpc.init(n=1, gpus="auto", progress=False)
    out = {}
    for paused in (False, True):
        lanes.pause(paused)
        label = "lanes paused" if paused else "lanes on"
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            futs = [nbrpc.rpc_async("worker1", gpu_sleep_then_small, args=(50,)) for _ in range(4)]
            got = [f.wait() for f in futs]
            times.append(time.perf_counter() - t0)
            check(all(g.is_cuda and g.sum().item() == 4 for g in got), f"{label}: replies")
        out[f"four 50 ms GPU calls at once, {label}, s"] = sorted(times)[1]
        # the kernel's default stream busy for ~1 s: when does a small reply arrive?
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP * 10)
        t0 = time.perf_counter()
        fut = nbrpc.rpc_async("worker1", make, args=(4,))
        while not fut.done():
            time.sleep(0.001)
        arrived = time.perf_counter() - t0
        value = fut.wait()
        check(value.sum().item() == 8.0, f"{label}: the reply behind a busy stream")
        torch.cuda.synchronize()
        out[f"small reply while the default stream is busy 1 s, {label}, s"] = arrived
    lanes.pause(False)
    nbrpc.shutdown()
    return out


PARTS = {
    "env": env,
    "membership": membership,
    "callbacks": callbacks,
    "staging": staging,
    "nvml": nvml,
    "streams": streams,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in PARTS:
        print(__doc__)
        return 2
    if not torch.cuda.is_available():
        print(f"FIGURES {json.dumps({'skipped': 'no CUDA device'})}")
        return 0
    t0 = time.monotonic()
    figures = PARTS[argv[0]]()
    figures["seconds"] = round(time.monotonic() - t0, 1)
    figures["failed"] = FAILED
    print("FIGURES " + json.dumps(figures, default=str), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
