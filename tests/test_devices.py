"""Device maps: parsing, planning and checking (pure), and the CPU-only refusal for real."""

import time

import psutil
import pytest
import torch
from conftest import ensure_cluster, run_script, running

import nbrpc
from nbrpc import _group
from nbrpc._errors import ConfigError, DeviceMapError

#: a GPU script's limit: under pytest's own (300 s, its thread method ends the whole run),
#: so a hang fails one test, with the script's stderr, and the others still run
SCRIPT_S = 240


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: the refusal is for CPU-only ones"
)
def test_a_device_map_on_a_cpu_only_machine_fails_before_init_rpc():
    """torch itself says only "Cannot access accelerator device when none is available"."""
    nbrpc.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    with pytest.raises(DeviceMapError, match=r"worker0 on .* has no CUDA device at all"):
        nbrpc.init(n=1, device_maps={"worker1": {"cuda:0": "cuda:0"}}, progress=False)
    with pytest.raises(DeviceMapError, match=r"--gpus auto: worker0 on .* has no CUDA device"):
        nbrpc.init(n=1, gpus="auto", progress=False)
    print(f"two refused boots in {time.monotonic() - t0:.1f} s")
    with pytest.raises(nbrpc.NotInitializedError):
        nbrpc.current()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [p for p in left if running(p.pid)]
    ensure_cluster()


def test_cuda_is_brought_up_before_joining_only_when_maps_or_devices_need_it():
    assert not _group.uses_cuda(None, None)
    assert not _group.uses_cuda({"worker1": {}}, ["cpu"])
    assert _group.uses_cuda({"worker1": {"cuda:0": "cuda:1"}}, None)
    assert _group.uses_cuda(None, ["cpu", "cuda:0"])
    assert _group.uses_cuda(None, [0])


def test_the_cuda_devices_a_process_joins_with_are_what_its_async_replies_wait_for():
    """An rpc_async's future is CUDA-aware on these devices, as torch's: a callback runs
    on streams that wait for the reply, and a waiter's stream waits for the callback."""
    assert _group.local_cuda_devices(None, None) == ()
    assert _group.local_cuda_devices({"worker1": {}}, ["cpu"]) == ()
    assert _group.local_cuda_devices({"w1": {"cuda:1": "cuda:0"}}, ["cuda:0"]) == (
        "cuda:0",
        "cuda:1",
    )
    assert _group.local_cuda_devices(None, [0, "cuda:0"]) == ("cuda:0",)
    assert _group.cuda_devices() == ()  # this suite's kernel joined with CPU tensors only


def test_a_clusters_maps_that_the_kernels_first_join_did_not_fix_are_refused_by_name():
    """The late check, once the workers' devices are known (the early one by name:
    tests/unit/test_device_maps.py): each map the cluster needs must be one the first join
    fixed, and the refusal says which and what works. This suite's kernel joined without
    maps where there is no CUDA, and with ``--gpus auto``'s for worker1..worker16 where
    there is (always from cuda:0): no first join fixes a map from cuda:1."""
    ensure_cluster()
    member = _group.current_kernel_membership()
    timeout = torch.distributed.rpc.get_rpc_timeout()
    fixed = r"(None|\{'cuda:0': 'cuda:\d+'\})"
    refused = rf"maps to worker1 are \{{'worker1': {fixed}\}}.*restart"
    with pytest.raises(ConfigError, match=refused):
        _group.kernel_membership(
            member.name,
            init_method=None,
            rpc_timeout=timeout,
            num_worker_threads=8,
            device_maps={"worker1": {"cuda:1": "cuda:0"}},
        )
    same = _group.kernel_membership(
        member.name, init_method=None, rpc_timeout=timeout, num_worker_threads=8
    )
    assert same is member


#: Both kernels' check (prepended to their scripts): a tensor on a device sent to a CPU
#: cluster is refused with nbrpc's line
EXPECT_REFUSED = """
def expect_refused(func, tensor):
    try:
        nbrpc.rpc_sync("worker1", func, args=(tensor,))
    except nbrpc.DeviceMapError as refused:
        print("refused:", refused)
    else:
        raise AssertionError(f"a tensor on {tensor.device} went to a CPU cluster")
"""


#: A kernel that believes it is on a GPU host (torch's count of CUDA devices says 1), with
#: CPU workers: its first join prepares maps for the default names, as on a GPU host, and
#: no CUDA tensor can travel here (the CPU build has no CUDA channels: only CPU ones asked).
PRETEND_GPU_HOST = """
import os, time
os.environ["NBRPC_TENSORPIPE_CHANNELS"] = "cma,basic"
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
import nbrpc
from nbrpc import _group, _torch

def plus(x):
    return x + 1

@torch.jit.script
def scripted(x: torch.Tensor) -> torch.Tensor:
    return x + 1

def their_maps():
    from torch.distributed.rpc import api
    maps = api._get_current_rpc_agent()._get_backend_options().device_maps
    return {k: str(v) for k, v in maps.items()}

for generation in range(2):
    nbrpc.init(n=2, progress=False)
    fixed = _torch.agent()._get_backend_options().device_maps
    assert sorted(fixed) == sorted(f"worker{i}" for i in range(1, 17)), fixed
    assert _group.cuda_devices() == (), "a CPU cluster: the kernel lends no device"
    assert nbrpc.rpc_sync("worker2", plus, args=(torch.ones(2),)).tolist() == [2.0, 2.0]
    assert nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), 1)).tolist() == [2.0] * 3
    assert nbrpc.rpc_sync("worker1", their_maps) == {}
    assert nbrpc.rpc_sync("worker1", scripted, args=(torch.ones(1),)).item() == 2.0
    for func in (plus, torch.neg, scripted):  # by pickle, as TorchScript: all refused
        expect_refused(func, torch.ones(2, device="meta"))
    nbrpc.shutdown()
    print("cpu cluster", generation, "ok")
try:
    nbrpc.init(n=2, gpus="auto", progress=False)
except nbrpc.DeviceMapError as plan:  # the first join allowed it: the workers have no GPU
    print("planned:", plan)
t0 = time.monotonic()
try:
    nbrpc.init(n=1, names=["other"], device_maps={"other": {"cuda:0": "cuda:0"}}, progress=False)
except nbrpc.ConfigError as refused:
    print("refused in", round(time.monotonic() - t0, 2), "s:", refused)
nbrpc.init(n=3, progress=False)
got = [nbrpc.rpc_sync(w, plus, args=(torch.zeros(1),)).item() for w in nbrpc.workers()[1:]]
assert got == [1.0] * 3, got
nbrpc.shutdown()
print("cpu again ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the real paths run instead")
def test_a_kernel_on_a_gpu_host_prepares_maps_at_its_first_join_and_cpu_clusters_work_beside_them(
    tmp_path,
):
    """The first join maps worker1..worker16 and lends no device; every CPU cluster's
    workers learn no maps from it (told the prepared ones, a CPU worker's join fails
    torch's check: its count of CUDA devices is 0); a CUDA tensor (``meta`` here) is
    refused before torch's C++ sees it; a GPU cluster is no longer refused by the first
    join, and maps to other names are, before anything starts."""
    out = run_script(
        tmp_path / "pretend_gpu_host.py", EXPECT_REFUSED + PRETEND_GPU_HOST, timeout=SCRIPT_S
    )
    assert "cpu cluster 0 ok" in out, out
    assert "cpu cluster 1 ok" in out, out
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 6, out
    assert all("no device maps" in line and "tensor on meta" in line for line in refusals), out
    assert "planned: --gpus auto: worker1 on" in out, out  # the plan's refusal, not the join's
    assert "other maps to other" in out, out
    assert "cpu again ok" in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpus_auto_moves_cuda_tensors_device_to_device(tmp_path):
    """In fresh processes: the first CUDA tensor a process receives (the kernel's comes
    from a worker) must not find CUDA down, and a notebook class (a script's __main__,
    sent by value) must pass torch's tensor listing of CUDA-aware replies."""
    out = run_script(
        tmp_path / "cuda_group.py",
        "import torch, nbrpc\n"
        "class Scale(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.full((4,), 3.0, device='cuda:0'))\n"
        "    def forward(self, x):\n"
        "        return x * self.w\n"
        "c = nbrpc.init(n=1, gpus='auto', progress=False)\n"
        "print(c.summary())\n"
        "from nbrpc._wire import lanes\n"
        "lanes.pause(True)  # TensorPipe brings the first CUDA tensors, as without lanes\n"
        "y = nbrpc.rpc_sync('worker1', torch.ones, args=(4,), kwargs={'device': 'cuda:0'})\n"
        "assert y.is_cuda and y.tolist() == [1.0] * 4, y\n"
        "x = torch.ones(4, device='cuda:0')\n"
        "y = nbrpc.rpc_sync('worker1', torch.add, args=(x, 1))\n"
        "assert y.is_cuda and y.tolist() == [2.0] * 4, y\n"
        "m = nbrpc.remote('worker1', Scale)\n"
        "z = m.rpc_sync().forward(x)\n"
        "assert z.is_cuda and z.tolist() == [3.0] * 4, z\n"
        "print('cuda round trip ok', y.device, z.device)\n"
        "nbrpc.shutdown()\n",
        timeout=SCRIPT_S,
    )
    assert "cuda round trip ok" in out


GPU_LANES = """
import time
import torch, nbrpc

def plus(x):
    return x + 1

def make(n):
    return torch.full((n,), 2.0, device="cuda:0")

BIG = 1 << 15  # 128 KB of float32: over a lane's 64 KB, TensorPipe's CUDA channel

def late_pair(n):
    # a large CPU tensor first (the lane refuses the reply for it, not for the CUDA one),
    # then a CUDA tensor whose last write waits behind ~0.1 s of work on this thread's
    # stream: TensorPipe's send, on another stream, must wait for it
    x = torch.zeros(n, device="cuda:0")
    torch.cuda._sleep(200_000_000)
    x.fill_(3.0)
    return torch.zeros(BIG), x

cluster = nbrpc.init(n=1, gpus="auto", progress=False)
assert cluster.booted.lanes, "a GPU cluster opens lanes"
with nbrpc.record() as rec:
    assert nbrpc.rpc_sync("worker1", plus, args=(torch.ones(2),)).tolist() == [2.0, 2.0]
    y = nbrpc.rpc_sync("worker1", plus, args=(torch.ones(2, device="cuda:0"),))
    assert y.is_cuda and y.tolist() == [2.0, 2.0], y  # staged there and back
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # made on a side stream: the staging copy waits for it
        x = torch.ones(4, device="cuda:0") * 5
        y = nbrpc.rpc_sync("worker1", plus, args=(x,))
    assert y.tolist() == [6.0] * 4, y
    # an rpc_async's CUDA argument: TensorPipe (staging would hold this thread until the
    # stream drains); its reply, a CUDA tensor too, comes back through TensorPipe as well
    a = nbrpc.rpc_async("worker1", plus, args=(torch.ones(2, device="cuda:0"),)).wait()
    assert a.is_cuda and a.tolist() == [2.0, 2.0], a
    z = nbrpc.rpc_sync("worker1", make, args=(3,))
    assert z.is_cuda and z.tolist() == [2.0] * 3, z
    # an rpc_async on a GPU cluster: TensorPipe, whose streams are the call's own
    w = nbrpc.rpc_async("worker1", make, args=(5,)).wait()
    assert w.is_cuda and w.tolist() == [2.0] * 5, w
    big = nbrpc.rpc_sync("worker1", plus, args=(torch.ones(BIG, device="cuda:0"),))
    assert big.is_cuda and big.sum().item() == 2.0 * BIG
    for _ in range(2):  # a large CUDA reply: kept, fetched through TensorPipe, then TensorPipe
        b = nbrpc.rpc_sync("worker1", make, args=(BIG,))
        assert b.is_cuda and b.sum().item() == 2.0 * BIG
for _ in range(2):
    cpu, late = nbrpc.rpc_sync("worker1", late_pair, args=(1000,))
    assert late.is_cuda and late.tolist() == [3.0] * 1000, "the reply left before it was made"
routes = [(r["function"], r["route"]) for r in rec.calls if r["caller"] != "worker1"]
print("routes", routes)
plused = [r for name, r in routes if name == "plus"]
assert plused == ["lane", "lane", "lane", "tensorpipe", "tensorpipe"], plused
made = [route for name, route in routes if name == "make"]
assert made == ["lane", "tensorpipe", "lane", "tensorpipe"], made
nbrpc.shutdown()
OTHER_NAMES = ({"names": ["a"], "gpus": "auto"}, {"names": ["b"], "device_maps": {"b": {0: 0}}})
for asked in OTHER_NAMES:  # names the first join did not map
    t0 = time.monotonic()
    try:
        nbrpc.init(n=1, progress=False, **asked)
    except nbrpc.ConfigError as refused:
        print("refused in", round(time.monotonic() - t0, 2), "s:", refused)
    else:
        raise AssertionError(f"{asked} was not refused")
nbrpc.init(n=1, gpus="auto", progress=False)  # what the first join fixed still works
assert nbrpc.rpc_sync("worker1", make, args=(2,)).is_cuda
nbrpc.shutdown()
print("gpu lanes ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpu_cluster_stages_small_cuda_tensors_on_lanes_and_large_ones_take_tensorpipe(
    tmp_path,
):
    out = run_script(tmp_path / "gpu_lanes.py", GPU_LANES, timeout=SCRIPT_S)
    assert "gpu lanes ok" in out
    refusals = [line for line in out.splitlines() if line.startswith("refused")]
    assert len(refusals) == 2, out
    assert "needs other maps to a." in refusals[0]
    assert "needs other maps to b." in refusals[1]


CPU_GPU_CPU = """
import os, shutil, subprocess
import torch, nbrpc
import torch.distributed.autograd as dist_autograd
from nbrpc import _group
from nbrpc._wire import lanes

def plus(x):
    return x + 1

def make(n):
    return torch.full((n,), 2.0, device="cuda:0")

class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(8, 8).to("cuda:0")

    def forward(self, x):
        return self.l(x.to("cuda:0"))

def cuda_up():
    return torch.cuda.is_initialized()

def holds_a_context(pid):
    # the driver's own list of the processes with a CUDA context (None: no nvidia-smi)
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    return str(pid) in subprocess.run(query, capture_output=True, text=True).stdout.split()

nbrpc.init(n=2, progress=False)
assert nbrpc.rpc_sync("worker1", plus, args=(torch.ones(2),)).tolist() == [2.0, 2.0]
assert not torch.cuda.is_initialized(), "a CPU cluster first: CUDA stays down in the kernel"
# the driver's view, judged by the test after the whole script: TensorPipe's CUDA
# channels, which the first join sets up for the GPU clusters after it, must not make one
print("the kernel holds a CUDA context after a CPU cluster:", holds_a_context(os.getpid()))
nbrpc.shutdown()
for turn in range(2):
    nbrpc.init(n=2, gpus="auto", progress=False)
    x = torch.ones(4, device="cuda:0")
    y = nbrpc.rpc_sync("worker2", plus, args=(x,))  # small: staged on a lane
    assert y.is_cuda and y.tolist() == [2.0] * 4, y
    lanes.pause(True)  # TensorPipe, device to device
    y = nbrpc.rpc_sync("worker1", torch.add, args=(x, 1))
    assert y.is_cuda and y.tolist() == [2.0] * 4, y
    big = nbrpc.rpc_sync("worker1", plus, args=(torch.ones(1 << 20, device="cuda:0"),))
    assert big.is_cuda and big.sum().item() == 2.0 * (1 << 20)
    z = nbrpc.rpc_sync("worker2", make, args=(3,))
    assert z.is_cuda and z.tolist() == [2.0] * 3, z
    m = nbrpc.remote("worker1", Lin)
    inp = torch.arange(16.0, device="cuda:0").reshape(2, 8).requires_grad_()
    with dist_autograd.context() as ctx:
        out = m.rpc_sync().forward(inp)
        dist_autograd.backward(ctx, [out.sum()])
        got = dist_autograd.get_gradients(ctx)[inp]
    ref = inp.detach().clone().requires_grad_()
    Lin()(ref).sum().backward()
    assert torch.allclose(got, ref.grad), (got, ref.grad)
    lanes.pause(False)
    del m
    nbrpc.shutdown()
    nbrpc.init(n=2, progress=False)
    assert _group.cuda_devices() == (), "a CPU cluster: the kernel lends no device"
    assert nbrpc.rpc_sync("worker1", plus, args=(torch.ones(2),)).tolist() == [2.0, 2.0]
    assert not nbrpc.rpc_sync("worker2", cuda_up), "its workers start no CUDA"
    expect_refused(plus, torch.ones(2, device="cuda:0"))
    nbrpc.shutdown()
    print("turn", turn, "ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_one_kernel_goes_from_a_cpu_cluster_to_a_gpu_one_and_back_without_a_restart(tmp_path):
    """CPU, GPU, CPU, GPU, CPU with the default names: device to device (lanes, TensorPipe,
    a backward against a local reference) in the GPU clusters; no CUDA in the kernel
    until the first GPU cluster, none in a CPU cluster's workers, and a CUDA tensor sent
    to a CPU cluster refused with the line that says what to do."""
    out = run_script(tmp_path / "cpu_gpu_cpu.py", EXPECT_REFUSED + CPU_GPU_CPU, timeout=SCRIPT_S)
    assert "turn 0 ok" in out, out
    assert "turn 1 ok" in out, out
    assert out.count("refused: this cluster has no device maps") == 2, out
    # nvidia-smi's list of processes with a context (None where it is missing)
    assert "the kernel holds a CUDA context after a CPU cluster: True" not in out, out


GPU_REPLIES = """
import torch, nbrpc

def make(n):
    return torch.full((n,), 2.0, device="cuda:0")

def ask(dest, n):  # on a worker: another process replies with a CUDA tensor
    t = nbrpc.rpc_sync(dest, make, args=(n,))
    return t.is_cuda and t.tolist() == [2.0] * n

def every_way(when):
    names = nbrpc.workers()
    for a in names[1:]:
        for b in names:
            if a != b:
                assert nbrpc.rpc_sync(a, ask, args=(b, 3)), f"{when}: {a} asked {b}"
    print(when, "ok", names, flush=True)

nbrpc.init(n=2, gpus="auto", progress=False)
every_way("boot")
nbrpc.restart("worker1")
every_way("restart")
nbrpc.scale(1)
every_way("shrink")
nbrpc.shutdown()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_every_process_replies_with_cuda_tensors_to_every_other_after_a_restart_and_a_shrink(
    tmp_path,
):
    """torch's dynamic group never tells a member how to reply to a later joiner, and a
    leave drops every member's devices and reply maps: nbrpc gives them back
    (``_setup.device_replies``). Each worker asks each other process for a CUDA tensor."""
    out = run_script(tmp_path / "gpu_replies.py", GPU_REPLIES, timeout=SCRIPT_S)
    for when in ("boot", "restart", "shrink"):
        assert f"{when} ok" in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_device_map_by_hand_alone_lets_the_worker_receive_cuda_tensors(tmp_path):
    """--device-map names the kernel's maps only: the worker still joins with the device
    the kernel sends to (``_devices.joining_devices``), so CUDA is up there and
    TensorPipe has its CUDA channels (a large tensor takes them; a small one is staged)."""
    out = run_script(
        tmp_path / "by_hand.py",
        "import torch, nbrpc\n"
        "nbrpc.init(n=1, device_maps={'worker1': {'cuda:0': 'cuda:0'}}, progress=False)\n"
        "x = torch.ones(3, device='cuda:0')\n"
        "y = nbrpc.rpc_sync('worker1', torch.add, args=(x, 1))\n"  # staged on a lane
        "print('by hand', y.device, y.tolist())\n"
        "big = torch.ones(1 << 15, device='cuda:0')\n"  # TensorPipe's CUDA channel
        "z = nbrpc.rpc_sync('worker1', torch.add, args=(big, 1))\n"
        "print('by hand, large', z.device, z.sum().item())\n"
        "nbrpc.shutdown()\n",
        timeout=SCRIPT_S,
    )
    assert "by hand cuda:0 [2.0, 2.0, 2.0]" in out, out
    assert f"by hand, large cuda:0 {2.0 * (1 << 15)}" in out, out


GPU_STREAMS = """
import torch, nbrpc

SLEEP = 200_000_000  # ~0.1 s of GPU work on an H200

def late(n):  # written after GPU work on the callee's stream
    x = torch.zeros(n, device="cuda:0")
    torch.cuda._sleep(SLEEP)
    x.fill_(3.0)
    return x

def then(fut):
    value = fut.wait()
    seen = value.sum().item()
    torch.cuda._sleep(SLEEP)  # then an in-place write, ~0.1 s later on the GPU
    value.fill_(7.0)
    return value, seen

nbrpc.init(n=1, gpus="auto", progress=False)
side = torch.cuda.Stream()
with nbrpc.record() as rec:
    for n in (1000, 1 << 15):
        for stream in (torch.cuda.current_stream(), side):
            child = nbrpc.rpc_async("worker1", late, args=(n,)).then(then)
            with torch.cuda.stream(stream):
                value, seen = child.wait()
                got = value.sum().item()
            assert seen == 3.0 * n, ("the callback saw the reply unwritten", seen / n)
            assert got == 7.0 * n, ("the waiter's stream ran before the callback's", got / n)
routes = {r["route"] for r in rec.calls if r["caller"] != "worker1"}
assert routes == {"tensorpipe"}, routes
nbrpc.shutdown()
print("gpu streams ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_then_callback_s_gpu_work_is_finished_on_the_waiter_s_stream(tmp_path):
    """Issue 63's risks 1 and 5: an rpc_async on a GPU cluster goes through TensorPipe
    (each call on streams of its own), and its future is CUDA-aware: a ``then`` callback
    sees the reply written, and its in-place write, queued behind 0.1 s of GPU work, is
    what a waiter reads on the default stream or on a side stream."""
    out = run_script(tmp_path / "gpu_streams.py", GPU_STREAMS, timeout=SCRIPT_S)
    assert "gpu streams ok" in out, out
