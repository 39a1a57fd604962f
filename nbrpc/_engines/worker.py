"""What runs inside an engine to make it a worker: describe it, join the group, leave.

The boot sends these with ipyparallel's ``apply`` (every engine source's engines run
them). Every function here is importable by name, so ipyparallel ships a reference, not
code. Once joined, the cluster reaches a worker by RPC.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


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
    members: list[str] | None = None,
    transport_names: list[str] | None = None,
) -> dict[str, Any]:
    """Join the notebook's RPC group as ``name``; return this process's description.

    ``members``: the cluster's addresses, when it listens beyond loopback: then this
    process's listening sockets admit those alone (:mod:`nbrpc._fence`).
    ``transport_names``: TensorPipe's transports, as the kernel chose them for the cluster."""
    from nbrpc import _group, _setup
    from nbrpc._errors import BootError

    spec = _group.StoreSpec(**store)
    if spec.kind == "file" and not os.path.exists(os.path.dirname(spec.path)):
        raise BootError(
            f"worker {name} on {socket.gethostname()} cannot see the kernel's store "
            f"{spec.path}: it runs on another host. Start the cluster with --listen ADDR "
            "(an address of the kernel's host that this host reaches), so the kernel's store "
            "and RPC endpoint listen there."
        )
    _setup.worker(  # every step a worker installs, its join, and what follows, in order
        kernel,
        name,
        rank,
        spec,
        rpc_timeout,
        num_worker_threads,
        device_maps,
        devices,
        members,
        transport_names,
    )
    info = describe_process()
    info.update(name=name, rank=rank)
    return info


def address_toward(peer: str) -> str:
    """This host's address on its route to ``peer`` (the kernel's): what the kernel admits."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # a UDP "connect" only picks the route: nothing is sent
        return str(s.getsockname()[0])


def host_entry() -> str | None:
    """The ``--hosts`` entry this engine was started for (None: a local engine)."""
    return os.environ.get("NBRPC_HOST_ENTRY")


def slurm_task() -> tuple[int, str]:
    """This engine's Slurm task (``SLURM_PROCID``) and node: workers are named in task
    order."""
    return int(os.environ.get("SLURM_PROCID", "0")), os.environ.get(
        "SLURMD_NODENAME", socket.gethostname()
    )


def release_rrefs(timeout: float) -> None:
    """A graceful shutdown begins: this worker lets go of the RRefs it holds, as the
    kernel does at the same moment (see ``_group.release_user_rrefs``). Its kept failure
    goes first: the frames of the last call that raised hold that call's arguments, an
    RRef among them, and its owner would wait for it."""
    import gc

    from nbrpc import _group
    from nbrpc._wire import failures

    failures.forget_failures()
    gc.collect()  # a traceback's frames and their locals form cycles
    _group.release_user_rrefs(timeout)


def leave(timeout: float = 0) -> None:
    """Leave the group gracefully; the engine itself keeps running."""
    from nbrpc import _group
    from nbrpc._wire import lanes, native_output

    lanes.close()
    native_output.stop_tail()
    _group.leave(timeout)
