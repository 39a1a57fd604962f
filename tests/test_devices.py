"""Device maps: parsing, planning and checking (pure), and the CPU-only refusal for real."""

import time

import psutil
import pytest
import torch
from conftest import ensure_cluster, run_script, running

import nbrpc
from nbrpc import _group
from nbrpc._errors import DeviceMapError


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
        timeout=300,
    )
    assert "cuda round trip ok" in out
