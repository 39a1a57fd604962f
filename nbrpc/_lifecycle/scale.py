"""Grow and shrink a running cluster: ``%rpc_scale N``, :func:`nbrpc.scale`.

torch's dynamic RPC group (the kind nbrpc's kernel makes) lets processes join and leave
while the others run: a grow is a boot's join for the new workers only, a shrink is
torch's own graceful leave for the leavers only. The workers that stay keep their
process, ``%%rpc`` namespace, notebook globals, RRefs and ``nbrpc.rank()``.

A grow, in order: everything is checked before anything starts; the new names (the
lowest free default names, or ``--names``) and ranks (the lowest free ``nbrpc.rank()``)
are chosen; the source brings engines where the first ones came from
(``EngineSource.grow``); they join (:class:`~.boot.Joining`, as at a boot and a
restart); the shared memory and lanes, the clock offsets and the process group follow.

A shrink, in order: the leavers (the highest ranks, or ``--remove``) finish their calls
in flight (``force``: they are cancelled), let go of the RRefs they hold, and leave by
torch's own leave; a leaver that cannot is dropped on its behalf (``_departures.forget``).
What they owned then fails with an error naming the worker and the scale; a call to
them is an :class:`~nbrpc.UnknownWorkerError` that says when they left. Their engines
stop (``EngineSource.shrink``).

A process group (``--process-group``) is made again among its members at the new size
(its old communicators are destroyed first: objects holding the old group, such as a
DDP module, must be made again). The stop button during a grow keeps the workers that
had joined and cleans up the rest; during a shrink it cancels the leavers' calls and
finishes their leave.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from nbrpc import _departures, _fence, _group, _process, _states, _torch
from nbrpc._engines import JOIN_TIMEOUT_S, worker
from nbrpc._rows import WorkerRecord, WorkerState
from nbrpc._wire import cancelling, native_output

from . import collective, scale_checks
from .aside import Aside
from .boot import Joining
from .progress import BootProgress
from .ranks import set_order
from .running import Cluster

LEAVE_TIMEOUT_S = 30.0  # a leaver's calls in flight, then its leave, at most this each
ORDER_TIMEOUT_S = 10.0
#: what a call says that a leaver's leave cut off (one the cancel could not stop)
LEFT_MID_CALL = (
    "the worker left the cluster at a scale that did not wait for its calls (%rpc_scale "
    "--force, or the stop button during %rpc_scale), and the call could not be stopped "
    "where it ran (inside C code, such as time.sleep)"
)


class How(TypedDict, total=False):
    """:func:`nbrpc.scale`'s options besides the size."""

    remove: list[str]  # the workers that leave (default: the highest ranks)
    names: list[str]  # the new workers' names (default: the lowest free worker names)
    hosts: tuple[str, ...]  # where new workers start (--hosts clusters)
    force: bool  # the leavers' calls in flight are cancelled, not waited for


@dataclass
class Scaled:
    """What one scale did, as the notebook shows it."""

    joined: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (pid, rank)
    left: list[str] = field(default_factory=list)
    workers: int = 0  # the cluster's size after it
    process_group: int | None = None  # rebuilt: its new world size
    seconds: float = 0.0

    def __repr__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        lines = []
        if self.joined:
            joined = ", ".join(
                f"{name} (nbrpc.rank() {rank}, pid {pid})"
                for name, (pid, rank) in self.joined.items()
            )
            lines.append(f"nbrpc: {joined} joined")
        if self.left:
            lines.append(f"nbrpc: {', '.join(self.left)} left the cluster")
        lines.append(
            f"nbrpc: the cluster has {self.workers} worker{'s' * (self.workers != 1)} now "
            f"({self.seconds:.1f} s)"
            + ("" if self.joined or self.left else ": it had that many already")
        )
        if self.process_group is not None:
            lines.append(
                f"nbrpc: the process group was made again among its members (world size "
                f"{self.process_group}): objects holding the old one, such as a "
                "DistributedDataParallel module, must be made again"
            )
        return "\n".join(lines)


def run(
    cluster: Cluster,
    n: int | None = None,
    remove: list[str] | None = None,
    names: list[str] | None = None,
    hosts: tuple[str, ...] = (),
    force: bool = False,
) -> Scaled:
    """Take ``cluster`` to ``n`` workers, or without the workers ``remove`` (see the
    module doc). Bad input is a :class:`ConfigError` before anything changes."""
    t0 = time.monotonic()
    workers = cluster.booted.roster.workers()
    leavers, count = scale_checks.check(cluster, workers, n, remove or [], names, hosts)
    result = Scaled()
    if leavers:
        _shrink(cluster, leavers, force, result)
    if count:
        _grow(cluster, count, names, hosts, result)
    result.workers = len(cluster.booted.roster.workers())
    result.seconds = time.monotonic() - t0
    return result


# -- shrink ------------------------------------------------------------------------------


def _shrink(cluster: Cluster, leavers: list[WorkerRecord], force: bool, result: Scaled) -> None:
    booted = cluster.booted
    names = [r.name for r in leavers]
    stayers = [r.name for r in cluster.booted.roster.workers() if r.name not in names]
    live = [r.name for r in leavers if r.state is WorkerState.READY]
    pg = booted.process_group
    stopped = False
    try:  # (a stop from here on ends in the leave below: never marked leaving, yet staying)
        if pg:  # every member leaves it: it is made again among the stayers below
            _destroy_group(cluster, pg)
        _states.leaving(names, LEFT_MID_CALL)
        _expect_leaving(stayers, names)
        if force:
            _cancel(cluster.aside, live)
        else:
            _wait_for_calls(cluster.aside, live)
    except KeyboardInterrupt:  # the stop button: no more waiting, but no half-leave
        stopped = True
        _cancel(cluster.aside, live)
        raise
    finally:  # the stayers' process group too: a stopped shrink lost it for good
        try:
            _leave(cluster, leavers, stayers, live, result)
        except KeyboardInterrupt:  # a stop held while the leavers' engines stopped
            stopped = True
            raise
        finally:
            if pg:
                _rebuild_process_group(cluster, pg, result)
            _tell_ranks(cluster)
            if stopped:
                print(
                    f"nbrpc: the stop button during a scale: the calls of {', '.join(names)} "
                    "were cancelled and they left the cluster",
                    file=sys.stderr,
                )


def _expect_leaving(stayers: list[str], names: list[str]) -> None:
    """The workers that stay drop torch's line about the leavers' closed connections, as
    the kernel does (``native_output.expected``)."""
    _tell_ready(stayers, native_output.expect_leaving, names, 5.0)


def _wait_for_calls(aside: Aside, names: list[str]) -> None:
    """The leavers' calls in flight finish first (bounded by :data:`LEAVE_TIMEOUT_S`)."""
    deadline = time.monotonic() + LEAVE_TIMEOUT_S
    said = False
    while names and time.monotonic() < deadline:
        figures = aside.figures(names, (frozenset(),), 5.0)
        busy = [n for n in names if (figures.get(n) or {}).get("calls_in_flight")]
        if not busy:
            return
        if not said and time.monotonic() > deadline - LEAVE_TIMEOUT_S + 1.0:
            said = True
            print(
                f"nbrpc: waiting up to {deadline - time.monotonic():.0f} s for the calls "
                f"running on {', '.join(busy)} to finish before they leave. The stop button "
                "cancels them (or %rpc_scale --force).",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.05)


def _cancel(aside: Aside, names: list[str]) -> None:
    if names:
        aside.ask(
            names,
            "cancel",
            cancelling.cancel,
            (cancelling.EVERYTHING, cancelling.GRACE_S, False),
            cancelling.GRACE_S + 2.0,
        )


def _leave(
    cluster: Cluster,
    leavers: list[WorkerRecord],
    stayers: list[str],
    live: list[str],
    result: Scaled,
) -> None:
    """The leavers let go of their RRefs and leave by torch's leave; one that cannot is
    dropped on its behalf. Then their engines stop and the records say they left. torch's
    leave drops every member's CUDA devices and reply maps: they are given back after each
    leave, and when one failed half way (:meth:`Booted.devices_back`)."""
    booted, engines = cluster.booted, cluster.engines
    names = [r.name for r in leavers]
    ids = {r.name: r.engine_id for r in leavers if r.engine_id is not None}
    live_ids = [ids[n] for n in live if n in ids]
    asked = [engines.apply(eid, worker.release_rrefs, 2.0) for eid in live_ids]
    for ar in asked:  # one that fails still leaves below; what it held goes with it
        with contextlib.suppress(Exception):
            ar.get(timeout=10)
    failed: dict[str, str] = {}

    def ready() -> list[str]:
        return [n for n in stayers if _states.state_of(n) is WorkerState.READY]

    try:
        with native_output.quiet_stderr_while_leaving(live):
            # one at a time: torch's leave holds the group's token, and a leave that fails
            # keeps it, so the next one waited for it until its timeout (measured: 30 s)
            for eid in live_ids:
                failed.update(engines.leave([eid], True, LEAVE_TIMEOUT_S))
                if f"engine {eid}" in failed:
                    _departures.release_stale_token()
                if booted.device_maps and eid != live_ids[-1]:  # after the last: finally
                    booted.devices_back(ready())
        gone = [r.name for r in leavers if r.name not in live or f"engine {r.engine_id}" in failed]
        if gone:  # dead, or its leave failed: out of the group on its behalf, everywhere
            try:
                _departures.tell_peers_left(
                    {r.name: r.rank for r in leavers if r.name in gone}, ready()
                )
            finally:
                _departures.forget_names(gone)  # the kernel's table, torch's list and token
    finally:
        booted.devices_back(ready())
    at = time.strftime("%H:%M:%S")
    _states.departed_at_scale(names, [r.rank for r in leavers], at)
    try:  # held: a stop in the middle left stopped engines counted as starting ones, and
        with _process.interrupts_deferred():  # the next grow failed on them (BootError)
            engines.shrink(list(ids.values()), [r.pid for r in leavers])
    finally:
        result.left.extend(names)


# -- grow --------------------------------------------------------------------------------


def _grow(
    cluster: Cluster, count: int, names: list[str] | None, hosts: tuple[str, ...], result: Scaled
) -> None:
    settings, booted, engines = cluster.settings, cluster.booted, cluster.engines
    current = {r.name for r in cluster.records}
    new = names or scale_checks.free_names(settings, current, count)
    orders = scale_checks.free_orders({r.order for r in cluster.records}, count)
    reused = [name for name in new if name in _states.departed]
    if reused:  # their entries in torch's list of names, should one be left
        _departures.forget_names(reused)
    progress = BootProgress(new, settings.progress)

    def registered(done: int, note: str = "") -> None:
        for name in new[:done]:
            progress.update(name, 1)
        if note:
            for name in new[done:]:
                progress.update(name, 0, note)

    pg = booted.process_group
    member = _group.current_kernel_membership()
    assert member is not None, "the kernel joined at the boot"
    ordered = dict(zip(new, orders, strict=True))
    engine_ids: list[int] = []
    described: dict[int, dict] = {}
    joining = Joining(settings, engines, booted, member, None, progress)
    infos: dict[str, dict] = {}
    places: dict[str, tuple[int, int]] = {}  # name -> (torch rank, engine id)
    try:
        engine_ids = engines.grow(count, hosts, registered)
        described = joining.describe(engine_ids)
        joining.members = _admit(cluster, engine_ids)
        places = joining.places(new, engine_ids)
        joining.join(places, booted.device_maps, {}, infos)
    except BaseException as exc:
        taken = {  # name -> (its torch rank, if handed out; its engine), if one was taken
            n: (places.get(n, (None, eid))[0], eid) for n, eid in zip(new, engine_ids, strict=False)
        }
        joining.clean_up_unjoined(taken, described, infos)
        if infos:  # full members, as after a scale that ended: the group and ranks too
            _adopt(cluster, joining, infos, ordered, result)
            _complete(cluster, pg, infos, joining, result)
        if isinstance(exc, KeyboardInterrupt):
            left_out = [name for name in new if name not in infos]
            print(
                "nbrpc: the stop button during a scale: "
                + (
                    f"{', '.join(infos)} joined and stay{'s' * (len(infos) == 1)}; "
                    if infos
                    else "no new worker joined; "
                )
                + f"{', '.join(left_out)} did not join and "
                + ("was" if len(left_out) == 1 else "were")
                + " cleaned up",
                file=sys.stderr,
            )
        raise
    _adopt(cluster, joining, infos, ordered, result)
    _complete(cluster, pg, infos, joining, result)


def _complete(
    cluster: Cluster,
    pg: collective.ProcessGroupInfo | None,
    joined: dict[str, dict],
    joining: Joining,
    result: Scaled,
) -> None:
    """After the new workers ``joined``: the process group made again with them, and every
    worker told the ranks."""
    if pg:
        _destroy_group(cluster, pg, joined)
        _rebuild_process_group(cluster, pg, result, joining)
    _tell_ranks(cluster)


def _admit(cluster: Cluster, engine_ids: list[int]) -> list[str] | None:
    """Across hosts: the addresses the new engines reach the kernel from join the
    members, in the kernel, its controller and every worker that stays, before any of
    them joins. The members, for the new workers' own sockets (None: loopback only)."""
    admitted = _fence.members()
    if admitted is None:
        return None
    engines, listen = cluster.engines, cluster.settings.listen
    asked = [engines.apply(eid, worker.address_toward, listen) for eid in engine_ids]
    members = set(admitted) | {ar.get(timeout=JOIN_TIMEOUT_S) for ar in asked}
    if members != admitted:
        _fence.admit(members)
        engines.fence_controller()
        roster = cluster.booted.roster
        engine_of = roster.engines()
        told = [
            engines.apply(engine_of[name], _fence.admit, sorted(members))
            for name in roster.ready()
            if name in engine_of
        ]
        for ar in told:
            ar.get(timeout=JOIN_TIMEOUT_S)
    return sorted(members)


def _adopt(
    cluster: Cluster,
    joining: Joining,
    infos: dict[str, dict],
    orders: dict[str, int],
    result: Scaled,
) -> None:
    """The workers that joined become the cluster's: records and states, then what follows
    every join (``Joining.after_join``)."""
    records = [joining.record(name, info, orders[name]) for name, info in infos.items()]
    _states.grew(records)
    joining.after_join(list(infos), cluster.booted.roster.ready())
    result.joined.update({r.name: (r.pid, r.order) for r in records})


# -- after either ------------------------------------------------------------------------


def _rebuild_process_group(
    cluster: Cluster,
    pg: collective.ProcessGroupInfo,
    result: Scaled,
    joining: Joining | None = None,
) -> None:
    """The process group among its members at the new size: the old members that stay,
    then the new workers (a grow's), in rank order."""
    booted = cluster.booted
    workers = cluster.booted.roster.ready()
    old = [name for name in pg["ranks"] if name in workers]
    added = list(result.joined) if joining is not None else []
    members = old + [name for name in added if name not in old]
    if not members:
        return
    if joining is None:
        member = _group.current_kernel_membership()
        assert member is not None, "the kernel joined at the boot"
        joining = Joining(
            cluster.settings, cluster.engines, booted, member, None, BootProgress([], "off")
        )
        joining.first_rank = member.allocate_ranks(1)[0]  # names the group's store keys
    devices = {r.name: r.devices for r in cluster.booted.roster.workers()}
    joining.start_process_group(pg["backend"], members, devices)
    result.process_group = len(members)


def _tell_ranks(cluster: Cluster) -> None:
    """Every worker learns the ranks as they are now (``nbrpc.rank()`` asks the kernel
    once, then keeps what it was told)."""
    order = {r.name: r.order for r in cluster.records}
    _tell_ready(
        [r.name for r in cluster.booted.roster.workers()], set_order, order, ORDER_TIMEOUT_S
    )


def _tell_ready(names: list[str], func: Callable[[Any], None], arg: Any, timeout: float) -> None:
    """``func(arg)`` in each of ``names`` that is ready, all at once; a worker that died
    meanwhile is left out (its calls say so)."""
    futures = [
        _torch.rpc_async(name, func, args=(arg,), timeout=timeout)
        for name in names
        if _states.state_of(name) is WorkerState.READY
    ]
    for fut in futures:
        with contextlib.suppress(Exception):
            fut.wait()


def _destroy_group(
    cluster: Cluster, pg: collective.ProcessGroupInfo, joined: dict[str, dict] | None = None
) -> None:
    """Every ready member leaves the process group (the ``joined`` workers of a grow are
    not members yet); it is made again afterwards (:func:`_rebuild_process_group`)."""
    ready = [name for name in cluster.booted.roster.ready() if name not in (joined or {})]
    collective.destroy(pg, ready)
    cluster.booted.process_group = None
