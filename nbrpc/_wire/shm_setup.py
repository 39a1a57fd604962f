"""Who shares memory with whom: :mod:`.shm`'s fast path set up across a cluster.

The kernel runs these steps once workers joined (:func:`nbrpc._setup.fast_path`): on one
host it probes whether every worker sees its ``/dev/shm`` and turns the fast path on
everywhere or nowhere (:func:`set_up`); across hosts each process turns it on towards
those whose probes it sees (:func:`set_up_by_host`). A step runs on every worker at once,
by RPC (:func:`on_each`, which the lanes' set-up uses too). It stands apart from
:mod:`.shm`, the path each message takes: it runs once a cluster forms, led by the kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nbrpc import _process, _torch

from .shm import SHM_DIR, configure, enabled

SETUP_TIMEOUT_S = 90.0  # each worker's answer (bounded: one may have died)


def on_each(workers: list[str], func: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``func(*args)`` on every worker at once, by RPC; their answers by name (each bounded
    by :data:`SETUP_TIMEOUT_S`: one may have died). Set-up steps use it here and in
    :mod:`.lanes`."""
    asked = {w: _torch.rpc_async(w, func, args=args, timeout=SETUP_TIMEOUT_S) for w in workers}
    return {w: fut.wait() for w, fut in asked.items()}


def set_up(prefix: str, threshold: int | None, workers: list[str], local: bool) -> bool:
    """Shared memory for large tensors, if every worker sees this kernel's /dev/shm.

    All or none: a process that sent a segment name to one that cannot open it would
    break the call. A probe segment tells "same host and same /dev/shm" apart from "same
    hostname". ``local``: the group's endpoints are on loopback (else: :func:`set_up_by_host`).
    """
    if threshold is None or not local:
        configure(prefix, None)
        return False
    probe = os.path.join(SHM_DIR, f"{prefix}-probe")
    try:
        with open(probe, "w"):
            pass
    except OSError:
        configure(prefix, None)
        return False
    try:
        on = all(on_each(workers, configure_if_sees, prefix, threshold, probe).values())
        if not on:
            on_each(workers, configure_if_sees, prefix, None, probe)
    finally:
        os.unlink(probe)
    configure(prefix, threshold if on else None)
    return enabled()


def configure_if_sees(prefix: str, threshold: int | None, probe: str) -> bool:
    """Runs on a worker: use shared memory if this process sees the kernel's ``probe``
    segment (the same host and the same ``/dev/shm``); returns whether it is on."""
    same_memory = threshold is not None and os.path.exists(probe)
    configure(prefix, threshold if same_memory else None)
    return enabled()


def set_up_by_host(
    prefix: str, threshold: int | None, me: str, workers: list[str]
) -> dict[str, list[str]]:
    """Across hosts: the fast path between the processes that share a ``/dev/shm``.

    Every process leaves a probe file in its ``/dev/shm``; then each one lists the probes
    it sees (its peers on the same host, whatever their hostnames say) and turns the fast
    path on towards those alone; then the probes go. Returns each process's peers.
    """
    if threshold is None:
        configure(prefix, None)
        return {}

    def each(step: str) -> dict[str, list[str]]:
        found = on_each(workers, share_with_peers, prefix, "", threshold, step)
        found[me] = share_with_peers(prefix, me, threshold, step)
        return found

    try:
        each("probe")
        return each("configure")
    finally:
        each("done")


def share_with_peers(prefix: str, name: str, threshold: int, step: str) -> list[str]:
    """One step of :func:`set_up_by_host` in this process (``name``: its own, "" for the
    name it has in the group).

    ``probe``: leave a probe file; ``configure``: the peers whose probes are visible here
    get the fast path (none: off); ``done``: remove this process's probe.
    """
    name = name or _process.name()
    mark = f"{prefix}-probe-"
    path = os.path.join(SHM_DIR, mark + name)
    if step == "probe":
        with open(path, "w"):
            pass
        return []
    if step == "configure":
        try:
            seen = [e[len(mark) :] for e in os.listdir(SHM_DIR) if e.startswith(mark)]
        except OSError:
            seen = []
        peers = sorted(n for n in seen if n != name)
        configure(prefix, threshold if peers else None, peers)
        return peers if enabled() else []
    if os.path.exists(path):
        os.unlink(path)
    return []
