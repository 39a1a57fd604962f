"""nbrpc's functions on the current cluster: ``nbrpc.init``, ``current``, ``shutdown``,
``restart``, ``scale``, ``status``, ``workers``, ``stacks``.

A kernel runs one cluster at a time (:func:`nbrpc._lifecycle.cluster.running`, from its
boot until it is closed); each function here finds it and asks the
:class:`~nbrpc.Cluster` to act, or says there is none (:class:`NotInitializedError`,
naming the call the user made). The magics and the panel's buttons reach the same
functions through :mod:`.actions`.
"""

from __future__ import annotations

import textwrap
import threading
from typing import Unpack

from nbrpc import _engines, _group, _states
from nbrpc._errors import NotInitializedError
from nbrpc._gather import census, stacks as gathered_stacks
from nbrpc._option_text import options_doc
from nbrpc._options import Options
from nbrpc._rows import StackRow, StatusRow

from . import ranks, restart as restarts, scale as scales
from .cluster import LEAVE_TIMEOUT_S, Cluster, running


def init(n: int | None = None, /, **options: Unpack[Options]) -> Cluster:
    """Start ``n`` workers (or attach to a running ipyparallel cluster) and join them.

    The calling process joins as ``self_name`` (rank 0); workers are named ``worker1`` ...
    ``workerN`` unless ``names`` is given. Without ``n``, ``names``, ``hosts`` or an
    ipyparallel cluster to attach to: 2 workers. Every one of ``options`` (below) is checked
    before anything starts (:class:`~nbrpc.ConfigError`). Returns the started
    :class:`Cluster`. Raises :class:`~nbrpc.AlreadyInitializedError` while one runs,
    :class:`~nbrpc.BootError` when workers do not start or join (what started is stopped),
    :class:`~nbrpc.DeviceMapError` for device maps the processes cannot serve."""
    return Cluster(n, **options).start()


init.__doc__ = (init.__doc__ or "") + "\n    Options:\n\n" + textwrap.indent(options_doc(), "    ")


def current() -> Cluster:
    """The running cluster; raises :class:`NotInitializedError` when there is none."""
    return required("nbrpc.current()")


def required(what: str) -> Cluster:
    """The running cluster, for ``what`` (the call a user made, as they typed it: its
    :class:`NotInitializedError` names it, not the function nbrpc asked)."""
    cluster = running()
    if cluster is None:
        raise NotInitializedError(what)
    return cluster


def shutdown(
    graceful: bool = True, timeout: float = LEAVE_TIMEOUT_S, release: bool = False
) -> None:
    """Shut the current cluster down (no-op when none runs); raises nothing of its own.
    ``graceful``: workers finish their calls in flight (``timeout`` seconds at most), then
    leave; ``False``: dropped at once. ``release=True`` also stops the controller and the
    warm spare engines kept for a fast next ``init`` (``%rpc_shutdown --release``)."""
    cluster = running()
    if cluster is not None:
        cluster.shutdown(graceful=graceful, timeout=timeout, release=release)
    elif release:
        _engines.release_kept()


def restart(*names: str) -> restarts.Restarted:
    """Replace workers ``names`` (dead or alive) with fresh processes under the same names,
    where they ran; the kernel and the other workers keep their state
    (``%rpc_restart worker2``). What the old processes owned is gone: their RRefs raise
    :class:`~nbrpc.WorkerDiedError` naming the restart, their ``%%rpc`` namespaces start
    empty, and a process group among the workers is rebuilt (its collective state is gone).
    An unknown name, an attached cluster, or a process group that cannot be rebuilt is a
    :class:`~nbrpc.ConfigError` before anything stops; a new process that cannot start or
    join is a :class:`~nbrpc.BootError`, and the rest of the cluster keeps working.
    Returns what it did (its repr says it)."""
    return required("nbrpc.restart() (%rpc_restart)").restart(*names)


def scale(n: int | None = None, /, **how: Unpack[scales.How]) -> scales.Scaled:
    """Grow or shrink the running cluster to ``n`` workers, from the source it started
    from (``%rpc_scale N``); the workers that stay keep everything. ``remove``: the
    workers to leave (default: the highest ranks); ``names``, ``hosts``: the new workers'
    names and hosts; ``force``: cancel the leavers' calls instead of waiting (``how``).
    Returns what it did. Raises :class:`~nbrpc.NotInitializedError` without a cluster,
    ``ConfigError`` for what it cannot take, ``BootError`` when a new worker fails."""
    return required("nbrpc.scale() (%rpc_scale)").scale(n, **how)


def status(timeout: float = census.SNAPSHOT_TIMEOUT_S) -> list[StatusRow]:
    """Live figures for each process of the current cluster, ``timeout`` seconds at most
    (:meth:`Cluster.status`). Raises :class:`~nbrpc.NotInitializedError` without one."""
    return required("nbrpc.status()").status(timeout)


def workers() -> list[str]:
    """Names of the live processes of the cluster, in :func:`nbrpc.rank` order: the kernel
    first, then its workers. A worker whose process is gone (killed, crashed) or that is
    being restarted is left out; ``%rpc_restart`` brings it back under its name. Works on
    a worker too. Raises :class:`~nbrpc.NotInitializedError` before a cluster runs.
    (torch's own ``get_worker_infos()`` keeps torch's answer: every member its agent
    knows, dead or not, by torch's ids.)"""
    _group.require_active("nbrpc.workers()")
    cluster = running()
    if cluster is not None:  # its dead found now, not at their first call (pids; the
        # ipyparallel client only from the main thread: it is not thread-safe)
        cluster.dead_workers(ask_ipyparallel=threading.current_thread() is threading.main_thread())
    return [name for name in ranks.members() if name not in _states.unreachable]


def stacks(*names: str, timeout: float = gathered_stacks.TIMEOUT_S) -> list[StackRow]:
    """``nbrpc.stacks()``: every thread's Python stack in each process of the current
    cluster (or of ``names``), read from outside each worker, ``timeout`` seconds at most.
    Raises ``NotInitializedError`` without a cluster, ``UnknownWorkerError`` for a name."""
    return required("nbrpc.stacks() (%rpc_stacks)").stacks(*names, timeout=timeout)
