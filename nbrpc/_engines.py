"""The ipyparallel side of a cluster: which engines it has, and what it asks of them.

ipyparallel is nbrpc's control plane. A cluster's engines are either *local*, started by
:mod:`nbrpc._launch` (forked from a zygote that imported torch, watched by the watchdog,
kept warm between clusters), or *attached*: engines of an ipyparallel cluster someone
started, which nbrpc uses and leaves running. :class:`Engines` hides that difference from
the lifecycle in :mod:`nbrpc._cluster`: start, connect, wait for engines, run bootstrap
functions on them, ask who is alive, stop. It never touches torch's RPC.

The ipyparallel client is not thread-safe: only the thread that runs the lifecycle (the
kernel's main thread) calls these methods.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import _launch, _worker
from ._errors import BootError
from ._host_engines import HostEngines
from ._reaper import process_alive
from ._settings import Settings

__all__ = ["ENGINE_START_TIMEOUT_S", "JOIN_TIMEOUT_S", "Engines", "remote_message"]

log = logging.getLogger("nbrpc")

ENGINE_START_TIMEOUT_S = 90.0
JOIN_TIMEOUT_S = 90.0


def remote_message(exc: BaseException) -> str:
    """An engine's exception, as ipyparallel reports it, in one line."""
    ename = getattr(exc, "ename", None)
    return f"{ename}: {getattr(exc, 'evalue', '')}" if ename else f"{type(exc).__name__}: {exc}"


class Engines:
    """The engines of one cluster, local or attached."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.local: _launch.LocalEngines | None = None  # None: attached, or not started
        self.hosts: HostEngines | None = None  # engines on other hosts (--hosts)
        self.reused = False  # the controller and a warm zygote were kept from a last cluster
        self.client: Any = None
        self.taken: list[int] = []  # engine ids handed to this cluster by the launcher

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Start local engines (returns at once: they import torch while the kernel joins)."""
        if self.settings.attached:
            return
        plan = self.settings.host_plan
        if plan is not None:
            assert self.settings.listen, "Settings.make works out --listen for --hosts"
            self.hosts = HostEngines(self.settings.listen, plan, self.settings.python)
            return
        kept = _launch.current()
        key = (self.settings.listen, self.settings.python)
        self.reused = kept is not None and kept.key == key
        self.local = _launch.local_engines(self.settings.listen, self.settings.python)

    def reserve(self, n: int) -> None:
        """Ask for ``n`` engines (waits for the zygote's imports, if it is new)."""
        if self.local is not None:
            self.local.reserve(n)
        elif self.hosts is not None:
            self.hosts.spawn()

    def last_output(self, pid: int) -> str:
        """What a local engine printed last, outside calls (see ``_launch.last_words``)."""
        return self.local.last_output(pid) if self.local is not None else ""

    @property
    def remote(self) -> bool:
        """The engines run on other hosts (their pids are not this host's)."""
        return self.hosts is not None

    @property
    def controller_seconds(self) -> float | None:
        if self.hosts is not None:
            return self.hosts.controller_seconds
        return self.local.controller_seconds if self.local is not None else None

    @property
    def torch_import_seconds(self) -> float | None:
        return self.local.zygote.ready_seconds if self.local is not None else None

    def connect(self) -> Any:
        import ipyparallel as ipp

        if self.local is not None or self.hosts is not None:
            self.client = (self.local or self.hosts).client()  # type: ignore[union-attr]
            return self.client
        profile, cluster_id = self.settings.profile, self.settings.cluster_id
        try:
            self.client = ipp.Client(profile=profile, cluster_id=cluster_id or "")
        except Exception as exc:
            raise BootError(
                f"could not attach to the ipyparallel cluster (profile={profile!r}, "
                f"cluster_id={cluster_id!r}): {exc}. Is it running? "
                "Start it with `ipcluster start -n N --profile NAME`."
            ) from exc
        return self.client

    def wait(self, n: int | None, registered: Callable[[int], None]) -> list[int]:
        """Ids of ``n`` registered engines (``None``: all of an attached cluster's)."""
        if self.local is not None:
            assert n is not None
            self.taken = self.local.take(n, ENGINE_START_TIMEOUT_S, registered)
            return self.taken
        if self.hosts is not None:
            self.taken = self.hosts.take(ENGINE_START_TIMEOUT_S, registered)
            return self.taken
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while True:
            ids = sorted(self.client.ids)
            registered(len(ids))
            if n is None and ids:
                return ids
            if n is not None and len(ids) >= n:
                return ids[:n]
            if time.monotonic() > deadline:
                raise BootError(
                    f"only {len(ids)} of {n} ipyparallel engines registered within "
                    f"{ENGINE_START_TIMEOUT_S:.0f} s. Start more engines in the attached "
                    "cluster, or ask for fewer with -n."
                )
            time.sleep(0.05)

    # -- run bootstrap code ------------------------------------------------------------

    def apply(self, engine_id: int, func: Callable[..., Any], *args: Any) -> Any:
        """Start ``func(*args)`` on one engine; returns ipyparallel's AsyncResult."""
        return self.client[engine_id].apply_async(func, *args)

    def run_on(self, engine_ids: list[int], func: Callable[..., Any], *args: Any) -> list:
        """``func(*args)`` on every engine in ``engine_ids``; their results (bounded)."""
        return self.client[engine_ids].apply_async(func, *args).get(timeout=JOIN_TIMEOUT_S)

    def alive(self) -> set[int] | None:
        """Engine ids ipyparallel still lists (``None``: no client to ask).

        None of them when the kernel's own controller is gone: its engines stop by
        themselves (``ENGINE_ORPHAN_MISSES``) and nothing can reach them through it, so
        shutdown must not wait on them.
        """
        if self.client is None:
            return None
        ours = self.local or self.hosts
        controller = ours.controller_pid if ours is not None else None
        if controller is not None and not process_alive(controller):
            return set()
        return set(self.client.ids)

    # -- stop --------------------------------------------------------------------------

    def leave(self, engine_ids: list[int], graceful: bool, timeout: float) -> None:
        """Ask the workers on ``engine_ids`` to leave the RPC group (bounded by timeout)."""
        if self.client is None:
            return
        pending = []
        for eid in engine_ids:
            try:
                pending.append(self.apply(eid, _worker.leave))
            except Exception as exc:
                log.warning("could not ask engine %s to leave: %s", eid, exc)
        deadline = time.monotonic() + timeout
        for ar in pending:
            try:
                ar.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                if graceful:
                    log.warning("a worker did not leave the RPC group cleanly: %s", exc)

    def stop(self, pids: list[int], keep_spares: bool) -> None:
        """Stop the engines this cluster used (never reusable: torch joins once per
        process) and warm as many spares for the next ``init``; attached engines run on."""
        if self.local is not None:
            self.local.retire(pids, self.taken)
            if keep_spares and self.taken:
                self.local.warm(len(self.taken))
            self.taken = []
        elif self.hosts is not None:
            try:
                self.hosts.retire(self.taken, os.getpid())
            finally:
                self.hosts.release()
                self.hosts = None
                self.taken = []
        elif self.client is not None:
            try:
                self.client.close()
            except Exception as exc:
                log.warning("closing the ipyparallel client: %s", exc)
        self.client = None
