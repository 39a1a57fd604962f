"""A cluster's boot: engines up, the kernel and the workers in one RPC group, ready.

The order, and why (the phases shown while it runs, in ``Cluster.boot_seconds``):

1. The kernel describes itself; with device maps asked for, its own side is checked now,
   before anything starts, and so is what the kernel's first join fixed (its device
   maps: :func:`nbrpc._devices.check_fixed`).
2. The engine source starts (:mod:`nbrpc._engines`): a local controller and zygote begin
   at once and import meanwhile. Without device maps the kernel joins the group now,
   while they do ("controller", then "engines" once every engine registered).
3. With device maps, each engine reports its devices and every map is planned and
   checked (:mod:`nbrpc._devices`) before the kernel or any worker joins: torch fixes a
   process's maps at its join.
4. Every worker joins at once (:func:`nbrpc._engines.worker.join`, by ipyparallel's
   ``apply``): "join". Then the shared-memory fast path is set up over RPC
   (:mod:`nbrpc._wire.shm`) and, if asked, the workers' process group
   (:mod:`nbrpc._lifecycle.collective`).

What it finds and makes goes into a :class:`Booted` the cluster keeps, also when the
boot fails half way: the cluster then stops what was started (``Cluster._abandon``).

Workers join through :class:`Joining`, the steps a boot and a restart
(:mod:`nbrpc._lifecycle.restart`) share, in this order: ranks, the joins, each worker's record, the
fast path, the process group.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from nbrpc import _departures, _devices, _fence, _group, _kernel_devices, _network, _setup, _states
from nbrpc._engines import JOIN_TIMEOUT_S, Engines, remote_message, worker
from nbrpc._engines.watchdog import hold_store, segment_prefix, sweep_dead_kernels_stores
from nbrpc._errors import BootError
from nbrpc._gather import timeline
from nbrpc._group import KernelMembership
from nbrpc._options import Settings
from nbrpc._placement import validate_names
from nbrpc._rows import WorkerRecord

from . import collective
from .booted import Booted
from .progress import BootProgress


def boot(settings: Settings, engines: Engines, booted: Booted) -> None:
    """Run the boot (see the module doc); raises :class:`~nbrpc.BootError` & co."""
    _Boot(settings, engines, booted).run()


class _Boot:
    """One boot's steps, in order; what they find goes into ``booted``."""

    def __init__(self, settings: Settings, engines: Engines, booted: Booted) -> None:
        self.settings, self.engines, self.booted = settings, engines, booted
        self.t0 = time.monotonic()
        self.placeholder = settings.worker_names(settings.n or 0)
        self.progress = BootProgress(self.placeholder, settings.progress if settings.n else "off")
        self.kernel = worker.describe_process()
        #: the addresses admitted to the cluster's sockets (None: it listens on loopback
        #: only, where a filter could not tell anyone apart; see nbrpc._fence)
        self.members: set[str] | None = None
        if settings.listen and not _network.is_loopback(settings.listen):
            self.members = {settings.listen}

    def run(self) -> None:
        settings, phases = self.settings, self.booted.seconds
        if settings.wants_devices:  # the kernel's own side is known now: refuse before any start
            _devices.check_local(
                settings.self_name,
                settings.device_maps,
                settings.gpus,
                self.kernel["devices"],
                self.kernel["host"],
            )
        joined = _group.current_kernel_membership()  # what its first join fixed
        names = settings.worker_names(settings.n) if settings.n else list(settings.names or ())
        _devices.check_fixed(
            None if joined is None else joined.device_maps,
            settings.self_name,
            settings.gpus,
            settings.device_maps,
            names or None,
        )
        member = self.start_engines()
        engine_ids = self.engines.take(settings.n, self.registered)
        phases["engines"] = _since(self.t0)
        self.progress.phase("engines", phases["engines"], "registered")
        names = settings.worker_names(len(engine_ids))
        validate_names(names, settings.self_name)
        self.admit_engines(engine_ids)
        if settings.process_group:  # refuse unknown members before any join
            members = collective.members_of(
                settings.process_group_workers, names, settings.self_name
            )
        maps: dict = {}
        chosen: dict = {}
        if settings.wants_devices:
            maps, chosen = self.plan_devices(engine_ids, names)
            me = settings.self_name
            member = _join_kernel(
                settings, self.kernel, maps.get(me, {}), chosen.get(me), self.booted.transports
            )
            _fence.admit(self.members)  # the kernel's new listeners too
        assert member is not None
        _kernel_devices.lend(maps.get(member.name, {}), chosen.get(member.name))
        fenced = sorted(self.members) if self.members is not None else None
        joining = Joining(settings, self.engines, self.booted, member, fenced, self.progress)
        infos = self.join_workers(joining, joining.places(names, engine_ids), maps, chosen)
        self.booted.device_maps = maps
        joining.after_join(names, names, fresh=True)
        if settings.process_group:
            t_pg = time.monotonic()
            devices = {name: infos[name]["devices"] for name in names}
            joining.start_process_group(settings.process_group, members, devices)
            phases["process group"] = _since(t_pg)
            self.progress.phase("process group", phases["process group"], settings.process_group)
        kernel, me = self.kernel, member.name
        _states.booted(
            self.booted.roster,
            [
                WorkerRecord(me, 0, kernel["pid"], kernel["host"], "kernel", kernel["devices"]),
                *(joining.record(name, infos[name], i) for i, name in enumerate(names, 1)),
            ],
        )
        phases["total"] = _since(self.t0)

    def registered(self, count: int, note: str = "") -> None:
        """``count`` engines registered; ``note``: what the others wait for (a queued job)."""
        for name in self.placeholder[:count]:
            self.progress.update(name, 1)
        if note:
            for name in self.placeholder[count:]:
                self.progress.update(name, 0, note)

    def start_engines(self) -> KernelMembership | None:
        """The engine source starts; without device maps the kernel joins meanwhile.
        Returns the kernel's membership, if it joined."""
        settings, engines, phases = self.settings, self.engines, self.booted.seconds
        source = engines.source
        if self.members is not None:  # before any socket of the cluster listens
            self.members.update(source.hosts())
            _fence.admit(self.members)
        source.start()  # local engines start now and import torch while the kernel joins
        if self.members is not None:  # before engines on other hosts are launched
            engines.fence_controller()
        if source.reused:
            self.progress.phase("controller", 0.0, source.reused)
        member: KernelMembership | None = None
        if not settings.wants_devices:  # join at once; device maps must wait for the workers
            member = _join_kernel(settings, self.kernel, {}, None)
            _fence.admit(self.members)  # its TensorPipe listeners, once they exist
        source.launch(settings.n or 0)
        engines.connect()
        if self.members is not None:  # it listens now that a client got in: all its sockets
            engines.fence_controller()
        started = source.controller_seconds()
        if started is not None and not phases.get("controller"):
            phases["controller"] = 0.0 if source.reused else min(started, _since(self.t0))
            if not source.reused:
                self.progress.phase("controller", phases["controller"], source.afresh_because)
        return member

    def admit_engines(self, engine_ids: list[int]) -> None:
        """Add the addresses the engines reach the kernel from (an attached cluster's hosts
        are known only now) to the members, before any of them joins."""
        if self.members is None:
            return
        asked = [
            self.engines.apply(eid, worker.address_toward, self.settings.listen)
            for eid in engine_ids
        ]
        self.members.update(ar.get(timeout=JOIN_TIMEOUT_S) for ar in asked)
        _fence.admit(self.members)
        self.engines.fence_controller()

    def plan_devices(self, engine_ids: list[int], names: list[str]) -> tuple[dict, dict]:
        """Ask each engine for its devices, then plan and check every map before any join,
        and choose the transports the processes join with (on the kernel's host, how many
        there are)."""
        asked = [self.engines.apply(eid, worker.describe_process) for eid in engine_ids]
        described = {self.settings.self_name: self.kernel}
        for name, ar in zip(names, asked, strict=True):
            try:
                described[name] = ar.get(timeout=JOIN_TIMEOUT_S)
            except Exception as exc:
                raise BootError(f"{name} could not describe its devices: {exc}") from exc
        maps, chosen = _devices.plan(described, self.settings.gpus, self.settings.device_maps)
        here = sum(info["host"] == self.kernel["host"] for info in described.values())
        self.booted.transports = _network.transports_for(bool(maps), here)
        return maps, chosen

    def join_workers(
        self, joining: Joining, places: dict[str, tuple[int, int]], maps: dict, chosen: dict
    ) -> dict[str, dict]:
        """Every worker joins at once (``places``: name -> (rank, engine id)), timed; their
        descriptions."""
        phases = self.booted.seconds
        t_join = time.monotonic()
        infos = joining.join(places, maps, chosen)
        imported = self.engines.source.import_seconds()
        if imported is not None:
            phases["torch import"] = imported
            note = "once, in the process engines fork from"
            self.progress.phase(
                "torch import",
                imported,
                "done before this cluster" if self.engines.source.reused else note,
            )
        phases["join"] = _since(t_join)
        self.progress.phase("join", phases["join"], "init_rpc")
        return infos


class Joining:
    """Workers joining the kernel's group: the steps a boot and a restart share, in order.

    :meth:`places` hands out ranks (never reused: torch caches connections by rank),
    :meth:`join` asks every engine at once and waits for them, :meth:`record` is a joined
    worker's row, then :meth:`set_up_fast_path` and :meth:`start_process_group`. A grow
    or a restart that fails or is stopped in its join cleans up with
    :meth:`clean_up_unjoined` (the engines' pids from :meth:`describe`). What they
    make goes into ``booted``. ``members``: who may connect, across hosts (None: loopback).
    """

    def __init__(
        self,
        settings: Settings,
        engines: Engines,
        booted: Booted,
        member: KernelMembership,
        members: list[str] | None,
        progress: BootProgress,
    ) -> None:
        self.settings, self.engines, self.booted = settings, engines, booted
        self.member, self.members, self.progress = member, members, progress
        self.first_rank: int | None = None  # of the ranks this joining handed out

    def places(self, names: list[str], engine_ids: list[int]) -> dict[str, tuple[int, int]]:
        """Each name's new rank and its engine id."""
        ranks = self.member.allocate_ranks(len(names))
        self.first_rank = ranks[0]
        return {name: (r, eid) for name, r, eid in zip(names, ranks, engine_ids, strict=True)}

    def join(
        self,
        places: dict[str, tuple[int, int]],
        maps: dict,
        chosen: dict,
        infos: dict[str, dict] | None = None,
    ) -> dict[str, dict]:
        """Every worker in ``places`` joins at once, with its device maps and devices
        (:func:`nbrpc._engines.worker.join`); what each reported of itself (also in
        ``infos`` as they come: a scale stopped half way keeps those that joined)."""
        pending: dict[str, Any] = {}
        for name, (rank, eid) in places.items():
            self.progress.update(name, 2)
            _states.asked_to_join(self.booted.roster, name, eid)  # before: a stop may land
            pending[name] = self.engines.apply(
                eid,
                worker.join,
                name,
                rank,
                self.member.spec.to_dict(),
                self.member.name,
                self.settings.rpc_timeout,
                self.settings.num_worker_threads,
                maps.get(name),
                _devices.joining_devices(name, maps, chosen),
                self.members,
                self.booted.transports,
            )
            self.booted.asked[name] = pending[name]  # until answered (Booted.let_joins_end)
        joined = wait_for_joins(pending, self.progress, infos)
        for name in pending:
            self.booted.asked.pop(name, None)
        return joined

    def record(self, name: str, info: dict, order: int = 0) -> WorkerRecord:
        """The row of worker ``name``, from what its join reported (``info``); ``order``:
        its ``nbrpc.rank()`` (a restart keeps the old row's)."""
        eid = self.booted.roster.joining[name]  # (asked to join, not yet recorded)
        return WorkerRecord(
            name,
            info["rank"],
            info["pid"],
            info["host"],
            f"engine {eid}",
            info["devices"],
            eid,
            local=not self.engines.source.remote,
            order=order,
        )

    def after_join(self, joined: list[str], ready: list[str], fresh: bool = False) -> None:
        """What follows every join, a boot's, a grow's and a restart's, in one order
        (``joined``: the workers that just joined; ``ready``: every ready worker, they
        among them; ``fresh``: a boot's, whose fast path is decided now):

        1. lanes and shared memory (:meth:`set_up_fast_path`): to the joined workers,
           and across hosts to every worker (each one's peers changed);
        2. clocks (:func:`nbrpc._gather.timeline.measure_clocks`): after the lanes, so
           the offsets are measured on the route calls will take;
        3. device maps (:meth:`Booted.devices_back`): every ready process gets back the
           CUDA devices and reply maps torch's dynamic group dropped at the join;
        4. side doors: told that the joined workers settled
           (:func:`nbrpc._states.settled`), the cluster's listener connects to their doors
           (``Aside.on_worker_change``; a boot's, once the cluster is ready).
        """
        booted = self.booted
        if fresh or booted.fast_path or booted.lanes:
            self.set_up_fast_path(ready if self.engines.source.remote else joined)
        timeline.measure_clocks(joined)
        booted.devices_back(ready)
        _states.settled(joined)

    def set_up_fast_path(self, names: list[str]) -> None:
        """The workers ``names``' shared memory and lanes (:func:`nbrpc._setup.fast_path`;
        with device maps too: a call holding a CUDA tensor takes TensorPipe, the route
        says), kept in the boot's record."""
        settings, booted = self.settings, self.booted
        done = _setup.fast_path(
            segment_prefix(os.getpid()),
            settings.shm_threshold,
            self.member.name,
            names,
            remote=self.engines.source.remote,
            loopback=self.member.spec.loopback_only,
            lanes_asked=settings.fast_calls,
            threads=settings.num_worker_threads,
        )
        booted.fast_path = done.shm
        if done.shm_peers is not None:
            booted.shm_peers = done.shm_peers
        if done.lanes is not None:
            booted.lanes = done.lanes

    def describe(self, engine_ids: list[int]) -> dict[int, dict]:
        """Each new engine's pid and host, before it joins (a stop button during the join
        then knows what to stop)."""
        asked = {eid: self.engines.apply(eid, worker.describe_process) for eid in engine_ids}
        return {eid: ar.get(timeout=JOIN_TIMEOUT_S) for eid, ar in asked.items()}

    def clean_up_unjoined(
        self,
        taken: dict[str, tuple[int | None, int]],
        described: dict[int, dict],
        infos: dict[str, dict],
    ) -> None:
        """After a grow or a restart that failed or was stopped: the workers that did not
        join (not in ``infos``) are out of the group, whether they joined half way or not at
        all, and the engines taken for them stop (``taken``: name -> (its torch rank, if
        handed out; its engine id); ``described``: their pids, where known)."""
        booted, engines = self.booted, self.engines
        for name in taken:  # (a grow's or a restart's: no boot waits for them)
            booted.asked.pop(name, None)
        missing = [name for name in taken if name not in infos]
        if not missing:
            return
        _states.leaving(missing)
        ids = [taken[name][1] for name in missing]
        try:
            engines.shrink(ids, [described[eid]["pid"] for eid in ids if eid in described])
        finally:
            stayers = booted.roster.ready()
            stayers += list(infos)  # those that joined (adopted next) heard of the others too
            ranked = {name: rank for name in missing if (rank := taken[name][0]) is not None}
            try:  # a join that got as far as telling the members: they forget it
                _departures.tell_peers_left(ranked, stayers)
            finally:
                _departures.forget_names(missing)
                _states.not_joined(booted.roster, missing)

    def start_process_group(self, backend: str, members: list[str], devices: dict) -> None:
        """The workers' torch.distributed group among ``members`` (a boot's, or a restart's
        rebuild), its store keys apart from every earlier group's: the first of the ranks
        this joining handed out names them."""
        assert self.first_rank is not None, "places() handed out ranks first"
        prefix = f"nbrpc-process-group/{os.getpid()}/{self.first_rank}"
        self.booted.process_group = collective.start(
            backend, members, self.member.spec.to_dict(), prefix, devices
        )


def _since(t0: float) -> float:
    return time.monotonic() - t0


def _join_kernel(
    settings: Settings,
    kernel: dict,
    device_maps: dict,
    devices: list[str] | None,
    transport_names: list[str] | None = None,
) -> KernelMembership:
    """The kernel's membership; at its first join on a host with CUDA devices, with maps
    prepared for later GPU clusters (``kernel``: its ``describe_process()``; see
    :mod:`nbrpc._kernel_devices`)."""
    first = _group.current_kernel_membership() is None
    withhold = False
    if first:
        with contextlib.suppress(Exception):  # tidying only: never in the way of a boot
            sweep_dead_kernels_stores()  # what killed kernels left (see there)
        device_maps, withhold = _kernel_devices.first_join(kernel["devices"], device_maps)
    member = _group.kernel_membership(
        settings.self_name,
        init_method=settings.init_method,
        listen=settings.listen,
        rpc_timeout=settings.rpc_timeout,
        num_worker_threads=settings.num_worker_threads,
        device_maps=device_maps,
        devices=devices,
        files=segment_prefix(os.getpid()),
        transport_names=transport_names,
        withhold=withhold,
    )
    if first and member.spec.kind == "file":
        with contextlib.suppress(OSError):
            hold_store(os.path.dirname(member.spec.path))
    return member


def wait_for_joins(
    pending: dict[str, Any], progress: BootProgress, infos: dict[str, dict] | None = None
) -> dict[str, dict]:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    infos = {} if infos is None else infos
    while len(infos) < len(pending):
        for name, ar in pending.items():
            if name in infos or not ar.ready():
                continue
            try:
                infos[name] = ar.get()
            except Exception as exc:
                progress.fail(name, type(exc).__name__)
                raise BootError(
                    f"{name} could not join the RPC group: {remote_message(exc)}"
                ) from None
            progress.update(name, 3, f"pid {infos[name]['pid']}")
        if time.monotonic() > deadline:
            missing = [n for n in pending if n not in infos]
            raise BootError(
                f"{', '.join(missing)} did not join the RPC group within {JOIN_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.02)
    return infos
