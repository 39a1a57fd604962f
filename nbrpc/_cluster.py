"""Boot, attach to and stop the worker processes, through ipyparallel.

ipyparallel is the control plane: it launches engines (here, or on other hosts with any
of its launchers), lets the kernel run bootstrap code on them, and stops them.
``torch.distributed.rpc`` is the data plane: once an engine has run
:func:`nbrpc._worker.join`, every call goes through TensorPipe, never through ipyparallel.

Lifecycle (``Cluster.state``)::

    BOOTING ──> READY ──> SHUTTING_DOWN ──> CLOSED
       └──(failure: what started is stopped)──> CLOSED

One cluster is current at a time. After ``shutdown`` a new ``init`` in the same process
is a supported transition (see :mod:`nbrpc._group` for how). Clusters still running at
interpreter exit are shut down by an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from . import _agent, _devices, _group, _launch, _ledger, _reaper, _shm, _torch, _worker
from ._errors import AlreadyInitializedError, BootError, ClusterClosedError, NotInitializedError
from ._progress import BootProgress, in_notebook
from ._reaper import process_alive

__all__ = ["Cluster", "ClusterState", "WorkerRecord", "current", "init", "shutdown", "status"]

log = logging.getLogger("nbrpc")

DEFAULT_RPC_TIMEOUT_S = 60.0
DEFAULT_THREADS = 16
ENGINE_START_TIMEOUT_S = 90.0
JOIN_TIMEOUT_S = 90.0
LEAVE_TIMEOUT_S = 30.0
DEAD_RELEASE_TIMEOUT_S = 2.0  # RRefs owned by a dead worker are never confirmed: do not wait
# Releasing the kernel's RRefs takes milliseconds when every owner answers; one that died
# in an earlier cluster leaves torch waiting for the whole timeout, so bound it.
RELEASE_TIMEOUT_S = 5.0
NOTHING_HELD_RELEASE_TIMEOUT_S = 0.2


class ClusterState(enum.Enum):
    BOOTING = "booting"
    READY = "ready"
    SHUTTING_DOWN = "shutting down"
    CLOSED = "closed"


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_live: weakref.WeakSet[Cluster] = weakref.WeakSet()
_current: list[Cluster] = []


def _validate_names(names: list[str], self_name: str) -> None:
    for name in [self_name, *names]:
        if not name or len(name) >= 128 or not all(c.isalnum() or c in "_-" for c in name):
            raise ValueError(
                f"bad worker name {name!r}: use letters, digits, '_' or '-' "
                "(at most 127 characters), e.g. --names ps,trainer1"
            )
    if len(set(names)) != len(names) or self_name in names:
        raise ValueError(
            f"worker names must be unique and differ from the kernel's ({self_name!r}); "
            f"got {[self_name, *names]}"
        )


class Cluster:
    """A running group: the kernel plus its workers. Use :func:`nbrpc.init` to make one."""

    def __init__(
        self,
        n: int | None = 2,
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
    ) -> None:
        if names:
            names = [s.strip() for s in names]
            if n is not None and n != len(names):
                raise ValueError(f"-n {n} does not match {len(names)} names: {names}")
            n = len(names)
        self.attached = profile is not None or cluster_id is not None
        if n is None and not self.attached:
            n = 2
        if n is not None and n < 1:
            raise ValueError(f"-n must be at least 1, got {n}")
        self.n = n
        self.names = names
        self.self_name = self_name
        self.num_worker_threads = int(num_worker_threads or DEFAULT_THREADS)
        self.rpc_timeout = float(DEFAULT_RPC_TIMEOUT_S if rpc_timeout is None else rpc_timeout)
        self.init_method = init_method
        if init_method:
            _group.spec_from_init_method(init_method)  # refuse a bad URL before any start
        if gpus not in (None, "auto"):
            raise ValueError(f"--gpus {gpus!r}: only 'auto' is supported (one GPU per process)")
        self.gpus = gpus
        # the kernel's maps to workers, checked now for syntax, against devices at boot
        self.requested_maps = _devices.merge(self_name, (device_maps or {}).items())
        self.device_maps: dict = {}  # every process's maps, once booted
        if shm_threshold is not None and shm_threshold < 1:
            raise ValueError(
                f"shm_threshold must be a positive number of bytes or None, got {shm_threshold}"
            )
        self.shm_threshold = shm_threshold
        self.fast_path = False  # large CPU tensors through shared memory (decided at boot)
        self.listen = listen
        if listen:
            _group.interface_for(listen)  # refuse an address this host lacks, before any start
        self.profile = profile
        self.cluster_id = cluster_id
        self.python = python or sys.executable
        if progress == "auto":
            progress = "widget" if in_notebook() else "off"
        self.progress_mode = {True: "text", False: "off"}.get(progress, progress)  # type: ignore[arg-type]
        _validate_names(names or [], self_name)
        self.state = ClusterState.CLOSED
        self.records: list[WorkerRecord] = []
        #: where the boot's time went, in seconds from its start: "controller" (connected;
        #: 0 when kept from the last cluster), "engines" (all registered), "torch import"
        #: (the zygote's imports, 0 when it ran before), "join" (its own length), "total"
        self.boot_seconds: dict[str, float] = {}
        self._engines: _launch.LocalEngines | None = None  # None: attached, or not booted
        self._client: Any = None
        self._engine_of: dict[str, int] = {}
        self._taken: list[int] = []  # engine ids handed to this cluster by the launcher

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> Cluster:
        if self.state is not ClusterState.CLOSED or self.records:
            raise ClusterClosedError("a Cluster handle starts once; call nbrpc.init() again")
        self.state = ClusterState.BOOTING
        try:
            self._boot()
        except BaseException as exc:
            # an engine that failed to start: the others were started the same way
            self._abandon(release=isinstance(exc, BootError))
            raise
        self.state = ClusterState.READY
        _agent.set_active(True)
        _live.add(self)
        return self

    def _boot(self) -> None:
        t0 = time.monotonic()
        _route_torch_shutdown()
        placeholder = self.names or [f"worker{i}" for i in range(1, (self.n or 0) + 1)]
        progress = BootProgress(placeholder, self.progress_mode if self.n else "off")
        phases = self.boot_seconds
        kernel = _worker.describe_process()
        if self.wants_devices:  # the kernel's own side is known now: refuse before any start
            _devices.check_local(
                self.self_name,
                self.requested_maps,
                self.gpus,
                kernel["devices"],
                kernel["host"],
            )
        reused = False
        if not self.attached:  # engines start now and import torch while the kernel joins
            kept = _launch.current()
            reused = kept is not None and kept.key == (self.listen, self.python)
            self._engines = _launch.local_engines(self.listen, self.python)  # does not wait
            if reused:
                progress.phase("controller", 0.0, "kept from the last cluster")
        member = None
        if not self.wants_devices:  # join at once; device maps must wait for the workers
            member = self._join_kernel({}, None)
        if self._engines is not None:  # waits for the zygote's imports, if it is new
            self._engines.reserve(self.n or 0)
        client = self._connect()
        if self._engines is not None and not phases.get("controller"):
            phases["controller"] = (
                0.0 if reused else min(self._engines.controller_seconds or 0.0, _since(t0))
            )
            if not reused:
                progress.phase("controller", phases["controller"])
        engine_ids = self._wait_for_engines(client, progress, placeholder)
        phases["engines"] = _since(t0)
        progress.phase("engines", phases["engines"], "registered")
        names = self.names or [f"worker{i}" for i in range(1, len(engine_ids) + 1)]
        _validate_names(names, self.self_name)
        maps: dict = {}
        chosen: dict = {}
        if self.wants_devices:
            maps, chosen = self._plan_devices(client, engine_ids, names, kernel)
            member = self._join_kernel(maps.get(self.self_name, {}), chosen.get(self.self_name))
        assert member is not None
        ranks = member.allocate_ranks(len(engine_ids))
        pending = {}
        t_join = time.monotonic()
        for name, rank, eid in zip(names, ranks, engine_ids, strict=True):
            progress.update(name, 2)
            pending[name] = client[eid].apply_async(
                _worker.join,
                name,
                rank,
                member.spec.to_dict(),
                member.name,
                self.rpc_timeout,
                self.num_worker_threads,
                maps.get(name),
                chosen.get(name),
            )
            self._engine_of[name] = eid
        infos = self._wait_for_joins(pending, progress)
        if self._engines is not None:
            phases["torch import"] = 0.0 if reused else (self._engines.zygote.ready_seconds or 0)
            progress.phase(
                "torch import",
                phases["torch import"],
                "done before this cluster" if reused else "once, in the process engines fork from",
            )
        phases["join"] = _since(t_join)
        progress.phase("join", phases["join"], "init_rpc")
        self.fast_path = self._configure_fast_path(client, member.spec.loopback_only)
        self.device_maps = maps
        self.records = [
            WorkerRecord(member.name, 0, kernel["pid"], kernel["host"], "kernel", kernel["devices"])
        ]
        for name in names:
            info = infos[name]
            self.records.append(
                WorkerRecord(
                    name,
                    info["rank"],
                    info["pid"],
                    info["host"],
                    f"engine {self._engine_of[name]}",
                    info["devices"],
                    self._engine_of[name],
                )
            )
        phases["total"] = _since(t0)

    def _configure_fast_path(self, client: Any, local: bool) -> bool:
        """Shared memory for large tensors, if every worker sees this kernel's /dev/shm.

        All or none: a process that sent a segment name to one that cannot open it would
        break the call. A probe segment tells "same host and same /dev/shm" apart from
        "same hostname".
        """
        prefix = _reaper.segment_prefix(os.getpid())
        if self.shm_threshold is None or not local:
            _shm.configure(prefix, None)
            return False
        probe = os.path.join(_shm.SHM_DIR, f"{prefix}-probe")
        try:
            with open(probe, "w"):
                pass
        except OSError:
            _shm.configure(prefix, None)
            return False
        engines = client[list(self._engine_of.values())]

        def ask(threshold: int | None) -> list[bool]:  # bounded: an engine may have died
            ar = engines.apply_async(_worker.configure_fast_path, prefix, threshold, probe)
            return ar.get(timeout=JOIN_TIMEOUT_S)

        try:
            on = all(ask(self.shm_threshold))
            if not on:
                ask(None)
        finally:
            os.unlink(probe)
        _shm.configure(prefix, self.shm_threshold if on else None)
        return _shm.enabled()

    @property
    def wants_devices(self) -> bool:
        return bool(self.gpus or self.requested_maps)

    def _join_kernel(self, device_maps: dict, devices: list[str] | None) -> Any:
        return _group.kernel_membership(
            self.self_name,
            init_method=self.init_method,
            listen=self.listen,
            rpc_timeout=self.rpc_timeout,
            num_worker_threads=self.num_worker_threads,
            device_maps=device_maps,
            devices=devices,
        )

    def _plan_devices(
        self, client: Any, engine_ids: list[int], names: list[str], kernel: dict
    ) -> tuple[dict, dict]:
        """Ask each engine for its devices, then plan and check every map before any join."""
        asked = [client[eid].apply_async(_worker.describe_process) for eid in engine_ids]
        described = {self.self_name: kernel}
        for name, ar in zip(names, asked, strict=True):
            try:
                described[name] = ar.get(timeout=JOIN_TIMEOUT_S)
            except Exception as exc:
                raise BootError(f"{name} could not describe its devices: {exc}") from exc
        devices = {name: info["devices"] for name, info in described.items()}
        hosts = {name: info["host"] for name, info in described.items()}
        chosen: dict = {}
        maps: dict = {}
        if self.gpus == "auto":
            chosen, maps = _devices.plan_gpus(devices, hosts)
        for src, by_dest in self.requested_maps.items():
            for dest, mapping in by_dest.items():
                maps.setdefault(src, {})[dest] = mapping  # given by hand: wins over the plan
        _devices.validate(maps, devices, hosts)
        return maps, chosen

    def _connect(self) -> Any:
        import ipyparallel as ipp

        if self._engines is not None:
            self._client = self._engines.client()
            return self._client
        try:
            self._client = ipp.Client(profile=self.profile, cluster_id=self.cluster_id or "")
        except Exception as exc:
            raise BootError(
                f"could not attach to the ipyparallel cluster (profile={self.profile!r}, "
                f"cluster_id={self.cluster_id!r}): {exc}. Is it running? "
                "Start it with `ipcluster start -n N --profile NAME`."
            ) from exc
        return self._client

    def _wait_for_engines(self, client: Any, progress: BootProgress, names: list[str]) -> list[int]:
        def registered(count: int) -> None:
            for name in names[:count]:
                progress.update(name, 1)

        if self._engines is not None:
            assert self.n is not None
            self._taken = self._engines.take(self.n, ENGINE_START_TIMEOUT_S, registered)
            return self._taken
        want = self.n
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while True:
            ids = sorted(client.ids)
            registered(len(ids))
            if want is None and ids:
                return ids
            if want is not None and len(ids) >= want:
                return ids[:want]
            if time.monotonic() > deadline:
                raise BootError(
                    f"only {len(ids)} of {want} ipyparallel engines registered within "
                    f"{ENGINE_START_TIMEOUT_S:.0f} s. Start more engines in the attached "
                    "cluster, or ask for fewer with -n."
                )
            time.sleep(0.05)

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
                        f"{name} could not join the RPC group: {_remote_message(exc)}"
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
        """
        self.state = ClusterState.SHUTTING_DOWN
        try:
            self._leave_workers(graceful=False)
        finally:
            self._stop_engines(keep_spares=False)
            if release and self._engines is not None:
                _launch.release()
            self.state = ClusterState.CLOSED
            _agent.set_active(False)

    def dead_workers(self, ask_ipyparallel: bool = True) -> list[str]:
        """Workers whose process is gone, from what ipyparallel and the OS know.

        An engine that ipyparallel no longer lists (its heartbeat stopped, or its nanny
        reported the exit) is dead; so is a worker on this host whose pid is gone.
        ``ask_ipyparallel=False`` checks pids only: the ipyparallel client is not
        thread-safe, and the live views call this from their own thread.
        """
        client = self._client if ask_ipyparallel else None
        engines = set(client.ids) if client is not None else None
        if self._client is None:
            return [r.name for r in self.records[1:] if r.state == "dead"]
        here = socket.gethostname()
        for record in self.records[1:]:
            if record.state != "ready":
                continue
            gone = engines is not None and record.engine_id not in engines
            if not gone and record.host == here:
                gone = not process_alive(record.pid)
            if gone:
                record.state = "dead"
        return [r.name for r in self.records[1:] if r.state == "dead"]

    def _leave_workers(self, graceful: bool, timeout: float = LEAVE_TIMEOUT_S) -> None:
        if self._client is None or not self._engine_of:
            return
        dead = set(self.dead_workers())
        pending = []
        for name, eid in self._engine_of.items():
            if name in dead:
                continue
            try:
                pending.append(self._client[eid].apply_async(_worker.leave))
            except Exception as exc:
                log.warning("could not ask engine %s to leave: %s", eid, exc)
        deadline = time.monotonic() + timeout
        for ar in pending:
            try:
                ar.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                if graceful:
                    log.warning("a worker did not leave the RPC group cleanly: %s", exc)

    def _stop_engines(self, keep_spares: bool = True) -> None:
        """Stop the engines this cluster used (never reusable: torch joins once per
        process) and warm as many spares for the next ``init``; attached engines run on."""
        if self._engines is not None:
            self._engines.retire([r.pid for r in self.records[1:]], self._taken)
            if keep_spares and self._taken:
                self._engines.warm(len(self._taken))
            self._taken = []
        elif self._client is not None:
            try:
                self._client.close()
            except Exception as exc:
                log.warning("closing the ipyparallel client: %s", exc)
        self._client = None

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
        if self.state is ClusterState.CLOSED:
            if release:
                _launch.release()
            return
        self.state = ClusterState.SHUTTING_DOWN
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
                self._leave_workers(graceful, timeout)
            if dead:
                _group.release_stale_token()
        finally:
            self._stop_engines(keep_spares=not release)
            if release:
                _launch.release()
            _reaper.sweep_segments(_reaper.segment_prefix(os.getpid()))
            for record in self.records[1:]:
                if record.state == "ready":
                    record.state = "stopped"
            self.state = ClusterState.CLOSED
            if _current and _current[0] is self:
                _current.clear()
            _agent.set_active(False)

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
        return self

    def __exit__(self, *exc: object) -> None:
        shutdown()

    # -- views -----------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerRecord]:
        return list(self.records)

    def status(
        self, timeout: float = _agent.SNAPSHOT_TIMEOUT_S, ask_ipyparallel: bool = True
    ) -> list[dict[str, Any]]:
        """Live figures per process: the record (state, pid, host, devices, role) plus
        ``calls_in_flight``, ``calls_done`` (Python calls it served), ``rrefs_owned`` and
        ``rrefs_held`` (Python RRef handles it holds).

        Figures are ``None`` for a process that is not ready or did not answer in time.
        """
        snaps: dict[str, dict] = {}
        if self.state is ClusterState.READY:
            dead = set(self.dead_workers(ask_ipyparallel))
            snaps = _agent.snapshots(timeout, skip=dead)
        rows = []
        for record in self.records:
            row = record.as_dict()
            snap = snaps.get(record.name) if record.state == "ready" else None
            row["calls_in_flight"] = snap["calls_in_flight"] if snap else None
            row["calls_done"] = snap["calls_done"] if snap else None
            row["rrefs_owned"] = snap["owned"] if snap else None
            row["rrefs_held"] = len(snap["handles"]) if snap else None
            row["device_maps"] = self.device_maps.get(record.name, {})
            rows.append(row)
        return rows

    def summary(self) -> str:
        if self.state is ClusterState.READY:
            self.dead_workers()
        lines = [
            f"nbrpc: {len(self.records)} processes in the RPC group, {self.state.value}"
            + (f" (booted in {self.boot_seconds['total']:.1f} s)" if self.boot_seconds else "")
        ]
        lines.append(f"  {'name':<12}{'rank':>5}  {'pid':>8}  {'host':<20}{'role':<10}state")
        for r in self.records:
            lines.append(
                f"  {r.name:<12}{r.rank:>5}  {r.pid:>8}  {r.host:<20}{r.role:<10}{r.state}"
            )
        if self.state is ClusterState.READY or self.fast_path:
            lines.append(
                f"  CPU tensors of {(self.shm_threshold or 0) / 2**20:g} MB and more travel "
                "through shared memory"
                if self.fast_path
                else "  CPU tensors travel through TensorPipe only"
            )
        if self.device_maps:
            lines.append("  device maps (and where replies go):")
            lines.extend(f"    {line}" for line in _devices.describe(self.device_maps))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><code>{r.name}</code></td><td>{r.rank}</td><td>{r.pid}</td>"
            f"<td>{r.host}</td><td>{r.role}</td><td>{r.state}</td></tr>"
            for r in self.records
        )
        return (
            f"<b>nbrpc</b>: {len(self.records)} processes, {self.state.value}"
            "<table><tr><th>name</th><th>rank</th><th>pid</th><th>host</th><th>role</th>"
            f"<th>state</th></tr>{rows}</table>"
        )


def _since(t0: float) -> float:
    return time.monotonic() - t0


def _remote_message(exc: BaseException) -> str:
    ename = getattr(exc, "ename", None)
    return f"{ename}: {getattr(exc, 'evalue', '')}" if ename else f"{type(exc).__name__}: {exc}"


def init(
    n: int | None = 2,
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
) -> Cluster:
    """Start ``n`` workers (or attach to a running ipyparallel cluster) and join them.

    The calling process joins as ``self_name`` (rank 0); workers are named ``worker1`` ...
    ``workerN`` unless ``names`` is given. ``profile`` / ``cluster_id`` attach to an
    ipyparallel cluster that already runs (engines on other hosts included) instead of
    starting engines here; ``n`` then picks how many of its engines join (default: all).

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
    """
    if (profile is not None or cluster_id is not None) and n == 2 and names is None:
        n = None  # attach: all engines unless asked otherwise
    cluster = Cluster(
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
    )
    if _current:
        running = ", ".join(r.name for r in _current[0].records)
        raise AlreadyInitializedError(
            f"an nbrpc cluster is already running ({running}). Run %rpc_shutdown "
            "(or nbrpc.shutdown()) first, then start a new one."
        )
    _current.append(cluster)
    try:
        cluster.start()
    except BaseException:
        _current.clear()
        raise
    return cluster


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


def status(timeout: float = _agent.SNAPSHOT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Live figures for each process of the current cluster (see :meth:`Cluster.status`)."""
    return current().status(timeout)


@atexit.register
def _at_exit() -> None:
    for cluster in list(_live):
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
