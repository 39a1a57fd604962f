"""A ``torch.distributed`` process group among the workers: collectives and DDP in cells.

``%rpc_init --process-group gloo`` (``nbrpc.init(process_group="gloo")``) makes the workers,
after they joined the RPC group, also form a process group: rank = position in
``process_group_workers`` (default: every worker, in order, so worker1 is rank 0), world
size = their number. ``torch.distributed`` collectives and ``DistributedDataParallel`` then
run in ``%%rpc`` cells, beside RPC, as in pytorch/examples' ``ddp_rpc`` layout (trainers in
a DDP group, a parameter server outside it).

The kernel is not a member. A process group is collective: every member must enter each
collective, and the kernel runs the notebook, not a training step; a kernel that had to
join every ``all_reduce`` would block its cells. It only hosts the rendezvous.

The rendezvous is the cluster's own store (the file store of a local cluster, the kernel's
TCP store when ``--listen``/``--init-method`` spans hosts) under a prefix no other cluster
uses, so a re-init in the same kernel makes a fresh group. Gloo is told which interface
to use the same way TensorPipe is: loopback for a local cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nbrpc import _fence, _group, _torch
from nbrpc._errors import ConfigError
from nbrpc._placement import not_workers
from nbrpc._wire import failures

log = logging.getLogger("nbrpc")

INIT_TIMEOUT_S = 60.0
DESTROY_TIMEOUT_S = 10.0
#: backends nbrpc.restart rebuilds among all members after replacing one of them
REBUILDABLE = ("gloo", "nccl")


class ProcessGroupInfo(dict):
    """``{"backend": "gloo", "ranks": {"worker1": 0, ...}, "prefix": ...}``."""


def members_of(
    requested: tuple[str, ...] | None, workers: list[str], kernel: str = ""
) -> list[str]:
    """The members in rank order; every one must be a worker (never the kernel, named
    ``kernel``)."""
    members = list(requested) if requested else list(workers)
    unknown = [m for m in members if m not in workers]
    if unknown:
        raise ConfigError(
            f"--process-group-workers {', '.join(unknown)}: {not_workers(unknown, kernel)}. "
            f"Its workers: {', '.join(workers)} (the kernel is never a member)."
        )
    return members


def start(
    backend: str,
    members: list[str],
    store: dict,
    prefix: str,
    devices: dict[str, list[str]],
    timeout_s: float = INIT_TIMEOUT_S,
) -> ProcessGroupInfo:
    """Every member enters ``init_process_group`` at once (it waits for all of them).

    ``devices``: what each worker reported when it joined; nccl needs CUDA in every member.
    """
    if backend == "nccl":
        lacking = [m for m in members if not any(d.startswith("cuda") for d in devices[m])]
        if lacking:
            raise ConfigError(
                f"--process-group nccl needs a CUDA device in every member; "
                f"{', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} none. "
                "Use --process-group gloo (CPU tensors)."
            )
    futures = {
        name: _torch.rpc_async(
            name,
            init_process_group,
            args=(backend, store, prefix, rank, len(members), timeout_s),
            timeout=timeout_s + 10,
        )
        for rank, name in enumerate(members)
    }
    ranks = {}
    for name, fut in futures.items():
        try:
            ranks[name] = fut.wait()["rank"]
        except Exception as exc:  # the worker's own exception, as rpc_sync would raise it
            raise (failures.unwrap(exc) or exc) from None
    return ProcessGroupInfo(backend=backend, ranks=ranks, prefix=prefix)


def destroy(info: ProcessGroupInfo, live: list[str]) -> None:
    """Members still alive leave the group (at shutdown; their processes end anyway)."""
    futures = [
        _torch.rpc_async(name, destroy_process_group, timeout=DESTROY_TIMEOUT_S)
        for name in info["ranks"]
        if name in live
    ]
    for fut in futures:
        try:
            fut.wait()
        except Exception as exc:
            log.warning("destroying the process group: %s", exc)


def describe(info: ProcessGroupInfo | None) -> str | None:
    if not info:
        return None
    ranks = ", ".join(f"{name} (dist.get_rank() {r})" for name, r in info["ranks"].items())
    return f"process group ({info['backend']}): {ranks}"


# -- worker side ---------------------------------------------------------------------


def init_process_group(
    backend: str, store: dict, prefix: str, rank: int, world_size: int, timeout_s: float
) -> dict[str, Any]:
    """Runs on a worker: join the workers' process group (see the module doc)."""
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
    _fence.fence_process(os.getpid())  # gloo's own listeners, across hosts
    _torch.guard_ddp(refuse_destroyed)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}


@dataclass
class _Destroyed:
    """On a worker: the process groups nbrpc destroyed here, and when (a DDP module that
    still holds one is refused: gloo's abort does not stop its collectives, and its next
    one waited for peers that had left, until its timeout)."""

    groups: list[tuple[Any, str]] = field(default_factory=list)


_destroyed = _Destroyed()


def destroy_process_group() -> None:
    """Runs on a worker: leave the process group."""
    if dist.is_initialized():
        old = dist.group.WORLD
        dist.destroy_process_group()
        _destroyed.groups.append((old, time.strftime("%H:%M:%S")))


def refuse_destroyed(group: Any) -> None:
    """Raise if ``group`` is one nbrpc destroyed (a DDP module made before a scale or a
    restart); the error says to wrap the model again."""
    for old, when in _destroyed.groups:
        if group is old:
            world = dist.get_world_size() if dist.is_initialized() else None
            raise ConfigError(
                f"this DistributedDataParallel module holds the workers' process group of "
                f"before {when}, when nbrpc made it again (%rpc_scale or %rpc_restart)"
                + (f"; the group has {world} members now" if world else "")
                + ". Wrap the model again: ddp = DistributedDataParallel(ddp.module)."
            )
