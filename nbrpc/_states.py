"""The one owner of each worker's state, and the listeners told of every change.

A worker's :class:`~nbrpc._rows.WorkerRecord` changes state only here: each function below
is one transition, checked against :data:`~nbrpc._rows.WORKER_NEXT` (``WorkerRecord.move``),
and then told to every listener as a :class:`WorkerChange`. Whoever reacts to a change
registers once (:func:`listen`) instead of being called beside each change by hand: the
call facade, native output and the debugger's prompts, registered by the lifecycle
(``nbrpc._lifecycle.cluster``), which sits above them; a view may register too.

The transitions::

    adopt       a new cluster's workers (ready)                     -> JOINED
    mark_dead   ready -> dead: a call or a probe found it gone      -> DIED
    restarting  ready or dead -> restarting (%rpc_restart)          -> RESTARTING
    left        the old processes are out of the group for good     -> LEFT
    rejoined    restarting -> ready, a fresh process (a restart)     -> REJOINED
    failed      restarting -> dead: its restart failed              -> DIED
    stopped     ready or dead -> stopped, at a shutdown             -> STOPPED
    leaving     nbrpc makes them leave (a shutdown, a failed boot)  -> LEAVING
    grew        new workers joined a running cluster (a scale)      -> JOINED
    departed    ready or dead -> left, at a scale (%rpc_scale)      -> LEFT (``at`` set)

The owner also keeps which workers' calls fail at once, unsent (:data:`unreachable`: a
dead worker's and one being restarted, with why), for the call facade's lookup on every
call: a dict, read without a lock. A worker process (no cluster of its own) keeps the
same record for the workers its own calls found gone.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ._errors import ConfigError
from ._rows import WorkerRecord, WorkerState


class Change(enum.StrEnum):
    """What happened to some workers (:attr:`WorkerChange.kind`)."""

    JOINED = "joined"  # a new cluster's workers
    DIED = "died"  # their process is gone (or their restart failed)
    LEAVING = "leaving"  # nbrpc makes them leave: their connections' end is expected
    RESTARTING = "restarting"  # being replaced; they are leaving too
    LEFT = "left"  # their old processes (``ranks``) are out of the group for good
    REJOINED = "rejoined"  # a fresh process under each name (a restart)
    STOPPED = "stopped"  # they left at a shutdown


@dataclass(frozen=True)
class WorkerChange:
    """One change, as every listener gets it."""

    kind: Change
    names: tuple[str, ...]
    ranks: tuple[int, ...] = ()  # LEFT: the ranks of the processes that left
    detail: str = ""  # DIED: why (what torch said, or why the restart failed); LEAVING: why
    replaced: bool = False  # LEFT: fresh processes take their names (a restart)
    at: str = ""  # LEFT at a scale: when ("14:02:11"); their names are free again


#: A listener: called after the change, on the thread that made it (a call's failure
#: comes on torch's thread); it must be quick and must not raise.
Listener = Callable[[WorkerChange], None]


@dataclass
class _Owner:
    lock: threading.RLock = field(default_factory=threading.RLock)
    records: dict[str, WorkerRecord] = field(default_factory=dict)  # the workers, by name
    failing: dict[str, str] = field(default_factory=dict)  # name -> why its calls fail
    departed: dict[str, str] = field(default_factory=dict)  # name -> when it left at a scale
    listeners: list[Listener] = field(default_factory=list)
    changing: str = ""  # what changes the set of workers now (a scale, a restart)


_owner = _Owner()

#: Workers whose calls fail at once, unsent: name -> why (read-only; the owner's own dict)
unreachable: Mapping[str, str] = MappingProxyType(_owner.failing)
#: Workers that left this cluster at a scale, not back since: name -> when (read-only)
departed: Mapping[str, str] = MappingProxyType(_owner.departed)


def listen(listener: Listener) -> None:
    """Tell ``listener`` every change from now on (once, however often it is registered)."""
    with _owner.lock:
        if listener not in _owner.listeners:
            _owner.listeners.append(listener)


def unlisten(listener: Listener) -> None:
    """``listener`` is told nothing more (a view that closed)."""
    with _owner.lock:
        if listener in _owner.listeners:
            _owner.listeners.remove(listener)


def _tell(change: WorkerChange) -> None:
    if not change.names and not change.ranks:
        return
    for listener in list(_owner.listeners):
        listener(change)


@contextlib.contextmanager
def changing(what: str) -> Iterator[None]:
    """One change of the set of workers at a time (``what``: "a scale to 4 workers", "a
    restart of worker2"): a second one meanwhile is refused, naming the first."""
    with _owner.lock:
        if _owner.changing:
            raise ConfigError(
                f"{_owner.changing} is running: wait for it to end, then try again. Nothing "
                "changed."
            )
        _owner.changing = what
    try:
        yield
    finally:
        _owner.changing = ""


def state_of(name: str) -> WorkerState | None:
    """Worker ``name``'s state in the current cluster (None: not one of its workers)."""
    record = _owner.records.get(name)
    return record.state if record is not None else None


def orders() -> dict[str, int]:
    """The ``nbrpc.rank()`` of each worker of the running cluster ({}: none here, as in a
    worker process, or it stopped)."""
    with _owner.lock:
        records = list(_owner.records.values())
    return {r.name: r.order for r in records if r.state is not WorkerState.STOPPED}


def adopt(workers: list[WorkerRecord]) -> None:
    """A new cluster's workers (the kernel not among them) joined: their states are
    owned here from now on, and no call fails for an earlier cluster's workers."""
    with _owner.lock:
        _owner.records = {r.name: r for r in workers}
        _owner.failing.clear()
        _owner.departed.clear()
    _tell(WorkerChange(Change.JOINED, tuple(r.name for r in workers)))


def grew(workers: list[WorkerRecord]) -> None:
    """New workers joined the running cluster (a scale): owned here beside the others; a
    name that left at an earlier scale is a worker again."""
    with _owner.lock:
        for record in workers:
            _owner.records[record.name] = record
            _owner.failing.pop(record.name, None)
            _owner.departed.pop(record.name, None)
    _tell(WorkerChange(Change.JOINED, tuple(r.name for r in workers)))


def departed_at_scale(names: list[str], ranks: list[int], at: str) -> None:
    """``names`` (the processes of ``ranks``) left the cluster at a scale, at ``at``: they
    are no longer its workers; calls to them and their RRefs say so."""
    with _owner.lock:
        for name in names:
            _owner.failing.pop(name, None)
            _owner.departed[name] = at
            record = _owner.records.pop(name, None)
            if record is not None:
                record.move(WorkerState.LEFT)
    _tell(WorkerChange(Change.LEFT, tuple(names), tuple(ranks), at=at))


def mark_dead(name: str, detail: str = "") -> None:
    """Worker ``name``'s process is gone (a call lost its connection, or its engine or pid
    is gone): calls to it fail at once from now on, with the first ``detail`` given. A
    ready worker becomes dead; one that is already dead or being restarted stays so."""
    with _owner.lock:
        _owner.failing.setdefault(name, detail)
        record = _owner.records.get(name)
        if record is None or record.state is not WorkerState.READY:
            return
        record.move(WorkerState.DEAD)
    _tell(WorkerChange(Change.DIED, (name,), detail=detail))


def restarting(names: list[str], detail: str) -> None:
    """``names`` are being replaced by fresh processes: their calls fail at once meanwhile
    (with ``detail``, unless they were already dead) and they are leaving."""
    with _owner.lock:
        for name in names:
            _owner.failing.setdefault(name, detail)
        _move(names, WorkerState.RESTARTING)
    _tell(WorkerChange(Change.RESTARTING, tuple(names)))


def left(names: list[str], ranks: list[int]) -> None:
    """The processes of ``ranks`` (``names``' old ones) are out of the group for good:
    replaced when ``names`` are being restarted, else gone at a shutdown."""
    with _owner.lock:
        replaced = bool(names) and all(state_of(name) is WorkerState.RESTARTING for name in names)
    _tell(WorkerChange(Change.LEFT, tuple(names), tuple(ranks), replaced=replaced))


def rejoined(fresh: list[WorkerRecord]) -> None:
    """A fresh process joined under each name of ``fresh`` (a restart): ready again."""
    with _owner.lock:
        for record in fresh:
            _owner.failing.pop(record.name, None)
            _owner.records[record.name].rejoin(record)
    _tell(WorkerChange(Change.REJOINED, tuple(r.name for r in fresh)))


def failed(names: list[str], detail: str) -> None:
    """The restart of ``names`` failed: they are dead, their calls fail with ``detail``."""
    with _owner.lock:
        for name in names:
            _owner.failing[name] = detail
        _move(names, WorkerState.DEAD)
    _tell(WorkerChange(Change.DIED, tuple(names), detail=detail))


def stopped(names: list[str]) -> None:
    """``names`` left at a shutdown (or were dropped by one that is not graceful)."""
    with _owner.lock:
        _move(names, WorkerState.STOPPED)
    _tell(WorkerChange(Change.STOPPED, tuple(names)))


def leaving(names: Iterable[str], why: str = "") -> None:
    """nbrpc makes ``names`` leave (a shutdown, a boot that failed, a scale: ``why``): no
    state changes yet, but the end of their connections is expected."""
    _tell(WorkerChange(Change.LEAVING, tuple(names), detail=why))


def _move(names: list[str], state: WorkerState) -> None:
    for name in names:
        _owner.records[name].move(state)
