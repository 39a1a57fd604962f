"""Device maps: parsing, planning and checking (pure), and the CPU-only refusal for real."""

import time

import psutil
import pytest
import torch
from conftest import ensure_cluster, run_script

import nbrpc
from nbrpc import _devices, _group
from nbrpc._errors import DeviceMapError

TWO_GPU_HOST = {"worker0": ["cpu", "cuda:0", "cuda:1"], "worker1": ["cpu", "cuda:0", "cuda:1"]}
HOSTS = {"worker0": "a", "worker1": "a", "worker2": "b"}


def test_parse_device_map():
    assert _devices.parse_device_map("worker1=cuda:0->cuda:1") == ("worker1", {"cuda:0": "cuda:1"})
    assert _devices.parse_device_map("ps = 0->1, 1->0") == (
        "ps",
        {"cuda:0": "cuda:1", "cuda:1": "cuda:0"},
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("worker1", "write WORKER=LOCAL->REMOTE"),
        ("worker1=cuda:0", "is not LOCAL->REMOTE"),
        ("worker1=cpu->cuda:0", "CPU tensors need no device map"),
        ("worker1=cuda->cuda:1", "name the index"),
        ("worker1=gpu0->cuda:1", "not a CUDA device"),
        ("worker1=0->1,0->0", "mapped twice"),
    ],
)
def test_parse_refuses_bad_syntax(text, match):
    with pytest.raises(DeviceMapError, match=match):
        _devices.parse_device_map(text)


def test_plan_gpus_round_robin_per_host_and_maps_between_all_pairs():
    devices = {
        "worker0": ["cpu", "cuda:0", "cuda:1"],
        "worker1": ["cpu", "cuda:0", "cuda:1"],
        "worker2": ["cpu", "cuda:0"],
    }
    chosen, maps = _devices.plan_gpus(devices, HOSTS)
    assert chosen == {"worker0": ["cuda:0"], "worker1": ["cuda:1"], "worker2": ["cuda:0"]}
    assert maps["worker0"] == {"worker1": {"cuda:0": "cuda:1"}, "worker2": {"cuda:0": "cuda:0"}}
    assert maps["worker1"]["worker0"] == {"cuda:1": "cuda:0"}
    assert set(maps["worker2"]) == {"worker0", "worker1"}
    _devices.validate(maps, devices, HOSTS)  # a plan always passes its own check


def test_plan_gpus_with_one_gpu_shares_it():
    devices = {"worker0": ["cpu", "cuda:0"], "worker1": ["cpu", "cuda:0"]}
    chosen, maps = _devices.plan_gpus(devices, {"worker0": "a", "worker1": "a"})
    assert chosen == {"worker0": ["cuda:0"], "worker1": ["cuda:0"]}
    assert maps == {
        "worker0": {"worker1": {"cuda:0": "cuda:0"}},
        "worker1": {"worker0": {"cuda:0": "cuda:0"}},
    }


def test_plan_gpus_names_the_process_without_one():
    with pytest.raises(DeviceMapError, match=r"--gpus auto: worker1 on a has no CUDA device"):
        _devices.plan_gpus({"worker0": ["cpu", "cuda:0"], "worker1": ["cpu"]}, HOSTS)


@pytest.mark.parametrize(
    ("maps", "match"),
    [
        ({"worker0": {"worker9": {"cuda:0": "cuda:0"}}}, "no worker named 'worker9'"),
        ({"worker0": {"worker0": {"cuda:0": "cuda:0"}}}, "to itself"),
        (
            {"worker0": {"worker1": {"cuda:0": "cuda:2"}}},
            r"worker1 has no cuda:2; worker1 has cpu, cuda:0, cuda:1",
        ),
        ({"worker0": {"worker1": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}}, "both map to cuda:1"),
    ],
)
def test_validate_names_the_worker_and_the_device(maps, match):
    with pytest.raises(DeviceMapError, match=match):
        _devices.validate(maps, TWO_GPU_HOST, HOSTS)


def test_validate_on_a_cpu_only_process_says_so():
    with pytest.raises(DeviceMapError, match="worker0 on a has no CUDA device at all"):
        _devices.validate(
            {"worker0": {"worker1": {"cuda:0": "cuda:0"}}},
            {"worker0": ["cpu"], "worker1": ["cpu"]},
            HOSTS,
        )


def test_inverse_is_where_replies_go():
    maps = {"worker0": {"worker1": {"cuda:0": "cuda:1"}}}
    assert _devices.inverse(maps) == {"worker1": {"worker0": {"cuda:1": "cuda:0"}}}
    assert _devices.describe(maps) == [
        "worker0 -> worker1: cuda:0->cuda:1   (replies worker1 -> worker0: cuda:1->cuda:0)"
    ]


def test_merge_refuses_conflicting_maps():
    assert _devices.merge("worker0", [("worker1", {0: 1})]) == {
        "worker0": {"worker1": {"cuda:0": "cuda:1"}}
    }
    with pytest.raises(DeviceMapError, match="mapped to both"):
        _devices.merge("worker0", [("worker1", {0: 1}), ("worker1", {"cuda:0": "cuda:0"})])


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
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
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
