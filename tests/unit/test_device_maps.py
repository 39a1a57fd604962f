"""Device maps without a worker: parsing, planning ``--gpus auto``, checking a map
against every process's devices, and where replies go (``nbrpc._devices``)."""

import pytest

from nbrpc import _devices
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
