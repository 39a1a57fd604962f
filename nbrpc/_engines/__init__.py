"""Where a cluster's engines come from: one family of sources on one base.

ipyparallel is nbrpc's control plane: it launches, watches and stops the engines that
become workers, and runs their bootstrap code. Where those engines come from varies; each
way is an *engine source*, one module of this folder:

* :mod:`.local` -- forked on this host from a zygote that imported torch once, with a
  controller and warm spares kept between clusters (the default);
* :mod:`.ssh` -- started on other hosts over ssh (``--hosts``), one per entry;
* :mod:`.slurm` -- the tasks of one Slurm job, or a step of the kernel's (``--slurm``);
* :mod:`.attached` -- an ipyparallel cluster someone else started (``--profile``).

Beside them: :mod:`.controller` (the controller tier: the ipyparallel controller and
watchdog of this host that the local, ssh and Slurm sources start, with its hooks
``spawn`` / ``take`` / ``retire`` / ``release``, and ``ControllerSource``, which makes a
source of them), :mod:`.zygote` (the process local engines fork from) and :mod:`.forked`
(the kernel's side of it: the zygote started, engines forked through ipyparallel's
launcher), :mod:`.watchdog` (stops them all if the kernel dies), :mod:`.hosts` (ssh
options and the preflight of ``--hosts``), :mod:`.ssh_launcher` (an engine started on
another host in one ssh session), :mod:`.slurm_commands` (what the Slurm source asks
Slurm: ``sbatch --test-only``, ``squeue``, ``scontrol``, ``scancel``) and :mod:`.worker`
(what runs inside an engine to join).

Every source extends :class:`~.base.EngineSource` (in :mod:`.base`), which gives a
default to everything a source need not do; a test holds every source to its signatures.
:class:`Engines` holds what a cluster adds to its source (the engine ids it took, the
ipyparallel client, bootstrap code run on them, their leave and stop) and never asks which
source it has; what the source knows is asked of the source itself (``engines.source``).

**Adding a source** (say, a batch scheduler's):

1. a module here with a subclass of :class:`~.base.EngineSource` that writes what it does:
   ``wants(settings)`` says which options ask for it, ``start`` / ``launch`` / ``client``
   / ``take`` bring engines up in worker order, ``stop`` ends what it started; the rest
   (``resolve``, ``replace``, ``grow`` / ``shrink`` for ``%rpc_scale``, ``dump_stacks``,
   ...) where it can do better than the default (which refuses, saying why). A source
   with a controller of this host extends :class:`~.controller.ControllerSource`
   instead and writes its controller's four hooks rather than ``launch`` / ``take`` /
   ``stop``;
2. its options in :class:`nbrpc._options.Options`; options of its own are one class
   extending :class:`~nbrpc._placement.SourceOptions`, registered once, whose fields its
   flags give (``part_of="slurm.nodes"``): no field of :class:`~nbrpc._options.Settings`,
   which holds the value as ``source_options`` (``settings.options_of(Slurm)``);
3. one line in :data:`SOURCES`, before the sources it must win over.

The ipyparallel client is not thread-safe: only the thread that runs the lifecycle (the
kernel's main thread) calls these methods.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psutil

from nbrpc import _fence, _options

from .attached import AttachedSource
from .base import EngineSource
from .local import LocalSource
from .slurm import SlurmSource
from .ssh import SshSource
from .watchdog import process_alive
from .worker import leave

log = logging.getLogger("nbrpc")

ENGINE_START_TIMEOUT_S = 90.0
JOIN_TIMEOUT_S = 90.0


#: The registered sources, asked in order which one the settings want (the last one
#: wants everything).
SOURCES: tuple[type[EngineSource], ...] = (AttachedSource, SshSource, SlurmSource, LocalSource)


def source_for(settings: _options.Settings) -> type[EngineSource]:
    return next(source for source in SOURCES if source.wants(settings))


def resolve(settings: _options.Settings) -> _options.Settings:
    """``settings`` completed by the source they ask for, and the workers they ask for
    checked against the room the source has for them (before anything starts)."""
    source = source_for(settings)
    if settings.n is not None:
        source.check_room(settings.n)
    return source.resolve(settings)


def release_kept() -> None:
    """Stop what any source keeps between clusters (controllers, spare engines)."""
    for source in SOURCES:
        source.release_kept()


def remote_message(exc: BaseException) -> str:
    """An engine's exception, as ipyparallel reports it, in one line."""
    ename = getattr(exc, "ename", None)
    return f"{ename}: {getattr(exc, 'evalue', '')}" if ename else f"{type(exc).__name__}: {exc}"


class Engines:
    """The engines one cluster took from its source, and the ipyparallel client it reaches
    them through: what the source does not know (which ids are this cluster's, bootstrap
    code run on them, their leave and stop). What the source knows (``remote``,
    ``reused``, ``start``, ``launch``, ``hosts``, ...) is asked of :attr:`source`."""

    def __init__(self, settings: _options.Settings) -> None:
        self.settings = settings
        self.source: EngineSource = source_for(settings)(settings)
        self.client: Any = None
        # engine ids the source handed this cluster, for their stop: those of a boot that
        # failed before any join was asked too. Which worker runs on which engine is the
        # roster's (nbrpc._states.Roster.engines), not this list's.
        self.taken: list[int] = []

    def connect(self) -> Any:
        self.client = self.source.client()
        return self.client

    def take(self, n: int | None, registered: Callable[..., None]) -> list[int]:
        """Ids of ``n`` registered engines, in worker order, now this cluster's."""
        self.taken = self.source.take(n, ENGINE_START_TIMEOUT_S, registered)
        return self.taken

    def fence_controller(self) -> None:
        """Filter the sockets of the controller this cluster started, and of the processes
        it forked (its heart monitor), with this process's member list (nbrpc._fence)."""
        pid = self.source.controller_pid()
        if pid is None or not process_alive(pid):
            return
        pids = [pid]
        with contextlib.suppress(psutil.Error):
            pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        for each in pids:
            with contextlib.suppress(OSError):  # one that exited meanwhile
                _fence.fence_process(each)

    def summary_note(self) -> str:
        """The source's line about where the engines came from, once they connected."""
        return self.source.summary_note() if self.client is not None else ""

    # -- run bootstrap code ------------------------------------------------------------

    def apply(self, engine_id: int, func: Callable[..., Any], *args: Any) -> Any:
        """Start ``func(*args)`` on one engine; returns ipyparallel's AsyncResult."""
        return self.client[engine_id].apply_async(func, *args)

    def alive(self) -> set[int] | None:
        """Engine ids ipyparallel still lists (``None``: no client to ask).

        None of them when the kernel's own controller is gone: its engines stop by
        themselves (``ENGINE_ORPHAN_MISSES``) and nothing can reach them through it, so
        shutdown must not wait on them.
        """
        if self.client is None:
            return None
        controller = self.source.controller_pid()
        if controller is not None and not process_alive(controller):
            return set()
        return set(self.client.ids)

    # -- stop --------------------------------------------------------------------------

    def leave(self, engine_ids: list[int], graceful: bool, timeout: float) -> dict[str, str]:
        """Ask the workers on ``engine_ids`` to leave the RPC group (bounded by timeout);
        the engines whose leave failed, with why in one line (graceful only)."""
        failed: dict[str, str] = {}
        if self.client is None:
            return failed
        pending = {}
        for eid in engine_ids:
            try:
                pending[eid] = self.apply(eid, leave)
            except Exception as exc:
                failed[f"engine {eid}"] = remote_message(exc)
        deadline = time.monotonic() + timeout
        for eid, ar in pending.items():
            try:
                ar.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                failed[f"engine {eid}"] = remote_message(exc).splitlines()[0][:200]
        return failed if graceful else {}

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        """New engines in place of ``engine_ids`` (see ``base.EngineSource``); they become this
        cluster's."""
        new = self.source.replace(engine_ids, pids, timeout)
        self.taken = [i for i in self.taken if i not in engine_ids] + new
        return new

    def grow(self, n: int, hosts: tuple[str, ...], registered: Callable[..., None]) -> list[int]:
        """``n`` more engines from the source (a scale); they become this cluster's."""
        new = self.source.grow(n, hosts, ENGINE_START_TIMEOUT_S, registered)
        self.taken = self.taken + new
        return new

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop engines whose workers left at a scale; they are no longer this cluster's."""
        self.taken = [i for i in self.taken if i not in engine_ids]
        self.source.shrink(engine_ids, pids)

    def stop(self, pids: list[int], keep_spares: bool) -> None:
        """Stop the engines this cluster used (never reusable: torch joins once per
        process); the source may warm spares for the next cluster."""
        try:
            self.source.stop(self.taken, pids, keep_spares)
        finally:
            self.taken = []
            self.client = None
