"""Engines of an ipyparallel cluster someone else started (``--profile`` / ``--cluster-id``).

nbrpc uses them and leaves them running: they may be on any host, started by any of
ipyparallel's launchers (``ipcluster start -n 4 --profile NAME``, MPI, a batch system).
An engine that served one group must be restarted before it joins another: torch joins
once per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nbrpc import _options
from nbrpc._errors import BootError, ConfigError

log = logging.getLogger("nbrpc")


class AttachedSource:
    """The engines of a running ipyparallel cluster, used and left running."""

    #: taken as this host's (``ipcluster start`` here): their pids are watched, and the
    #: shared-memory probe tells whether they see this kernel's /dev/shm
    remote = False
    reused = ""
    cannot_replace = (
        "the engines of an attached ipyparallel cluster are not nbrpc's to replace. Restart "
        "the engine with ipyparallel, then %rpc_shutdown and %rpc_init"
    )

    def __init__(self, settings: _options.Settings) -> None:
        self.settings = settings
        self._client: Any = None

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        return settings.attached

    @classmethod
    def resolve(cls, settings: _options.Settings) -> _options.Settings:
        return settings

    @classmethod
    def release_kept(cls) -> None:
        pass  # nothing of ours runs

    def start(self) -> None:
        pass  # they run already

    def hosts(self) -> list[str]:
        return []  # known once they registered: they report them

    def launch(self, n: int) -> None:
        pass  # ipyparallel's engines are started by whoever started the cluster

    def client(self) -> Any:
        import ipyparallel as ipp

        if self._client is None:
            profile, cluster_id = self.settings.profile, self.settings.cluster_id
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
        """Ids of ``n`` registered engines (``None``: all of them)."""
        deadline = time.monotonic() + timeout
        while True:
            ids = sorted(self.client().ids)
            registered(len(ids))
            if n is None and ids:
                return ids
            if n is not None and len(ids) >= n:
                return ids[:n]
            if time.monotonic() > deadline:
                raise BootError(
                    f"only {len(ids)} of {n} ipyparallel engines registered within "
                    f"{timeout:.0f} s. Start more engines in the attached "
                    "cluster, or ask for fewer with -n."
                )
            time.sleep(0.05)

    def controller_seconds(self) -> float | None:
        return None  # not ours

    def import_seconds(self) -> float | None:
        return None

    def controller_pid(self) -> int | None:
        return None

    def last_output(self, pid: int) -> str:
        return ""

    def summary_note(self) -> str:
        return ""

    def stop(self, engine_ids: list[int], pids: list[int], keep_warm: bool) -> None:
        """Its engines run on; only the client closes."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception as exc:
                log.warning("closing the ipyparallel client: %s", exc)
            self._client = None

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        raise ConfigError(self.cannot_replace)

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        return {}  # hosts nbrpc has no way into: nbrpc.stacks asks by RPC
