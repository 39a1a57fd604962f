"""What the changes of a running cluster read and change of it: a restart, a scale, a
shutdown's leave. One :class:`Cluster` protocol, which ``nbrpc.Cluster`` satisfies; those
modules take it rather than the class, which imports them."""

from __future__ import annotations

from typing import Protocol

from nbrpc._engines import Engines
from nbrpc._options import Settings
from nbrpc._rows import WorkerRecord

from .aside import Aside
from .booted import Booted


class Cluster(Protocol):
    """A running cluster, as a restart, a scale and a leave see it (``nbrpc.Cluster``)."""

    settings: Settings
    booted: Booted
    engines: Engines
    aside: Aside

    @property
    def records(self) -> list[WorkerRecord]: ...

    def dead_workers(self, ask_ipyparallel: bool = True) -> list[str]: ...
