"""The network under a process's membership in the RPC group: where its sockets listen,
and what TensorPipe carries bytes with.

Everything listens on loopback unless ``--listen`` names one of this host's addresses
(:func:`interface_for` refuses one it lacks before anything starts); TensorPipe's sockets
listen on one interface, loopback or the one routed towards the kernel's address
(:func:`interface_toward`, :func:`tensorpipe_interface`). Its transports and channels are
only those a cluster uses, each choice measured (the notes at :data:`DEFAULT_TRANSPORTS`
and :data:`LOCAL_CHANNELS`); ``NBRPC_TENSORPIPE_TRANSPORTS`` and
``NBRPC_TENSORPIPE_CHANNELS`` override them. Kept apart from :mod:`nbrpc._group`, which
joins with these choices, so that module holds the membership and its store.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
from collections.abc import Iterator
from typing import Any

from . import _torch
from ._errors import ConfigError

#: how options spell this host's loopback (:func:`is_loopback` takes the rest of 127/8 too)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(address: str) -> bool:
    """``address`` (a name or an IP) is this host's loopback: no other host reaches it."""
    return address in LOOPBACK or address.startswith("127.")


def interface_for(address: str, if_addrs: dict[str, list[Any]] | None = None) -> str:
    """The name of this host's network interface that holds ``address``.

    ``if_addrs``: ``psutil.net_if_addrs()``-shaped (injectable for tests). Raises
    ``ValueError`` naming the addresses this host has, so a typo in ``--listen`` is
    caught before anything starts.
    """
    if if_addrs is None:
        import psutil

        if_addrs = psutil.net_if_addrs()
    held = []
    for name, addrs in if_addrs.items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                if a.address.split("%")[0] == address:
                    return name
                held.append(f"{name} {a.address}")
    raise ConfigError(
        f"--listen {address}: no network interface of this host ({socket.gethostname()}) has "
        f"that address. It has: {', '.join(held) or 'none'}. Give the address that the other "
        "hosts reach this one at."
    )


def interface_toward(peer: str) -> str:
    """The interface this host uses to reach ``peer`` (the kernel's ``--listen`` address).

    On the kernel's host that is the interface holding ``peer`` itself; on a worker's
    host, the one its routing table picks. No packet is sent (a UDP "connect" only
    selects the route).
    """
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        local = s.getsockname()[0]
    return interface_for(local)


@contextlib.contextmanager
def tensorpipe_interface(ifname: str | None) -> Iterator[None]:
    """Make TensorPipe's socket transport listen on one interface (``None``: its default).

    TensorPipe reads ``TP_SOCKET_IFNAME`` when the agent is created; the variable is set
    for that moment only, so the kernel's environment is left as it was.
    """
    if ifname is None:
        yield
        return
    old = os.environ.get(_torch.TP_SOCKET_IFNAME)
    os.environ[_torch.TP_SOCKET_IFNAME] = ifname
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_torch.TP_SOCKET_IFNAME, None)
        else:
            os.environ[_torch.TP_SOCKET_IFNAME] = old


#: TensorPipe transports nbrpc asks for. Not torch's default ("shm" first): its shared-memory
#: reactor thread polls without sleeping, one core per process, idle or not. Measured here
#: with a kernel and 2 workers on 2 cores: 60–70 % CPU per idle process with "shm", 0 % with
#: "uv"; small calls took the same time either way (914 vs 943 µs), large tensors go by the
#: "cma" channel (one copy) or nbrpc's own shared memory. Experts can ask for torch's choice
#: with NBRPC_TENSORPIPE_TRANSPORTS=shm,uv in every process's environment.
DEFAULT_TRANSPORTS = ("uv",)
#: torch's choice, taken where CUDA tensors travel and cores are to spare
#: (:func:`transports_for`): a CUDA tensor's pipe sends small control messages the CUDA
#: channel waits on, and "shm" carries those faster (measured on an H200 with torch 2.11:
#: the seed-004 tutorial 1.06x the plain script against 1.46x with "uv", a 64 MB CUDA
#: round trip 1.02x against 1.30x)
CUDA_TRANSPORTS = ("shm", "uv")
#: cores per process of the cluster on a host that "shm" asks for: its reactor thread's
#: one, and one to compute
SHM_CORES_PER_PROCESS = 2


def transports(asked: list[str] | None = None) -> list[str]:
    """What the environment asks for (``NBRPC_TENSORPIPE_TRANSPORTS``), else ``asked``
    (:func:`transports_for`'s choice), else the default."""
    return _listed("NBRPC_TENSORPIPE_TRANSPORTS") or list(asked or DEFAULT_TRANSPORTS)


def transports_for(cuda: bool, processes: int, cores: int | None = None) -> list[str]:
    """The transports a cluster's processes join with: torch's choice ("shm" first) when
    CUDA tensors travel (``cuda``) and this host has :data:`SHM_CORES_PER_PROCESS` cores
    for each of the cluster's ``processes`` on it (``cores``: this process's usable ones
    if not said), else "uv" alone (idle processes use no CPU). The environment's
    ``NBRPC_TENSORPIPE_TRANSPORTS`` wins. The kernel's are fixed at its first join."""
    if _listed("NBRPC_TENSORPIPE_TRANSPORTS"):
        return transports()
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if cuda and cores >= SHM_CORES_PER_PROCESS * processes:
        return list(CUDA_TRANSPORTS)
    return list(DEFAULT_TRANSPORTS)


#: TensorPipe channels nbrpc asks for (how a tensor's bytes travel once a pipe is open),
#: only those a cluster uses. torch's default also registers "mpt_uv", which listens on 16
#: lanes of its own: a local worker listened on 18 TCP ports, each a door a stray
#: connection could reach (TensorPipe aborts on malformed input), for a channel a local
#: cluster never picks: "cma" (one copy between processes of one host, same user) wins, and
#: "basic" (through the pipe's own connection) needs no port either. Across hosts "mpt_uv"
#: is the one used for large tensors (its lanes run in parallel: 64 MB round trips 94-97 ms
#: against 101-103 ms with "basic" alone, between fake hosts here), and the member filter
#: guards its ports (nbrpc._fence): it stays there.
LOCAL_CHANNELS = ("cma", "basic")
ACROSS_HOSTS_CHANNELS = ("mpt_uv", "cma", "basic")
#: with CUDA tensors: device to device on one host ("cuda_ipc"), staged through the CPU
#: between hosts ("cuda_basic")
CUDA_CHANNELS = ("cuda_ipc", "cuda_basic")


def channels(cuda: bool, across_hosts: bool) -> list[str]:
    """The channels this process asks for (``NBRPC_TENSORPIPE_CHANNELS`` overrides):
    "cuda_ipc" only where it can start (:func:`cuda_ipc_can_start`)."""
    listed = _listed("NBRPC_TENSORPIPE_CHANNELS")
    if listed:
        return listed
    # (asked only for CUDA: the lookup starts the CUDA driver, which a CPU process skips)
    if not cuda:
        return list(ACROSS_HOSTS_CHANNELS if across_hosts else LOCAL_CHANNELS)
    cuda_channels = [c for c in CUDA_CHANNELS if c != "cuda_ipc" or cuda_ipc_can_start()]
    return [
        *cuda_channels,
        *(ACROSS_HOSTS_CHANNELS if across_hosts else LOCAL_CHANNELS),
    ]


@functools.cache
def cuda_ipc_can_start() -> bool:
    """Whether TensorPipe's "cuda_ipc" channel can start in this process.

    Its context, built when the process joins, looks up each GPU that CUDA shows in
    NVML's list of the host's GPUs by UUID, and throws where one is missing: under MIG
    (CUDA shows ``MIG-`` instances NVML does not list), or where a container hides NVML's
    GPUs (pytorch/pytorch#95487). Then the join itself fails, for a CPU cluster too,
    since the kernel's first join registers the CUDA channels for the GPU clusters after
    it. This makes the same lookup first (NVML and the CUDA driver, without a CUDA
    context); where it would fail, CUDA tensors take "cuda_basic" (through host memory)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False  # TensorPipe finds none either: the channel is simply not viable
    try:
        return set(cuda_uuids()) <= set(nvml_uuids(nvml))
    except Exception:
        return False


def _checked(lib: Any, function: str, *args: Any) -> None:
    """``lib.function(*args)``, a C call of NVML or the CUDA driver that returns 0 on
    success; OSError naming it otherwise."""
    if getattr(lib, function)(*args) != 0:
        raise OSError(f"{function} failed")


def nvml_uuids(nvml: Any) -> list[str]:
    """The UUIDs of every GPU NVML lists (``GPU-`` dropped), as TensorPipe reads them."""
    _checked(nvml, "nvmlInit_v2")
    try:
        count = ctypes.c_uint()
        _checked(nvml, "nvmlDeviceGetCount_v2", ctypes.byref(count))
        uuids = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            _checked(nvml, "nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle))
            buf = ctypes.create_string_buffer(96)
            _checked(nvml, "nvmlDeviceGetUUID", handle, buf, len(buf))
            uuids.append(buf.value.decode().removeprefix("GPU-"))
        return uuids
    finally:
        nvml.nvmlShutdown()


def cuda_uuids() -> list[str]:
    """The UUIDs of the GPUs CUDA shows this process (the driver's API: no context)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    _checked(cuda, "cuInit", 0)
    count = ctypes.c_int()
    _checked(cuda, "cuDeviceGetCount", ctypes.byref(count))
    uuids = []
    for index in range(count.value):
        device = ctypes.c_int()
        raw = ctypes.create_string_buffer(16)
        _checked(cuda, "cuDeviceGet", ctypes.byref(device), index)
        _checked(cuda, "cuDeviceGetUuid", raw, device)
        uuids.append(uuid_text(raw.raw))
    return uuids


def uuid_text(raw: bytes) -> str:
    """A CUDA UUID's 16 bytes as NVML writes them: ``8-4-4-4-12`` lowercase hex digits."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _listed(variable: str) -> list[str]:
    return [t.strip() for t in os.environ.get(variable, "").split(",") if t.strip()]


def loopback_ifname() -> str:
    """The name of this host's loopback interface (``lo`` on Linux)."""
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"
