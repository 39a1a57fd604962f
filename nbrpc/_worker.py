"""Code that runs inside a worker (an ipyparallel engine), sent there by the cluster.

Every function here is importable by name, so ipyparallel ships a reference, not code.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

__all__ = [
    "configure_fast_path",
    "describe_process",
    "destroy_process_group",
    "host_entry",
    "init_process_group",
    "join",
    "leave",
    "share_memory",
]


def describe_process() -> dict[str, Any]:
    """What the notebook shows about a worker process: pid, host, devices, versions."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "devices": ["cpu"] + [f"cuda:{i}" for i in range(cuda)],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cwd": os.getcwd(),
    }


def join(
    name: str,
    rank: int,
    store: dict,
    kernel: str,
    rpc_timeout: float,
    num_worker_threads: int,
    device_maps: dict | None = None,
    devices: list[str] | None = None,
) -> dict[str, Any]:
    """Join the notebook's RPC group as ``name``; return this process's description."""
    from . import _agent, _debugger, _group, _remote, _torch
    from ._errors import BootError

    _torch.quiet_internal_deprecations()  # the optimizer's TorchScript notice, see there
    _agent.install()
    spec = _group.StoreSpec(**store)
    if spec.kind == "file" and not os.path.exists(os.path.dirname(spec.path)):
        raise BootError(
            f"worker {name} on {socket.gethostname()} cannot see the kernel's store "
            f"{spec.path}: it runs on another host. Start the cluster with --listen ADDR "
            "(an address of the kernel's host that this host reaches), so the kernel's store "
            "and RPC endpoint listen there."
        )
    _remote.forward_output_to(kernel, name)
    _debugger.install()  # breakpoint() opens pdb in the calling cell
    _group.join(
        name,
        rank,
        spec,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps,
        devices=devices,
    )
    _agent.set_active(True)  # code running here may call nbrpc.rpc_sync & co. too
    info = describe_process()
    info.update(name=name, rank=rank)
    return info


def host_entry() -> str | None:
    """The ``--hosts`` entry this engine was started for (None: a local engine)."""
    return os.environ.get("NBRPC_HOST_ENTRY")


def share_memory(prefix: str, name: str, threshold: int, step: str) -> list[str]:
    """One step of probing which processes share this one's ``/dev/shm`` (across hosts).

    ``probe``: leave a probe file; ``configure``: the peers whose probes are visible
    here get the fast path (none: off); ``done``: remove this process's probe.
    """
    from . import _shm

    mark = f"{prefix}-probe-"
    path = os.path.join(_shm.SHM_DIR, mark + name)
    if step == "probe":
        with open(path, "w"):
            pass
        return []
    if step == "configure":
        try:
            seen = [e[len(mark) :] for e in os.listdir(_shm.SHM_DIR) if e.startswith(mark)]
        except OSError:
            seen = []
        peers = sorted(n for n in seen if n != name)
        _shm.configure(prefix, threshold if peers else None, peers)
        return peers if _shm.enabled() else []
    if os.path.exists(path):
        os.unlink(path)
    return []


def configure_fast_path(prefix: str, threshold: int | None, probe: str) -> bool:
    """Use shared memory for large tensors if this process sees the kernel's ``probe``
    segment (the same host and the same ``/dev/shm``); returns whether it is on."""
    from . import _shm

    same_memory = threshold is not None and os.path.exists(probe)
    _shm.configure(prefix, threshold if same_memory else None)
    return _shm.enabled()


def init_process_group(
    backend: str, store: dict, prefix: str, rank: int, world_size: int, timeout_s: float
) -> dict[str, Any]:
    """Join the workers' torch.distributed process group (see :mod:`nbrpc._collective`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from . import _group, _torch
    from ._errors import ConfigError

    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            f"--process-group nccl needs a CUDA device in every member; this worker on "
            f"{socket.gethostname()} has none. Use --process-group gloo (CPU tensors)."
        )
    spec = _group.StoreSpec(**store)
    ifname = spec.interface()
    if ifname:  # gloo listens where TensorPipe does: loopback for a local cluster
        os.environ[_torch.GLOO_SOCKET_IFNAME] = ifname
    base = spec.open(is_master=False, timeout_s=timeout_s)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, base),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def leave(timeout: float = 0) -> None:
    """Leave the group gracefully; the engine itself keeps running."""
    from . import _group

    _group.leave(timeout)
