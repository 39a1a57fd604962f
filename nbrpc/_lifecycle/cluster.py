"""The lifecycle of a cluster: boot, run, shut down; one cluster current at a time.

A cluster is the kernel plus worker processes that joined its torch RPC group. Its pieces
live in their own modules: what was asked for in :mod:`nbrpc._options` (frozen, checked
before anything starts), where engines come from in :mod:`nbrpc._engines` (the control
plane: start, run bootstrap code, stop), the boot's steps in :mod:`nbrpc._lifecycle.boot`, the RPC
group in :mod:`nbrpc._group` (the data plane). This module holds the state machine
(:class:`ClusterState`: the one record of whether a cluster is up) and the current one.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Unpack

from nbrpc import _devices, _engines, _group, _process, _setup, _states, _torch, _views
from nbrpc._calls import cancel, facade as calls
from nbrpc._debugger import prompts
from nbrpc._departures import forget_names
from nbrpc._engines.watchdog import process_alive, segment_prefix, sweep_segments
from nbrpc._errors import (
    AlreadyInitializedError,
    BootError,
    ClusterClosedError,
    counted,
)
from nbrpc._gather import census, stacks as gathered_stacks
from nbrpc._options import Options, Settings
from nbrpc._rows import StackRow, StatusRow, WorkerRecord, WorkerState
from nbrpc._wire import lanes, native_output, shm

from . import aside, boot, collective, leave, restart as restarts, scale as scales
from .booted import Booted

log = logging.getLogger("nbrpc")

LEAVE_TIMEOUT_S = 30.0


class ClusterState(enum.Enum):
    """A :class:`Cluster`'s life (``cluster.state``), one way: NOT_STARTED, BOOTING, READY,
    SHUTTING_DOWN, CLOSED; a failed boot stops what started (BOOTING to SHUTTING_DOWN)."""

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
class _Current:
    """The current cluster, from BOOTING until CLOSED."""

    cluster: Cluster | None = None


_current = _Current()

# What reacts to a change of a worker's state (nbrpc._states owns it), registered once.
_states.listen(calls.on_worker_change)
_states.listen(native_output.on_worker_change)
_states.listen(prompts.on_worker_change)


class Cluster:
    """A group: the kernel plus its workers. :func:`nbrpc.init` makes and starts one;
    ``nbrpc.Cluster(n=2).start()`` does the same, also as ``with ... as cluster:``.
    ``nbrpc.Cluster(n, **options)`` takes :func:`nbrpc.init`'s ``n`` and ``options`` (or
    ``settings``, already checked); nothing starts before :meth:`start`, but bad options
    raise :class:`~nbrpc.ConfigError` here. Read-only: ``n``, ``names``, ``self_name``,
    ``attached``, ``shm_threshold``; ``records`` and ``workers`` (a
    :class:`~nbrpc.WorkerRecord` each), ``boot_seconds``, ``device_maps``, ``fast_path``,
    ``shm_peers``, ``process_group``; ``state``, a :class:`ClusterState`. It is *current*
    (``nbrpc.current()``) from its boot until closed: a second one meanwhile is refused, a
    new one after ``shutdown`` works, and interpreter exit shuts a running one down."""

    def __init__(
        self,
        n: int | None = None,
        /,
        *,
        settings: Settings | None = None,
        **options: Unpack[Options],
    ) -> None:
        self.settings = settings or _engines.resolve(Settings.make(n, **options))
        self.state = ClusterState.NOT_STARTED
        self.booted = Booted()
        self.engines = _engines.Engines(self.settings)
        #: the workers reached past their RPC threads (a cancel, %rpc_status's figures)
        self.aside = aside.Aside(self.engines, self.booted, self.settings.self_name)

    # settings the notebook and tests read from the cluster itself
    n = property(lambda self: self.settings.n)
    names = property(lambda self: self.settings.names)
    self_name = property(lambda self: self.settings.self_name)
    attached = property(lambda self: self.settings.attached)
    shm_threshold = property(lambda self: self.settings.shm_threshold)
    # what the boot found and made
    records = property(lambda self: self.booted.roster.records)
    boot_seconds = property(lambda self: self.booted.seconds)
    device_maps = property(lambda self: self.booted.device_maps)
    fast_path = property(lambda self: self.booted.fast_path)
    shm_peers = property(lambda self: self.booted.shm_peers)
    process_group = property(lambda self: self.booted.process_group)

    # -- lifecycle -------------------------------------------------------------------

    def _enter(self, state: ClusterState) -> None:
        """The one place the state changes; what depends on it follows here."""
        if state not in _NEXT[self.state]:
            raise ClusterClosedError(
                f"a cluster that is {self.state.value} cannot become {state.value}"
            )
        self.state = state
        calls.set_active(state is ClusterState.READY, last_output=self.last_output)
        if state is ClusterState.READY:  # the stop button reaches the workers' calls
            cancel.set_cluster(self.aside.cancel, self.stacks)
            self.aside.keep_doors_open()
            _states.listen(self.aside.on_worker_change)  # the doors follow the workers
        else:
            _states.unlisten(self.aside.on_worker_change)
            cancel.set_cluster(None)
            if state is ClusterState.CLOSED:
                self.aside.keep_doors_open(close=True)
        if state in (ClusterState.SHUTTING_DOWN, ClusterState.CLOSED):
            prompts.reset()  # a prompt waiting for the kernel must not hold shutdown up
        if state is ClusterState.CLOSED and _current.cluster is self:
            _current.cluster = None

    def start(self) -> Cluster:
        """Boot: start (or attach to) the engines and join them; this becomes current."""
        if self.state is not ClusterState.NOT_STARTED:
            raise ClusterClosedError(
                f"this cluster is {self.state.value}: a Cluster starts once. Start a new one "
                "with nbrpc.init() (or %rpc_init)."
            )
        if _current.cluster is not None:
            running = ", ".join(r.name for r in _current.cluster.records) or "booting"
            raise AlreadyInitializedError(
                f"an nbrpc cluster is already running ({running}). Run %rpc_shutdown "
                "(or nbrpc.shutdown()) first, then start a new one."
            )
        _group.check_kernel_name(self.settings.self_name)  # before anything is drawn
        _process.warn_if_the_host_is_shared()
        try:
            # current and booting, or neither: a stop between the two (0.16 s into an
            # init, in the soak) left a current cluster "not started" for good, and every
            # later %rpc_init said one was already running
            with _process.interrupts_deferred():
                _current.cluster = self
                self._enter(ClusterState.BOOTING)
            _setup.kernel(_torch_shutdown)  # every step the kernel installs, in order
            boot.boot(self.settings, self.engines, self.booted)
            _states.adopt(self.booted.roster)  # their states are owned there from now on
            if self.settings.restart == "dead":
                restarts.watch_for_dead(_restart_dead_of_current)
        except BaseException as exc:
            if self.state is ClusterState.NOT_STARTED:  # stopped before it became current
                raise
            # an engine that failed to start: the others were started the same way
            self._abandon(release=isinstance(exc, BootError))
            if isinstance(exc, KeyboardInterrupt):
                print(
                    "nbrpc: the stop button during %rpc_init: what it had started was "
                    "stopped, and no cluster runs; %rpc_init starts one anew.",
                    file=sys.stderr,
                )
            raise
        self._enter(ClusterState.READY)
        return self

    def _abandon(self, release: bool) -> None:
        """After a failed boot: stop what was started, leave the kernel usable.

        ``release``: stop the controller and spare engines too (start afresh next time).
        They are also released when the boot failed after it took engines (a bad process
        group member, a device map the workers' devices refuse): the launcher knows those
        engines by id only, and a later boot would take their exit for a failed start.
        """
        release = release or bool(self.engines.taken)
        self._enter(ClusterState.SHUTTING_DOWN)
        names = list(self.booted.roster.engines())  # every worker asked to join, joined or not
        _states.leaving(names)
        self.booted.let_joins_end()  # before the group forgets them (see there)
        try:
            # stopped, not asked to leave: torch's leave waits for the group's join token,
            # which a worker whose join failed half way may hold (30 s, then an error)
            self.engines.stop(
                [r.pid for r in self.booted.roster.workers() if r.local], keep_spares=False
            )
        finally:
            try:
                if names and _torch.agent_is_set():
                    forget_names(names)
            except Exception as exc:
                log.warning("removing %s from the group: %s", ", ".join(names), exc)
            if release:
                _engines.release_kept()
            self._enter(ClusterState.CLOSED)

    def dead_workers(self, ask_ipyparallel: bool = True) -> list[str]:
        """Workers whose process is gone, from what ipyparallel and the OS know.

        An engine that ipyparallel no longer lists (its heartbeat stopped, or its nanny
        reported the exit) is dead; so is a worker on this host whose pid is gone, and one
        whose calls already failed because its process is gone (the call facade told
        :mod:`nbrpc._states`, which made it dead then).
        ``ask_ipyparallel=False`` checks pids only: the ipyparallel client is not
        thread-safe, and the live views call this from their own thread.
        """
        if self.engines.client is None:
            return self._dead()
        engines = self.engines.alive() if ask_ipyparallel else None
        for record in self.booted.roster.workers():
            if record.state is not WorkerState.READY:
                continue
            gone = engines is not None and record.engine_id not in engines
            if not gone and record.local:
                gone = not process_alive(record.pid)
            if gone:
                _states.mark_dead(record.name)
        return self._dead()

    def _dead(self) -> list[str]:
        return [r.name for r in self.booted.roster.workers() if r.state is WorkerState.DEAD]

    def restart(self, *names: str) -> restarts.Restarted:
        """Replace workers ``names``, dead or alive, with fresh processes under the same
        names; the kernel and the other workers keep everything (see
        :mod:`nbrpc._lifecycle.restart`)."""
        if self.state is not ClusterState.READY:
            raise ClusterClosedError(
                f"this cluster is {self.state.value}: restart works on a running cluster. "
                "Start one with %rpc_init."
            )
        with _states.changing(f"a restart of {', '.join(names)}"):
            return restarts.run(self, list(names))

    def scale(self, n: int | None = None, **how: Unpack[scales.How]) -> scales.Scaled:
        """Grow or shrink the running cluster to ``n`` workers (see :func:`scale`)."""
        if self.state is not ClusterState.READY:
            raise ClusterClosedError(
                f"this cluster is {self.state.value}: scale works on a running cluster. "
                "Start one with %rpc_init."
            )
        what = f"a scale to {counted(n, 'worker')}" if n is not None else "a scale"
        with _states.changing(what):
            return scales.run(self, n, **how)

    def restart_dead(self) -> None:
        """``restart='dead'``: replace the workers that died, saying which and why (before
        each cell)."""
        if self.state is not ClusterState.READY or self.settings.restart != "dead":
            return
        dead = self.dead_workers()
        if not dead:
            return
        for name in dead:
            why = self.last_output(name).strip() or "no last words: killed, or out of memory"
            print(f"nbrpc: {name} died ({why.splitlines()[0].strip()}); restarting it")
        try:
            print(self.restart(*dead).summary())
        except Exception as exc:  # the cell runs anyway; the next one tries again
            print(f"nbrpc: could not restart {', '.join(dead)}: {exc}")

    def last_output(self, name: str) -> str:
        """What worker ``name``'s process printed last outside calls (its engine log): the
        reason a crash leaves, such as a C++ abort's message, or Slurm's state of a job that
        ended. "" for a worker on another host over ssh, or one that printed nothing
        (``kill -9`` and the OOM killer leave no trace)."""
        record = self.booted.roster.find(name)
        if record is None:
            return ""
        return self.engines.source.last_output(record.pid)

    def shutdown(
        self, graceful: bool = True, timeout: float = LEAVE_TIMEOUT_S, release: bool = False
    ) -> None:
        """Workers leave the group; engines this cluster started are stopped.

        ``release``: also stop the controller and the warm spare engines that make the
        next ``init`` fast (see :mod:`nbrpc._engines.local`); interpreter exit does it anyway.

        ``graceful``: workers finish their calls in flight (bounded by ``timeout``) and
        leave. Otherwise the kernel drops them from the group at once and the engines are
        stopped; calls still in flight fail with :class:`WorkerDiedError`.
        Engines of an attached ipyparallel cluster keep running. The kernel stays in the
        group, alone, so that a later ``init`` can bring new workers (see ``_group``).
        """
        if self.state is not ClusterState.READY:  # never started, or already closed
            if release:
                _engines.release_kept()
            return
        # the stop button here, or in the closing steps below, left the cluster shutting
        # down for good: the next %rpc_init said one runs, and %rpc_shutdown did nothing
        # (found by the soak). The press is held through them, and delivered after.
        with _process.interrupts_deferred():
            self._enter(ClusterState.SHUTTING_DOWN)
            leaving = self.booted.roster.ready()
            _states.leaving(r.name for r in self.booted.roster.workers())
        with native_output.quiet_stderr_while_leaving(leaving):  # a script's, as a kernel's
            try:
                try:
                    leave.leave(self, graceful, timeout)
                except KeyboardInterrupt:  # the stop button: no more waiting, but no half-leave
                    leave.stopped_while_leaving(self)
                    raise
            finally:
                with _process.interrupts_deferred():
                    self._close(release)

    def _close(self, release: bool) -> None:
        """A shutdown's last steps, after the leave: lanes closed, engines stopped (and
        the controller released, if asked), shared memory swept, closed."""
        try:
            lanes.close()
            local = [r.pid for r in self.booted.roster.workers() if r.local]
            self.engines.stop(local, keep_spares=not release)
            if release:
                _engines.release_kept()
            sweep_segments(segment_prefix(os.getpid()))
            shm.forget_swept()  # (mappings of the swept files, each holding a descriptor)
            _states.stopped(self.booted.roster.ready())
        finally:  # whatever failed above, no cluster is current any more
            self._enter(ClusterState.CLOSED)

    def __enter__(self) -> Cluster:
        if self.state is ClusterState.NOT_STARTED:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- views -----------------------------------------------------------------------

    def stacks(self, *names: str, timeout: float = gathered_stacks.TIMEOUT_S) -> list[StackRow]:
        """Every thread's Python stack in each process (or in ``names``), read from
        outside each worker, ``timeout`` seconds at most (``nbrpc.stacks()``)."""
        return gathered_stacks.of_processes(
            self.records, self.engines.source, *names, timeout=timeout
        )

    @property
    def workers(self) -> list[WorkerRecord]:
        return list(self.records)

    def status(
        self, timeout: float = census.SNAPSHOT_TIMEOUT_S, ask_ipyparallel: bool = True
    ) -> list[StatusRow]:
        """Live figures per process: the record (state, pid, host, devices, role) plus
        ``calls_in_flight``, ``calls_done`` (Python calls it served), ``rrefs_owned`` and
        ``rrefs_held`` (Python RRef handles it holds), ``cpu_percent`` (of one core, of
        late: since the previous status, or over a fresh 0.2 s), ``memory_rss`` (bytes) and
        ``cuda`` (per device it uses: allocated and reserved bytes, utilisation).

        Figures are ``None`` for a process that is not ready or did not answer in time.
        """
        snaps: dict[str, dict] = {}
        if self.state is ClusterState.READY:
            dead = set(self.dead_workers(ask_ipyparallel))
            snaps = census.snapshots(timeout, skip=dead, aside=self.aside.figures)
        return census.status_rows(self.records, snaps, self.device_maps)

    def _rows(self) -> list[dict[str, Any]]:
        if self.state is ClusterState.READY:
            self.dead_workers()
        return [  # rank and torch_id as nbrpc.status()'s rows have them
            {
                **r.as_dict(),
                "rank": r.order,
                "torch_id": r.rank,
                "device_maps": self.device_maps.get(r.name, {}),
            }
            for r in self.records
        ]

    def summary(self) -> str:
        """The processes, their ranks, pids, hosts and states, as text."""
        tensors = None
        if self.shm_peers or self.state is ClusterState.READY or self.fast_path:
            tensors = shm.describe(self.settings.shm_threshold, self.fast_path, self.shm_peers)
            if self.booted.lanes:
                tensors += "; small calls take Unix-socket lanes between local processes"
        return _views.summary_text(
            self._rows(),
            self.state.value,
            self.boot_seconds.get("total"),
            tensors,
            collective.describe(self.process_group),
            _devices.describe(self.device_maps),
            self.engines.summary_note(),
        )

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return _views.cluster_html(self._rows(), self.state.value)


def running() -> Cluster | None:
    """The current cluster, or None (no error: for callers that only look)."""
    return _current.cluster


@atexit.register
def _at_exit() -> None:
    cluster = _current.cluster
    if cluster is not None:
        try:
            cluster.shutdown(graceful=False, timeout=5)
        except Exception as exc:
            log.warning("at exit: %s", exc)
    _engines.release_kept()
    member = _group.current_kernel_membership()
    if member is not None:
        member.close()


def _restart_dead_of_current() -> None:
    """Before each cell (``restart='dead'``): the current cluster replaces its dead workers."""
    if _current.cluster is not None:
        _current.cluster.restart_dead()


def _torch_shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stands in for ``torch.distributed.rpc.shutdown`` in the kernel while nbrpc runs.

    Published tutorials end with ``rpc.shutdown()``. In a notebook that must stop the
    workers but keep the kernel's agent, or the next ``%rpc_init`` could not work.
    """
    if _current.cluster is not None:
        _current.cluster.shutdown(graceful=graceful, timeout=timeout or LEAVE_TIMEOUT_S)
