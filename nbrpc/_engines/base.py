"""The engine source: a base that every way of getting engines extends.

A source writes only what it does: :meth:`EngineSource.wants`, :meth:`start`,
:meth:`launch`, :meth:`client`, :meth:`take` and :meth:`stop`. Everything else has a
default here that fits a source with nothing of the kind (no controller of this host, no
warm engines kept, no way to restart one engine or read its stack from its host); a
source overrides what it can do better. ``tests/unit/test_layers.py`` holds every registered
source to these signatures.

The ipyparallel client is not thread-safe: only the thread that runs the lifecycle (the
kernel's main thread) calls these methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbrpc import _options
from nbrpc._errors import ConfigError


class EngineSource:
    """One way of getting a cluster's engines (see ``nbrpc/_engines/__init__.py``)."""

    #: the engines run on other hosts: their pids are not this host's, and shared memory
    #: is probed host by host
    remote: bool = False
    #: why the controller and warm engines were there before this cluster ("kept from
    #: the last cluster", "warmed up at %load_ext"); "" when started for it
    reused: str = ""
    #: why nothing kept could serve this cluster, when something should have (the warm-up
    #: at %load_ext failed: what it hit); said beside the controller's phase
    afresh_because: str = ""
    #: why :meth:`replace` cannot work for this source ("": it can), said before a
    #: restart stops anything
    cannot_replace: str = "this kind of engine cannot be replaced alone"
    #: why :meth:`grow` and :meth:`shrink` cannot work for this source ("": they can),
    #: said before a scale changes anything
    cannot_scale: str = "this kind of cluster cannot change its size while it runs"

    def __init__(self, settings: _options.Settings) -> None:
        self.settings = settings

    # -- what every source writes ---------------------------------------------------------

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        """Whether these settings ask for this source."""
        raise NotImplementedError

    def start(self) -> None:
        """Start what engines need (a controller, a zygote); returns at once."""
        raise NotImplementedError

    def launch(self, n: int) -> None:
        """Ask for ``n`` engines; they register with the controller in the background."""
        raise NotImplementedError

    def client(self) -> Any:
        """The ipyparallel client, connected to the controller."""
        raise NotImplementedError

    def take(self, n: int | None, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Ids of ``n`` registered engines, in worker order (``None``: all there are),
        never handed out again; ``registered(count)`` as engines arrive, or
        ``registered(count, note)`` with what they wait for (a job in Slurm's queue)."""
        raise NotImplementedError

    def stop(self, engine_ids: list[int], pids: list[int], keep_warm: bool) -> None:
        """Stop the engines a cluster used (``pids``: those of this host);
        ``keep_warm``: start spares for the next cluster, where the source keeps any."""
        raise NotImplementedError

    # -- defaults ---------------------------------------------------------------------------

    @classmethod
    def resolve(cls, settings: _options.Settings) -> _options.Settings:
        """The settings completed with what only this source can work out."""
        return settings

    @classmethod
    def check_room(cls, count: int) -> None:
        """Refuse ``count`` more workers that cannot fit where this source puts them, before
        anything starts (the local source checks this host's memory; a source that places
        workers on other machines leaves that to them)."""

    @classmethod
    def release_kept(cls) -> None:
        """Stop what this source keeps between clusters (``%rpc_shutdown --release``)."""

    def hosts(self) -> list[str]:
        """The addresses of the hosts its engines will run on, known before they start
        (admitted through the member filter first); [] when they are this host's, or
        known only once they registered (they report them then)."""
        return []

    def controller_seconds(self) -> float | None:
        """Seconds until its controller answered (0: kept; None: not started by it)."""
        return None

    def import_seconds(self) -> float | None:
        """Seconds its engines' imports took, once (0: done before; None: per engine)."""
        return None

    def controller_pid(self) -> int | None:
        """The pid of the controller it started on this host (None: none)."""
        return None

    def last_output(self, pid: int) -> str:
        """What engine ``pid`` printed as it crashed, or why the source lost it (a Slurm
        job that ended); "" if nothing, or not known here."""
        return ""

    def summary_note(self) -> str:
        """A line for the cluster's summary about where the engines came from ("": none)."""
        return ""

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        """Kill the engines ``engine_ids`` (processes ``pids`` on their own hosts) and
        start as many new ones where they ran; the new ids, registered, in that order
        (``nbrpc.restart``)."""
        raise ConfigError(self.cannot_replace)

    def grow(
        self, n: int, hosts: tuple[str, ...], timeout: float, registered: Callable[..., None]
    ) -> list[int]:
        """``n`` more engines for a running cluster (``%rpc_scale``), from where its first
        ones came; ``hosts``: where, for a source that places engines on hosts (else
        ``()``: its own choice). Their ids, registered, in worker order; ``registered`` as
        in :meth:`take`."""
        raise ConfigError(self.cannot_scale)

    def check_hosts(self, hosts: tuple[str, ...]) -> None:
        """Refuse ``hosts`` for a :meth:`grow` before anything starts (a source that
        places engines on hosts checks them; the others take none)."""
        if hosts:
            raise ConfigError(
                "--hosts names where new workers start: only a cluster started with "
                "--hosts takes it"
            )

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop some of a running cluster's engines, whose workers left (``pids``: of
        this host, or on their own hosts for a remote source); the others keep running."""
        raise ConfigError(self.cannot_scale)

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        """Every thread's Python stack of the engines (processes ``pids`` on their own
        hosts), read on their hosts without their GIL (:mod:`nbrpc._wire.stacks`): by engine
        id, ``{"dump", "labels"}`` or ``{"error"}``; {} where the source cannot reach its
        engines' hosts (``nbrpc.stacks`` then asks by RPC)."""
        return {}
