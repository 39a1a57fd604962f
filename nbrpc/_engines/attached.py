"""Engines of an ipyparallel cluster someone else started (``--profile`` / ``--cluster-id``).

nbrpc uses them and leaves them running: they may be on any host, started by any of
ipyparallel's launchers (``ipcluster start -n 4 --profile NAME``, MPI, a batch system).
An engine that served one group must be restarted before it joins another: torch joins
once per process.

How many to wait for: ``-n N`` if given, else the engines the cluster was started with,
read from ipyparallel's cluster file (``ipcluster start`` and ``ipp.Cluster`` write it).
ipyparallel registers engines at its heart monitor's ticks, so engines still starting
arrive in batches: taking "whatever has registered" would split them at a tick. Without
a cluster file (engines started by hand with ``ipengine``), nbrpc takes the engines that
registered once no new one came for a few ticks, and warns that it had to guess.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nbrpc import _options
from nbrpc._errors import BootError, counted
from nbrpc._source_options import Attached

from .base import EngineSource

log = logging.getLogger("nbrpc")

#: without a cluster file: no new engine for this long means all have registered (longer
#: than two ticks of ipyparallel's heart monitor, 3 s by default)
SETTLE_S = 7.0
#: How long a grow waits for idle engines to register in an attached cluster.
GROW_WAIT_S = 30.0


def started_with(profile: str | None, cluster_id: str | None) -> int | None:
    """How many engines the attached cluster was started with, from its cluster file
    (``None``: no file, e.g. engines started by hand with ``ipengine``)."""
    import ipyparallel as ipp

    try:
        path = ipp.Cluster(profile=profile or "", cluster_id=cluster_id or "").cluster_file
        with open(path) as f:
            sets = json.load(f).get("engines", {}).get("sets", {})
        return sum(int(each.get("n", 0)) for each in sets.values()) or None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.debug("no cluster file for profile=%r cluster_id=%r: %s", profile, cluster_id, exc)
        return None


class AttachedSource(EngineSource):
    """The engines of a running ipyparallel cluster, used and left running: none of them
    nbrpc's to restart or read on their hosts (``nbrpc.stacks`` asks them by RPC)."""

    #: taken as this host's (``ipcluster start`` here): their pids are watched, and the
    #: shared-memory probe tells whether they see this kernel's /dev/shm
    remote = False
    cannot_replace = (
        "the engines of an attached ipyparallel cluster are not nbrpc's to replace. Restart "
        "the engine with ipyparallel, then %rpc_shutdown and %rpc_init"
    )

    cannot_scale = ""

    def __init__(self, settings: _options.Settings) -> None:
        super().__init__(settings)
        self._client: Any = None
        self._used: set[int] = set()  # engine ids handed to the cluster (torch joins once)

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        return settings.options_of(Attached) is not None

    @classmethod
    def resolve(cls, settings: _options.Settings) -> _options.Settings:
        """Without ``-n``: as many workers as the cluster was started with, when its
        cluster file says (so the boot waits for all of them, with its progress)."""
        asked = settings.options_of(Attached)
        if settings.n is not None or asked is None:
            return settings
        expected = started_with(asked.profile, asked.cluster_id)
        return settings if expected is None else replace(settings, n=expected)

    def start(self) -> None:
        pass  # they run already

    def launch(self, n: int) -> None:
        pass  # ipyparallel's engines are started by whoever started the cluster

    def client(self) -> Any:
        import ipyparallel as ipp

        if self._client is None:
            asked = self.settings.options_of(Attached)
            assert asked is not None, "wants() took it for these settings"
            profile, cluster_id = asked.profile, asked.cluster_id
            try:
                self._client = ipp.Client(profile=profile, cluster_id=cluster_id or "")
            except Exception as exc:
                raise BootError(
                    f"could not attach to the ipyparallel cluster (profile={profile!r}, "
                    f"cluster_id={cluster_id!r}): {exc}. Is it running? "
                    "Start it with `ipcluster start -n N --profile NAME`."
                ) from exc
        return self._client

    def take(self, n: int | None, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Ids of ``n`` registered engines (``None``: the cluster's size is unknown, so
        those registered once no new one came for :data:`SETTLE_S`)."""
        deadline = time.monotonic() + timeout
        seen, since = 0, time.monotonic()
        while True:
            ids = sorted(self.client().ids)
            registered(len(ids))
            if n is not None and len(ids) >= n:
                self._used.update(ids[:n])
                return ids[:n]
            if len(ids) != seen:
                seen, since = len(ids), time.monotonic()
            elif n is None and ids and time.monotonic() - since >= SETTLE_S:
                warnings.warn(
                    f"took the {counted(len(ids), 'engine')} registered in the attached "
                    "ipyparallel cluster: it has no cluster file saying how many it was "
                    "started with. Pass -n N (n=N) to wait for N engines.",
                    stacklevel=2,
                )
                self._used.update(ids)
                return ids
            if time.monotonic() > deadline:
                expected = "at least 1" if n is None else str(n)
                raise BootError(
                    f"only {len(ids)} of {expected} ipyparallel engines registered within "
                    f"{timeout:.0f} s in the attached cluster. Start more engines there "
                    "(ipcluster engines -n N --profile NAME), or ask for fewer with -n."
                )
            time.sleep(0.05)

    def grow(
        self, n: int, hosts: tuple[str, ...], timeout: float, registered: Callable[..., None]
    ) -> list[int]:
        """Idle engines that registered with the attached cluster, waited for up to
        :data:`GROW_WAIT_S`: nbrpc never starts engines there. An engine a worker of this
        cluster ran in is never taken again (a process joins torch's RPC once)."""
        deadline = time.monotonic() + min(timeout, GROW_WAIT_S)
        while True:
            idle = [i for i in sorted(self.client().ids) if i not in self._used]
            registered(len(idle))
            if len(idle) >= n:
                self._used.update(idle[:n])
                return idle[:n]
            if time.monotonic() > deadline:
                raise BootError(
                    f"the attached ipyparallel cluster has {len(idle)} idle engine"
                    f"{'' if len(idle) == 1 else 's'}, not {n}, after {GROW_WAIT_S:.0f} s: "
                    "nbrpc does not start engines there. Start more (ipcluster engines -n "
                    f"{n - len(idle)} --profile NAME), then %rpc_scale again."
                )
            time.sleep(0.05)

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        """Its engines run on (they left the RPC group, and are never taken again)."""

    def stop(self, engine_ids: list[int], pids: list[int], keep_warm: bool) -> None:
        """Its engines run on; only the client closes."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception as exc:
                log.warning("closing the ipyparallel client: %s", exc)
            self._client = None
