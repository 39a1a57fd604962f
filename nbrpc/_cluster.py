"""The lifecycle of a cluster: boot, run, shut down; one cluster current at a time.

A cluster is the kernel plus worker processes that joined its torch RPC group. Its pieces
live in their own modules: what was asked for in :mod:`nbrpc._settings` (frozen, checked
before anything starts), the ipyparallel engines in :mod:`nbrpc._engines` (the control
plane: start, run bootstrap code, stop), the RPC group in :mod:`nbrpc._group` (the data
plane), the tables it prints in :mod:`nbrpc._views`. This module orders them.

Lifecycle (``Cluster.state``), the one record of whether a cluster is up::

    NOT_STARTED ──> BOOTING ──> READY ──> SHUTTING_DOWN ──> CLOSED
                       └──(failure: what started is stopped)──> CLOSED

A cluster becomes *current* when it starts booting (``nbrpc.current()``), whether made by
``nbrpc.init`` or as ``nbrpc.Cluster(...).start()``, and stops being current when it is
closed. Starting a second one while one is current is refused. After ``shutdown`` a new
``init`` in the same process is a supported transition (see :mod:`nbrpc._group` for how).
A cluster still running at interpreter exit is shut down by an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from . import (
    _agent,
    _collective,
    _debugger,
    _devices,
    _group,
    _launch,
    _ledger,
    _reaper,
    _shm,
    _torch,
    _views,
    _worker,
)
from ._engines import JOIN_TIMEOUT_S, Engines, remote_message
from ._errors import AlreadyInitializedError, BootError, ClusterClosedError, NotInitializedError
from ._progress import BootProgress
from ._reaper import process_alive
from ._rows import StatusRow
from ._settings import Settings, validate_names

__all__ = ["Cluster", "ClusterState", "WorkerRecord", "current", "init", "shutdown", "status"]

log = logging.getLogger("nbrpc")

LEAVE_TIMEOUT_S = 30.0
DEAD_RELEASE_TIMEOUT_S = 2.0  # RRefs owned by a dead worker are never confirmed: do not wait
# Releasing the kernel's RRefs takes milliseconds when every owner answers; one that died
# in an earlier cluster leaves torch waiting for the whole timeout, so bound it.
RELEASE_TIMEOUT_S = 5.0
NOTHING_HELD_RELEASE_TIMEOUT_S = 0.2


class ClusterState(enum.Enum):
    NOT_STARTED = "not started"
    BOOTING = "booting"
    READY = "ready"
    SHUTTING_DOWN = "shutting down"
    CLOSED = "closed"


_NEXT = {
    ClusterState.NOT_STARTED: {ClusterState.BOOTING},
    ClusterState.BOOTING: {ClusterState.READY, ClusterState.SHUTTING_DOWN},
    ClusterState.READY: {ClusterState.SHUTTING_DOWN},
    ClusterState.SHUTTING_DOWN: {ClusterState.CLOSED},
    ClusterState.CLOSED: set(),
}


@dataclass
class WorkerRecord:
    """One process of the group, as the notebook shows it."""

    name: str
    rank: int
    pid: int
    host: str
    role: str  # "kernel" or "engine N"
    devices: list[str] = field(default_factory=list)
    engine_id: int | None = None
    state: str = "ready"
    local: bool = True  # on the kernel's host: its pid is this host's

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_current: list[Cluster] = []  # the current cluster, from BOOTING until CLOSED


class Cluster:
    """A group: the kernel plus its workers. :func:`nbrpc.init` makes and starts one;
    ``nbrpc.Cluster(n=2).start()`` does the same, also as ``with ... as cluster:``."""

    def __init__(
        self,
        n: int | None = None,
        *,
        names: list[str] | None = None,
        self_name: str = "worker0",
        num_worker_threads: int | None = None,
        rpc_timeout: float | None = None,
        init_method: str | None = None,
        profile: str | None = None,
        cluster_id: str | None = None,
        progress: str | bool = "auto",
        listen: str | None = None,
        gpus: str | None = None,
        device_maps: dict[str, dict] | None = None,
        shm_threshold: int | None = _shm.DEFAULT_THRESHOLD,
        python: str | None = None,
        process_group: str | None = None,
        process_group_workers: list[str] | None = None,
        hosts: str | list[str] | None = None,
        ssh_args: str | list[str] | None = None,
        remote_python: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or Settings.make(
            n,
            names=names,
            self_name=self_name,
            num_worker_threads=num_worker_threads,
            rpc_timeout=rpc_timeout,
            init_method=init_method,
            profile=profile,
            cluster_id=cluster_id,
            progress=progress,
            listen=listen,
            gpus=gpus,
            device_maps=device_maps,
            shm_threshold=shm_threshold,
            python=python,
            process_group=process_group,
            process_group_workers=process_group_workers,
            hosts=hosts,
            ssh_args=ssh_args,
            remote_python=remote_python,
        )
        self.state = ClusterState.NOT_STARTED
        self.records: list[WorkerRecord] = []
        #: where the boot's time went, in seconds from its start: "controller" (connected;
        #: 0 when kept from the last cluster), "engines" (all registered), "torch import"
        #: (the zygote's imports, 0 when it ran before), "join" (its own length), "total"
        self.boot_seconds: dict[str, float] = {}
        self.device_maps: dict = {}  # every process's maps, once booted
        self.fast_path = False  # large CPU tensors through shared memory (decided at boot)
        #: across hosts: each process's peers that see its /dev/shm (the fast path's reach)
        self.shm_peers: dict[str, list[str]] = {}
        self.process_group: _collective.ProcessGroupInfo | None = None
        self._engines = Engines(self.settings)
        self._engine_of: dict[str, int] = {}

    # settings the notebook and tests read from the cluster itself
    n = property(lambda self: self.settings.n)
    names = property(lambda self: self.settings.names)
    self_name = property(lambda self: self.settings.self_name)
    attached = property(lambda self: self.settings.attached)
    shm_threshold = property(lambda self: self.settings.shm_threshold)

    # -- lifecycle -------------------------------------------------------------------

    def _enter(self, state: ClusterState) -> None:
        """The one place the state changes; what depends on it follows here."""
        if state not in _NEXT[self.state]:
            raise ClusterClosedError(
                f"a cluster that is {self.state.value} cannot become {state.value}"
            )
        self.state = state
        _agent.set_active(state is ClusterState.READY, last_output=self.last_output)
        if state in (ClusterState.SHUTTING_DOWN, ClusterState.CLOSED):
            _debugger.reset()  # a prompt waiting for the kernel must not hold shutdown up
        if state is ClusterState.CLOSED and _current and _current[0] is self:
            _current.clear()

    def start(self) -> Cluster:
        """Boot: start (or attach to) the engines and join them; this becomes current."""
        if self.state is not ClusterState.NOT_STARTED:
            raise ClusterClosedError(
                f"this cluster is {self.state.value}: a Cluster starts once. Start a new one "
                "with nbrpc.init() (or %rpc_init)."
            )
        if _current:
            running = ", ".join(r.name for r in _current[0].records) or "booting"
            raise AlreadyInitializedError(
                f"an nbrpc cluster is already running ({running}). Run %rpc_shutdown "
                "(or nbrpc.shutdown()) first, then start a new one."
            )
        _current.append(self)
        self._enter(ClusterState.BOOTING)
        try:
            self._boot()
        except BaseException as exc:
            # an engine that failed to start: the others were started the same way
            self._abandon(release=isinstance(exc, BootError))
            raise
        self._enter(ClusterState.READY)
        return self

    def _boot(self) -> None:
        t0 = time.monotonic()
        _route_torch_shutdown()
        settings, engines, phases = self.settings, self._engines, self.boot_seconds
        placeholder = settings.worker_names(settings.n or 0)
        progress = BootProgress(placeholder, settings.progress if settings.n else "off")
        kernel = _worker.describe_process()
        if settings.wants_devices:  # the kernel's own side is known now: refuse before any start
            _devices.check_local(
                settings.self_name,
                settings.device_maps,
                settings.gpus,
                kernel["devices"],
                kernel["host"],
            )
        engines.start()  # local engines start now and import torch while the kernel joins
        if engines.reused:
            progress.phase("controller", 0.0, "kept from the last cluster")
        member = None
        if not settings.wants_devices:  # join at once; device maps must wait for the workers
            member = self._join_kernel({}, None)
        engines.reserve(settings.n or 0)
        engines.connect()
        if engines.local is not None and not phases.get("controller"):
            phases["controller"] = (
                0.0 if engines.reused else min(engines.controller_seconds or 0.0, _since(t0))
            )
            if not engines.reused:
                progress.phase("controller", phases["controller"])

        def registered(count: int) -> None:
            for name in placeholder[:count]:
                progress.update(name, 1)

        engine_ids = engines.wait(settings.n, registered)
        phases["engines"] = _since(t0)
        progress.phase("engines", phases["engines"], "registered")
        names = settings.worker_names(len(engine_ids))
        validate_names(names, settings.self_name)
        if settings.process_group:  # refuse unknown members before any join
            pg_members = _collective.members_of(settings.process_group_workers, names)
        maps: dict = {}
        chosen: dict = {}
        if settings.wants_devices:
            maps, chosen = self._plan_devices(engine_ids, names, kernel)
            member = self._join_kernel(
                maps.get(settings.self_name, {}), chosen.get(settings.self_name)
            )
        assert member is not None
        ranks = member.allocate_ranks(len(engine_ids))
        pending = {}
        t_join = time.monotonic()
        for name, rank, eid in zip(names, ranks, engine_ids, strict=True):
            progress.update(name, 2)
            pending[name] = engines.apply(
                eid,
                _worker.join,
                name,
                rank,
                member.spec.to_dict(),
                member.name,
                settings.rpc_timeout,
                settings.num_worker_threads,
                maps.get(name),
                chosen.get(name),
            )
            self._engine_of[name] = eid
        infos = self._wait_for_joins(pending, progress)
        if engines.local is not None:
            phases["torch import"] = 0.0 if engines.reused else (engines.torch_import_seconds or 0)
            progress.phase(
                "torch import",
                phases["torch import"],
                "done before this cluster"
                if engines.reused
                else "once, in the process engines fork from",
            )
        phases["join"] = _since(t_join)
        progress.phase("join", phases["join"], "init_rpc")
        if engines.remote:
            self.shm_peers = self._share_memory_by_host(member.name)
            self.fast_path = any(self.shm_peers.values())
        else:
            self.fast_path = self._configure_fast_path(member.spec.loopback_only)
        if settings.process_group:
            t_pg = time.monotonic()
            prefix = f"nbrpc-process-group/{os.getpid()}/{ranks[0]}"  # ranks are never reused
            self.process_group = _collective.start(
                settings.process_group,
                pg_members,
                member.spec.to_dict(),
                prefix,
                {name: infos[name]["devices"] for name in names},
            )
            phases["process group"] = _since(t_pg)
            progress.phase("process group", phases["process group"], settings.process_group)
        self.device_maps = maps
        self.records = [
            WorkerRecord(member.name, 0, kernel["pid"], kernel["host"], "kernel", kernel["devices"])
        ]
        for name in names:
            info, eid = infos[name], self._engine_of[name]
            self.records.append(
                WorkerRecord(
                    name,
                    info["rank"],
                    info["pid"],
                    info["host"],
                    f"engine {eid}",
                    info["devices"],
                    eid,
                    local=not engines.remote,
                )
            )
        phases["total"] = _since(t0)

    def _configure_fast_path(self, local: bool) -> bool:
        """Shared memory for large tensors, if every worker sees this kernel's /dev/shm.

        All or none: a process that sent a segment name to one that cannot open it would
        break the call. A probe segment tells "same host and same /dev/shm" apart from
        "same hostname".
        """
        prefix = _reaper.segment_prefix(os.getpid())
        threshold = self.settings.shm_threshold
        if threshold is None or not local:
            _shm.configure(prefix, None)
            return False
        probe = os.path.join(_shm.SHM_DIR, f"{prefix}-probe")
        try:
            with open(probe, "w"):
                pass
        except OSError:
            _shm.configure(prefix, None)
            return False
        ids = list(self._engine_of.values())
        try:  # bounded: an engine may have died
            on = all(
                self._engines.run_on(ids, _worker.configure_fast_path, prefix, threshold, probe)
            )
            if not on:
                self._engines.run_on(ids, _worker.configure_fast_path, prefix, None, probe)
        finally:
            os.unlink(probe)
        _shm.configure(prefix, threshold if on else None)
        return _shm.enabled()

    def _share_memory_by_host(self, me: str) -> dict[str, list[str]]:
        """Across hosts: the fast path between the processes that share a ``/dev/shm``.

        Every process leaves a probe file in its ``/dev/shm``; then each one lists the
        probes it sees (its peers on the same host, whatever their hostnames say) and
        turns the fast path on towards those alone; then the probes go.
        """
        prefix = _reaper.segment_prefix(os.getpid())
        threshold = self.settings.shm_threshold
        if threshold is None:
            _shm.configure(prefix, None)
            return {}

        def each(step: str) -> dict[str, Any]:
            asked = {
                name: self._engines.apply(eid, _worker.share_memory, prefix, name, threshold, step)
                for name, eid in self._engine_of.items()
            }
            found = {me: _worker.share_memory(prefix, me, threshold, step)}
            for name, ar in asked.items():
                found[name] = ar.get(timeout=JOIN_TIMEOUT_S)
            return found

        try:
            each("probe")
            return each("configure")
        finally:
            each("done")

    @property
    def wants_devices(self) -> bool:
        return self.settings.wants_devices

    def _join_kernel(self, device_maps: dict, devices: list[str] | None) -> Any:
        settings = self.settings
        return _group.kernel_membership(
            settings.self_name,
            init_method=settings.init_method,
            listen=settings.listen,
            rpc_timeout=settings.rpc_timeout,
            num_worker_threads=settings.num_worker_threads,
            device_maps=device_maps,
            devices=devices,
        )

    def _plan_devices(
        self, engine_ids: list[int], names: list[str], kernel: dict
    ) -> tuple[dict, dict]:
        """Ask each engine for its devices, then plan and check every map before any join."""
        asked = [self._engines.apply(eid, _worker.describe_process) for eid in engine_ids]
        described = {self.settings.self_name: kernel}
        for name, ar in zip(names, asked, strict=True):
            try:
                described[name] = ar.get(timeout=JOIN_TIMEOUT_S)
            except Exception as exc:
                raise BootError(f"{name} could not describe its devices: {exc}") from exc
        devices = {name: info["devices"] for name, info in described.items()}
        hosts = {name: info["host"] for name, info in described.items()}
        chosen: dict = {}
        maps: dict = {}
        if self.settings.gpus == "auto":
            chosen, maps = _devices.plan_gpus(devices, hosts)
        for src, by_dest in self.settings.device_maps.items():
            for dest, mapping in by_dest.items():
                maps.setdefault(src, {})[dest] = mapping  # given by hand: wins over the plan
        _devices.validate(maps, devices, hosts)
        return maps, chosen

    def _wait_for_joins(self, pending: dict[str, Any], progress: BootProgress) -> dict[str, dict]:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        infos: dict[str, dict] = {}
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

    def _abandon(self, release: bool) -> None:
        """After a failed boot: stop what was started, leave the kernel usable.

        ``release``: stop the controller and spare engines too (start afresh next time).
        They are also released when the boot failed after it took engines (a bad process
        group member, a device map the workers' devices refuse): the launcher knows those
        engines by id only, and a later boot would take their exit for a failed start.
        """
        release = release or bool(self._engines.taken)
        self._enter(ClusterState.SHUTTING_DOWN)
        names = list(self._engine_of)  # every worker asked to join, joined or not
        try:
            # stopped, not asked to leave: torch's leave waits for the group's join token,
            # which a worker whose join failed half way may hold (30 s, then an error)
            self._engines.stop([r.pid for r in self.records[1:] if r.local], keep_spares=False)
        finally:
            try:
                if names and _torch.agent_is_set():
                    _group.forget_names(names)
            except Exception as exc:
                log.warning("removing %s from the group: %s", ", ".join(names), exc)
            if release and self._engines.local is not None:
                _launch.release()
            self._enter(ClusterState.CLOSED)

    def dead_workers(self, ask_ipyparallel: bool = True) -> list[str]:
        """Workers whose process is gone, from what ipyparallel and the OS know.

        An engine that ipyparallel no longer lists (its heartbeat stopped, or its nanny
        reported the exit) is dead; so is a worker on this host whose pid is gone.
        ``ask_ipyparallel=False`` checks pids only: the ipyparallel client is not
        thread-safe, and the live views call this from their own thread.
        """
        if self._engines.client is None:
            return [r.name for r in self.records[1:] if r.state == "dead"]
        engines = self._engines.alive() if ask_ipyparallel else None
        for record in self.records[1:]:
            if record.state != "ready":
                continue
            gone = engines is not None and record.engine_id not in engines
            if not gone and record.local:
                gone = not process_alive(record.pid)
            if gone:
                record.state = "dead"
                _debugger.forget_worker(record.name)
        return [r.name for r in self.records[1:] if r.state == "dead"]

    def last_output(self, name: str) -> str:
        """What worker ``name``'s process printed last outside calls (its engine log): the
        reason a crash leaves, such as a C++ abort's message. "" for a worker on another
        host, or one that printed nothing (``kill -9`` and the OOM killer leave no trace)."""
        record = next((r for r in self.records[1:] if r.name == name), None)
        if record is None or not record.local:
            return ""
        return self._engines.last_output(record.pid)

    def _live_engine_ids(self) -> list[int]:
        if self._engines.client is None or not self._engine_of:
            return []
        dead = set(self.dead_workers())
        return [eid for name, eid in self._engine_of.items() if name not in dead]

    def shutdown(
        self, graceful: bool = True, timeout: float = LEAVE_TIMEOUT_S, release: bool = False
    ) -> None:
        """Workers leave the group; engines this cluster started are stopped.

        ``release``: also stop the controller and the warm spare engines that make the
        next ``init`` fast (see :mod:`nbrpc._launch`); interpreter exit does it anyway.

        ``graceful``: workers finish their calls in flight (bounded by ``timeout``) and
        leave. Otherwise the kernel drops them from the group at once and the engines are
        stopped; calls still in flight fail with :class:`WorkerDiedError`.
        Engines of an attached ipyparallel cluster keep running. The kernel stays in the
        group, alone, so that a later ``init`` can bring new workers (see ``_group``).
        """
        if self.state is not ClusterState.READY:  # never started, or already closed
            if release:
                _launch.release()
            return
        self._enter(ClusterState.SHUTTING_DOWN)
        try:
            dead = self.dead_workers()
            if graceful:
                self._wait_for_calls_in_flight(timeout)
            else:
                _agent.cancel_calls_in_flight()
            if not graceful:  # nobody leaves by themselves: the kernel forgets them all
                dead = [r.name for r in self.records[1:]]
                for record in self.records[1:]:
                    record.state = "stopped"
            if dead:
                live = [r.name for r in self.records[1:] if r.state == "ready"]
                try:
                    _group.forget(dead, live)
                except Exception as exc:
                    log.warning("removing %s from the group: %s", ", ".join(dead), exc)
            if graceful:
                try:
                    _group.release_user_rrefs(self._release_timeout(timeout, bool(dead)))
                except Exception as exc:
                    log.warning("releasing the kernel's RRefs: %s", exc)
                if self.process_group:
                    live = [r.name for r in self.records[1:] if r.state == "ready"]
                    _collective.destroy(self.process_group, live)
                self._engines.leave(self._live_engine_ids(), graceful, timeout)
            if dead:
                _group.release_stale_token()
        finally:
            local = [r.pid for r in self.records[1:] if r.local]
            self._engines.stop(local, keep_spares=not release)
            if release:
                _launch.release()
            _reaper.sweep_segments(_reaper.segment_prefix(os.getpid()))
            for record in self.records[1:]:
                if record.state == "ready":
                    record.state = "stopped"
            self._enter(ClusterState.CLOSED)

    @staticmethod
    def _release_timeout(timeout: float, dead: bool) -> float:
        """How long torch may wait for owners to confirm the kernel's RRef deletions.

        torch waits the whole bound for an owner that died, in this cluster or an earlier
        one (measured: 5 s added to every later shutdown). With no RRef of another
        process held by the kernel there is nothing left to confirm worth waiting for.
        """
        if dead:
            return DEAD_RELEASE_TIMEOUT_S
        if not _ledger.holds_user_rrefs():
            return NOTHING_HELD_RELEASE_TIMEOUT_S
        return min(timeout, RELEASE_TIMEOUT_S)

    def _wait_for_calls_in_flight(self, timeout: float) -> None:
        """Graceful: the kernel's calls still running finish first (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if _agent.calls_in_flight() == 0:
                    return
            except Exception:
                return
            if self.dead_workers():  # a dead worker's calls fail by themselves
                return
            time.sleep(0.05)
        log.warning("shutdown: calls still running after %.0f s; leaving anyway", timeout)

    def __enter__(self) -> Cluster:
        if self.state is ClusterState.NOT_STARTED:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- views -----------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerRecord]:
        return list(self.records)

    def status(
        self, timeout: float = _agent.SNAPSHOT_TIMEOUT_S, ask_ipyparallel: bool = True
    ) -> list[StatusRow]:
        """Live figures per process: the record (state, pid, host, devices, role) plus
        ``calls_in_flight``, ``calls_done`` (Python calls it served), ``rrefs_owned`` and
        ``rrefs_held`` (Python RRef handles it holds).

        Figures are ``None`` for a process that is not ready or did not answer in time.
        """
        snaps: dict[str, dict] = {}
        if self.state is ClusterState.READY:
            dead = set(self.dead_workers(ask_ipyparallel))
            snaps = _agent.snapshots(timeout, skip=dead)
        rows: list[StatusRow] = []
        for r in self.records:
            snap = snaps.get(r.name) if r.state == "ready" else None
            rows.append(
                StatusRow(
                    name=r.name,
                    rank=r.rank,
                    pid=r.pid,
                    host=r.host,
                    role=r.role,
                    devices=list(r.devices),
                    engine_id=r.engine_id,
                    state=r.state,
                    calls_in_flight=snap["calls_in_flight"] if snap else None,
                    calls_done=snap["calls_done"] if snap else None,
                    rrefs_owned=snap["owned"] if snap else None,
                    rrefs_held=len(snap["handles"]) if snap else None,
                    device_maps=self.device_maps.get(r.name, {}),
                )
            )
        return rows

    def _rows(self) -> list[dict[str, Any]]:
        if self.state is ClusterState.READY:
            self.dead_workers()
        return [
            {**r.as_dict(), "device_maps": self.device_maps.get(r.name, {})} for r in self.records
        ]

    def summary(self) -> str:
        """The processes, their ranks, pids, hosts and states, as text."""
        notes = []
        shared = sorted({n for peers in self.shm_peers.values() for n in peers})
        if self.shm_peers and shared:
            notes.append(
                f"CPU tensors of {(self.settings.shm_threshold or 0) / 2**20:g} MB and more "
                f"travel through shared memory between processes of one host "
                f"({', '.join(shared)}), through TensorPipe between hosts"
            )
        elif self.state is ClusterState.READY or self.fast_path:
            notes.append(
                f"CPU tensors of {(self.settings.shm_threshold or 0) / 2**20:g} MB and more "
                "travel through shared memory"
                if self.fast_path
                else "CPU tensors travel through TensorPipe only"
            )
        group = _collective.describe(self.process_group)
        if group:
            notes.append(group)
        if self.device_maps:
            notes.append("device maps (and where replies go):")
            notes.extend(f"  {line}" for line in _devices.describe(self.device_maps))
        return _views.records_text(
            self._rows(), self.state.value, self.boot_seconds.get("total"), notes
        )

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return _views.cluster_html(self._rows(), self.state.value)


def _since(t0: float) -> float:
    return time.monotonic() - t0


def init(
    n: int | None = None,
    *,
    names: list[str] | None = None,
    self_name: str = "worker0",
    num_worker_threads: int | None = None,
    rpc_timeout: float | None = None,
    init_method: str | None = None,
    profile: str | None = None,
    cluster_id: str | None = None,
    progress: str | bool = "auto",
    listen: str | None = None,
    gpus: str | None = None,
    device_maps: dict[str, dict] | None = None,
    shm_threshold: int | None = _shm.DEFAULT_THRESHOLD,
    python: str | None = None,
    process_group: str | None = None,
    process_group_workers: list[str] | None = None,
    hosts: str | list[str] | None = None,
    ssh_args: str | list[str] | None = None,
    remote_python: str | None = None,
) -> Cluster:
    """Start ``n`` workers (or attach to a running ipyparallel cluster) and join them.

    The calling process joins as ``self_name`` (rank 0); workers are named ``worker1`` ...
    ``workerN`` unless ``names`` is given. ``profile`` / ``cluster_id`` attach to an
    ipyparallel cluster that already runs (engines on other hosts included) instead of
    starting engines here; ``n`` then picks how many of its engines join (default: all).
    Without ``n``, ``names`` or an ipyparallel cluster: 2 workers.

    ``hosts=["root@h1", "h1", "h2"]`` starts one worker per entry on other hosts over ssh
    (through ipyparallel's SSH launcher), named in list order; ``ssh_args`` adds ssh options
    (the user's ssh config is read; BatchMode is always on), ``remote_python`` names the
    hosts' interpreter (default: this one's path). Each host is checked first (ssh login,
    same Python, torch, cloudpickle, ipyparallel and nbrpc versions, reaching this host),
    and ``listen`` defaults to this host's address on the route towards the first host.
    See docs/multi-host.md.

    Everything listens on loopback unless ``listen`` names one of this host's addresses:
    then the kernel's RPC endpoint, its membership store and the ipyparallel controller
    it starts listen there, for workers on other hosts. torch RPC has no authentication:
    whoever reaches those ports can run code here (docs/security.md).

    CUDA: ``gpus="auto"`` gives each process one GPU (round-robin per host) and maps every
    pair; ``device_maps={"worker1": {"cuda:0": "cuda:1"}}`` sets the kernel's maps by hand.
    Both are checked against the devices each process reports, before any ``init_rpc``.

    ``shm_threshold``: CPU tensors whose storage has at least this many bytes travel
    through shared memory when every process is on this host (``None``: never); see
    :mod:`nbrpc._shm`.

    ``process_group="gloo"`` (or ``"nccl"``): the workers also form a ``torch.distributed``
    process group, for collectives and DDP in ``%%rpc`` cells; ``process_group_workers``
    picks its members in rank order (default: every worker). See :mod:`nbrpc._collective`.
    """
    settings = Settings.make(
        n,
        names=names,
        self_name=self_name,
        num_worker_threads=num_worker_threads,
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        profile=profile,
        cluster_id=cluster_id,
        progress=progress,
        listen=listen,
        gpus=gpus,
        device_maps=device_maps,
        shm_threshold=shm_threshold,
        python=python,
        process_group=process_group,
        process_group_workers=process_group_workers,
        hosts=hosts,
        ssh_args=ssh_args,
        remote_python=remote_python,
    )
    return Cluster(settings=settings).start()


def current() -> Cluster:
    """The running cluster; raises :class:`NotInitializedError` when there is none."""
    if not _current:
        raise NotInitializedError("nbrpc.current()")
    return _current[0]


def shutdown(
    graceful: bool = True, timeout: float = LEAVE_TIMEOUT_S, release: bool = False
) -> None:
    """Shut the current cluster down (no-op when none runs).

    ``release=True`` also stops the controller and the warm spare engines kept for a fast
    next ``init`` (``%rpc_shutdown --release``).
    """
    if _current:
        _current[0].shutdown(graceful=graceful, timeout=timeout, release=release)
    elif release:
        _launch.release()


def status(timeout: float = _agent.SNAPSHOT_TIMEOUT_S) -> list[StatusRow]:
    """Live figures for each process of the current cluster (see :meth:`Cluster.status`)."""
    return current().status(timeout)


@atexit.register
def _at_exit() -> None:
    for cluster in list(_current):
        try:
            cluster.shutdown(graceful=False, timeout=5)
        except Exception as exc:
            log.warning("at exit: %s", exc)
    _launch.release()
    member = _group.current_kernel_membership()
    if member is not None:
        member.close()


def _torch_shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stands in for ``torch.distributed.rpc.shutdown`` in the kernel while nbrpc runs.

    Published tutorials end with ``rpc.shutdown()``. In a notebook that must stop the
    workers but keep the kernel's agent, or the next ``%rpc_init`` could not work.
    """
    shutdown(graceful=graceful, timeout=timeout or LEAVE_TIMEOUT_S)


def _route_torch_shutdown() -> None:
    _torch.route_user_shutdown(_torch_shutdown)
    _torch.quiet_internal_deprecations()
    _agent.install()
