"""Device maps without a worker: parsing, planning ``--gpus auto``, checking a map
against every process's devices, and where replies go (``nbrpc._devices``)."""

import ctypes
import shutil
import subprocess

import pytest
from conftest import load_tool

from nbrpc import _devices
from nbrpc._errors import ConfigError, DeviceMapError

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


FIXED = {"worker1": {"cuda:0": "cuda:0"}, "worker2": {"cuda:0": "cuda:0"}}


@pytest.mark.parametrize(
    ("fixed", "gpus", "by_hand", "names", "match"),
    [
        # a kernel that joined without maps (no CUDA device then): no GPU cluster, and the
        # line says what works
        ({}, "auto", {}, ["worker1"], r"without device maps .* start CPU clusters"),
        ({}, None, {"worker0": {"worker1": {"cuda:0": "cuda:0"}}}, ["worker1"], "without"),
        # maps to names the first join did not map, or other maps to the same names
        (FIXED, "auto", {}, ["worker1", "worker2", "worker3"], r"other maps to worker3\. "),
        (FIXED, "auto", {}, ["a", "b"], r"other maps to a, b\. Start a GPU cluster of names"),
        (FIXED, None, {"worker0": {"worker1": {"cuda:0": "cuda:1"}}}, None, "maps to worker1"),
        (
            FIXED,
            "auto",
            {"worker0": {"worker2": {"cuda:0": "cuda:1"}}},
            ["worker1", "worker2"],
            r"worker1: cuda:0->cuda:0, worker2: cuda:0->cuda:0\) were fixed",
        ),
    ],
)
def test_what_the_kernels_first_join_fixed_is_refused_before_anything_starts(
    fixed, gpus, by_hand, names, match
):
    with pytest.raises(ConfigError, match=match):
        _devices.check_fixed(fixed, "worker0", gpus, by_hand, names)


@pytest.mark.parametrize(
    ("fixed", "gpus", "by_hand", "names"),
    [
        (None, "auto", {}, ["worker1"]),  # no join yet: the first one chooses
        ({}, None, {}, ["worker1", "worker2", "worker3"]),  # CPU after CPU, any size
        (FIXED, None, {}, ["worker1", "worker2", "worker3"]),  # CPU after GPU, any size
        (FIXED, "auto", {}, ["worker2", "worker1"]),  # GPU after GPU, the same names
        (FIXED, "auto", {}, ["worker1"]),  # fewer of them
        (FIXED, "auto", {}, None),  # names known later: the maps are compared then
        (FIXED, None, {"worker0": FIXED}, None),  # the same maps by hand
        (FIXED, None, {"worker0": {"worker2": FIXED["worker2"]}}, None),  # one of them
    ],
)
def test_what_the_kernels_first_join_allows_goes_on(fixed, gpus, by_hand, names):
    _devices.check_fixed(fixed, "worker0", gpus, by_hand, names)


def test_a_kernel_on_a_gpu_host_prepares_the_maps_gpus_auto_plans_for_the_default_names():
    """What a first join maps whatever its cluster: the maps a later ``--gpus auto``
    cluster of the default names on this host plans, so the kernel can move from a CPU
    cluster to a GPU one."""
    one = _devices.prepared_maps(["cpu", "cuda:0"], 3)
    assert one == {f"worker{i}": {"cuda:0": "cuda:0"} for i in (1, 2, 3)}
    two = _devices.prepared_maps(["cpu", "cuda:0", "cuda:1"], 3)
    assert two == {
        "worker1": {"cuda:0": "cuda:1"},
        "worker2": {"cuda:0": "cuda:0"},
        "worker3": {"cuda:0": "cuda:1"},
    }
    assert _devices.prepared_maps(["cpu"], 16) == {}  # a host without CUDA: no maps
    assert _devices.prepared_maps(["cpu", "cuda:0"], 0) == {}  # turned off
    for gpus in (["cuda:0"], ["cuda:0", "cuda:1"], ["cuda:0", "cuda:1", "cuda:2"]):
        names = ["worker0", "worker1", "worker2", "worker3", "worker4"]
        _, planned = _devices.plan_gpus({n: gpus for n in names}, {n: "h" for n in names})
        prepared = _devices.prepared_maps(gpus, 4)
        assert planned["worker0"] == prepared, gpus  # a later --gpus auto cluster fits
        assert _devices.unfixed(prepared, planned["worker0"]) == []


def test_a_later_clusters_maps_must_each_be_one_the_first_join_fixed():
    assert _devices.unfixed(FIXED, {}) == []
    assert _devices.unfixed(FIXED, {"worker2": {"cuda:0": "cuda:0"}}) == []
    assert _devices.unfixed(FIXED, {"worker2": {"cuda:0": "cuda:1"}}) == ["worker2"]
    assert _devices.unfixed(FIXED, {"b": {}, "a": {"cuda:0": "cuda:0"}}) == ["a", "b"]


def test_a_refusal_names_the_first_maps_and_counts_the_rest():
    fixed = _devices.prepared_maps(["cuda:0"], 16)
    with pytest.raises(ConfigError) as refused:
        _devices.check_fixed(fixed, "worker0", "auto", {}, ["a"])
    line = str(refused.value)
    assert (
        "worker1: cuda:0->cuda:0, worker2: cuda:0->cuda:0, worker3: cuda:0->cuda:0 and 13 more"
        in line
    )
    assert "\n" not in line


def test_a_cuda_cluster_with_cores_to_spare_takes_torchs_transports(monkeypatch):
    from nbrpc import _network

    monkeypatch.delenv("NBRPC_TENSORPIPE_TRANSPORTS", raising=False)
    # 16 cores, a kernel and one worker: "shm" (its reactor polls a core per process)
    assert _network.transports_for(True, 2, cores=16) == ["shm", "uv"]
    assert _network.transports_for(True, 8, cores=16) == ["shm", "uv"]
    assert _network.transports_for(True, 9, cores=16) == ["uv"]  # not 2 cores each
    assert _network.transports_for(True, 3, cores=2) == ["uv"]  # this machine's kind
    assert _network.transports_for(False, 1, cores=64) == ["uv"]  # CPU tensors: "uv"
    monkeypatch.setenv("NBRPC_TENSORPIPE_TRANSPORTS", "uv,shm")
    assert _network.transports_for(True, 2, cores=16) == ["uv", "shm"]  # the user's word wins
    assert _network.transports_for(False, 2, cores=2) == ["uv", "shm"]


def test_a_worker_joins_with_the_devices_maps_send_to_it():
    # by hand: the kernel's maps only; each worker must still join with the device the
    # kernel sends to (else it starts neither CUDA nor TensorPipe's CUDA channels)
    by_hand = {"worker0": {"worker1": {"cuda:0": "cuda:1"}, "worker2": {"cuda:1": "cuda:0"}}}
    assert _devices.joining_devices("worker1", by_hand, {}) == ["cuda:1"]
    assert _devices.joining_devices("worker2", by_hand, {}) == ["cuda:0"]
    assert _devices.joining_devices("worker3", by_hand, {}) is None  # nothing sent to it
    two = {"a": {"w": {"cuda:0": "cuda:10", "cuda:1": "cuda:2"}}, "b": {"w": {"cuda:0": "cuda:2"}}}
    assert _devices.joining_devices("w", two, {}) == ["cuda:2", "cuda:10"]
    # --gpus auto chose one GPU per process: that one
    chosen, maps = _devices.plan_gpus(
        {"worker0": ["cpu", "cuda:0", "cuda:1"], "worker1": ["cpu", "cuda:0", "cuda:1"]},
        {"worker0": "h", "worker1": "h"},
    )
    assert _devices.joining_devices("worker1", maps, chosen) == ["cuda:1"] == chosen["worker1"]
    assert _devices.joining_devices("worker1", maps, {}) == ["cuda:1"]  # a restart's: the same
    assert _devices.joining_devices("worker1", {}, {}) is None  # a CPU cluster


def test_cuda_ipc_is_asked_for_only_where_its_context_can_start(monkeypatch, tmp_path):
    """TensorPipe's "cuda_ipc" looks up each GPU CUDA shows in NVML's list by UUID when a
    process joins, and throws where one is missing (MIG, some containers): the join fails,
    a CPU cluster's too. nbrpc makes the lookup first; on an H200 host with a stand-in NVML
    that lists another GPU (tools/gpu_risks.py nvml) the clusters then ran on cuda_basic."""
    from nbrpc import _network

    monkeypatch.delenv("NBRPC_TENSORPIPE_CHANNELS", raising=False)
    assert _network.uuid_text(bytes(range(16))) == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    for listed, channels in ((True, ["cuda_ipc", "cuda_basic"]), (False, ["cuda_basic"])):
        monkeypatch.setattr(_network, "cuda_ipc_can_start", lambda listed=listed: listed)
        assert _network.channels(True, False) == [*channels, "cma", "basic"]
        assert _network.channels(False, False) == ["cma", "basic"]

    def never():
        raise AssertionError("a CPU process started the CUDA driver to choose")

    monkeypatch.setattr(_network, "cuda_ipc_can_start", never)
    assert _network.channels(False, True) == ["mpt_uv", "cma", "basic"]
    monkeypatch.setenv("NBRPC_TENSORPIPE_CHANNELS", "cuda_ipc,basic")
    assert _network.channels(True, False) == ["cuda_ipc", "basic"]  # the user's word, unasked
    monkeypatch.delenv("NBRPC_TENSORPIPE_CHANNELS")
    # a stand-in NVML (no GPU listed), loaded as TensorPipe loads it; no CUDA here either
    lib = tmp_path / "libnvidia-ml.so.1"
    fake = tmp_path / "nvml.c"
    fake.write_text(load_tool("gpu_risks").fake_nvml(uuid=None))
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in NVML")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(fake)], check=True)
    nvml = ctypes.CDLL(str(lib))
    assert _network.nvml_uuids(nvml) == []
