"""Restart workers without losing the rest: ``%rpc_restart worker2``, :func:`restart`.

A worker that died (out of memory, a segfault in an extension, ``kill``) or is stuck is
replaced by a fresh process under the same name, where it ran before (forked here from
the kept zygote; on the same ``--hosts`` entry). The kernel and the other workers keep
their processes, namespaces and RRefs. In order, for the names asked:

1. Everything is checked before anything stops: the names (workers of this cluster), the
   source (an attached ipyparallel cluster's engines are not nbrpc's to replace), and a
   process group's backend (rebuilt among all its members afterwards: gloo or nccl).
2. The old process is killed, not asked (a restart is for a worker that is broken or
   stuck), and leaves the group on its behalf (``_departures.forget``, as for a dead worker).
   Calls to it and RRefs it owned fail with :class:`~nbrpc.WorkerDiedError` naming the
   restart; the ownership view drops them.
3. A new engine joins under the same name with a new rank (ranks are never reused: torch
   caches connections by rank); the shared-memory fast path is set up for it; a process
   group is rebuilt among all its members (its collective state is gone, and the
   restart's summary says so).

A new process that cannot start or join is a :class:`~nbrpc.BootError`; the rest of the
cluster keeps working without it, and a second restart of that name works.

``restart="dead"`` (``%rpc_init --restart-dead``) restarts a worker that died before the
next cell runs, with a line naming it and why it died (:func:`watch_for_dead`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nbrpc import _departures, _fence, _group, _process, _states
from nbrpc._engines import JOIN_TIMEOUT_S
from nbrpc._errors import BootError, ConfigError
from nbrpc._placement import check_named
from nbrpc._rows import WorkerRecord, WorkerState
from nbrpc._wire import native_output

from . import collective
from .boot import Joining
from .progress import BootProgress
from .running import Cluster


@dataclass
class Restarted:
    """What one restart did, as the notebook shows it."""

    names: list[str]
    old: dict[str, tuple[int, int]]  # name -> (pid, torch's id) before
    new: dict[str, tuple[int, int]]  # name -> (pid, torch's id) after
    orders: dict[str, int] = field(default_factory=dict)  # name -> nbrpc.rank(), kept
    process_group: bool = False  # rebuilt: its collective state is gone
    seconds: float = 0.0

    def __repr__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        lines = []
        for name in self.names:
            (old_pid, old_id), (pid, new_id) = self.old[name], self.new[name]
            lines.append(
                f"nbrpc: {name} restarted (pid {old_pid} -> {pid}, nbrpc.rank() "
                f"{self.orders.get(name, '?')}; torch id {old_id} -> {new_id}) in "
                f"{self.seconds:.1f} s: its RRefs and its globals (set by %%rpc cells or "
                "nbrpc.push) are gone"
            )
        if self.process_group:
            lines.append(
                "nbrpc: the process group was rebuilt among all its members: collective "
                "state (its communicators, DDP's buckets) starts over"
            )
        return "\n".join(lines)


def run(cluster: Cluster, names: list[str]) -> Restarted:
    """Restart ``names`` of ``cluster`` (a :class:`nbrpc.Cluster` that is ready); a new
    process that cannot start or join is a :class:`BootError` that says the rest works.
    The stop button meanwhile leaves those not yet back dead, never restarting: its
    KeyboardInterrupt says so, and that a second restart starts them."""
    try:
        return _run(cluster, names)
    except (BootError, KeyboardInterrupt) as exc:
        failed = [n for n in names if _states.state_of(n) is WorkerState.RESTARTING]
        stopped = isinstance(exc, KeyboardInterrupt)
        why = (
            "its restart was stopped (the stop button) before a new process joined"
            if stopped
            else f"its restart failed: {str(exc).splitlines()[0]}"
        )
        _states.failed(failed, why)
        them, are = ("them", "are") if len(failed) > 1 else ("it", "is")
        again = f"%rpc_restart {' '.join(failed or names)}"
        group = (  # left destroyed: made again with them
            f" The workers' process group is made again once {them} {are} back."
            if cluster.booted.process_group
            else ""
        )
        if stopped:
            if failed:
                print(
                    f"nbrpc: the stop button during a restart: {', '.join(failed)} {are} "
                    "dead now (the old process is gone, "
                    f"no new one joined); the rest of the cluster works. {again} starts "
                    f"{them} anew.{group}",
                    file=sys.stderr,
                )
            raise
        raise BootError(
            f"{', '.join(failed or names)} could not be restarted: {exc}\nThe rest of the "
            f"cluster works without {them}; {again} tries again.{group}"
        ) from None


def _run(cluster: Cluster, names: list[str]) -> Restarted:
    t0 = time.monotonic()
    records = {r.name: r for r in cluster.booted.roster.workers()}
    _check(cluster, names, records)
    settings, booted, engines = cluster.settings, cluster.booted, cluster.engines
    pg = booted.process_group
    others = [n for n in cluster.booted.roster.ready() if n not in names]
    old = {n: (records[n].pid, records[n].rank) for n in names}
    live = [n for n in names if records[n].state is WorkerState.READY]  # their pipes close now

    # calls to them fail at once meanwhile, naming why; torch's "EOF" lines are expected
    _states.restarting(names, "it is being restarted (nbrpc.restart)")
    if pg:  # every member leaves it: it is rebuilt among all of them below (its record
        # stays: after a restart that fails or is stopped, the next one rebuilds it)
        collective.destroy(pg, others)
    old_ids = [eid for n in names if (eid := records[n].engine_id) is not None]
    assert len(old_ids) == len(names), "every worker runs in an engine"
    try:
        with native_output.quiet_stderr_while_leaving(live):  # a script's, as a kernel's
            new_ids = engines.replace(old_ids, [records[n].pid for n in names], JOIN_TIMEOUT_S)
    finally:  # the old processes are gone either way: out of the group, on their behalf
        _departures.forget(names, others)
        _departures.release_stale_token()
        _states.left(names, [old[n][1] for n in names])  # what they owned is gone

    member = _group.current_kernel_membership()
    assert member is not None, "the kernel joined at the boot"
    admitted = _fence.members()  # across hosts: who may connect to the new process
    fenced = sorted(admitted) if admitted is not None else None
    joining = Joining(settings, engines, booted, member, fenced, BootProgress(names, "off"))
    places: dict[str, tuple[int, int]] = {}
    described: dict[int, dict] = {}
    try:
        described = joining.describe(new_ids)
        places = joining.places(names, new_ids)
        infos = joining.join(places, booted.device_maps, {})
    except (BootError, KeyboardInterrupt):
        # joined half way or not at all: out of the group, their new engines stopped
        taken = {
            n: (places.get(n, (None, eid))[0], eid) for n, eid in zip(names, new_ids, strict=True)
        }
        try:
            joining.clean_up_unjoined(taken, described, {})
        finally:
            cluster.booted.devices_back(cluster.booted.roster.ready())  # to those that stay
        raise
    _states.rejoined([joining.record(name, infos[name]) for name in names])
    joining.after_join(names, booted.roster.ready())
    result = Restarted(
        list(names),
        old,
        {n: (records[n].pid, records[n].rank) for n in names},
        {n: records[n].order for n in names},
    )
    if pg:
        devices = {r.name: r.devices for r in cluster.booted.roster.workers()}
        joining.start_process_group(pg["backend"], list(pg["ranks"]), devices)
        result.process_group = True
    result.seconds = time.monotonic() - t0
    return result


def _check(cluster: Cluster, names: list[str], records: dict[str, WorkerRecord]) -> None:
    """Refuse, before anything stops, what a restart cannot do."""
    if not names:
        raise ConfigError("name the workers to restart, e.g. %rpc_restart worker2")
    check_named(names, list(records), "restart", "the kernel cannot be restarted from itself")
    why = cluster.engines.source.cannot_replace
    if why:
        raise ConfigError(f"cannot restart {', '.join(names)}: {why}")
    pg = cluster.booted.process_group
    if pg and pg["backend"] not in collective.REBUILDABLE:
        raise ConfigError(
            f"cannot restart {', '.join(names)}: the workers' {pg['backend']} process group "
            "cannot be rebuilt in place. Nothing was stopped; run %rpc_shutdown then %rpc_init."
        )


# -- restart="dead": before each cell, a worker that died is replaced ----------------------


@dataclass
class _Watching:
    hooked: bool = False


_watching = _Watching()


def watch_for_dead(restart_dead: Callable[[], None]) -> None:
    """In IPython, once: ``restart_dead()`` before each cell (the running cluster replaces
    the workers that died, if it asked to)."""
    ipython = _process.shell()
    if _watching.hooked or ipython is None:
        return
    ipython.events.register("pre_run_cell", lambda *_: restart_dead())
    _watching.hooked = True
