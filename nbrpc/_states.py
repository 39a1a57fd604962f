"""The one owner of each worker's state and of a cluster's list of workers, and the
listeners told of every change.

A cluster's processes are one :class:`Roster`: the records (the kernel's first, then the
workers in rank order) and the engines of workers still joining. The lifecycle reads it;
only the functions here write it, so a boot, a scale and a restart keep one list, not
two written side by side. A worker's :class:`~nbrpc._rows.WorkerRecord` changes state
only here: each function below is one transition, checked against :data:`NEXT`, and
then told to every listener as a :class:`WorkerChange`. Whoever reacts to a change
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
    settled     (no change) what follows their join is done         -> SETTLED
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

from ._errors import ClusterClosedError, ConfigError
from ._rows import WorkerRecord, WorkerState

#: The transitions a worker's state may take (the cluster's own are
#: ``_lifecycle.cluster._NEXT``); :func:`_move` refuses any other.
NEXT: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.READY: frozenset(
        {WorkerState.DEAD, WorkerState.RESTARTING, WorkerState.STOPPED, WorkerState.LEFT}
    ),
    WorkerState.DEAD: frozenset({WorkerState.RESTARTING, WorkerState.STOPPED, WorkerState.LEFT}),
    WorkerState.RESTARTING: frozenset({WorkerState.READY, WorkerState.DEAD}),
    WorkerState.STOPPED: frozenset(),
    WorkerState.LEFT: frozenset(),
}


class Change(enum.StrEnum):
    """What happened to some workers (:attr:`WorkerChange.kind`)."""

    JOINED = "joined"  # a new cluster's workers
    DIED = "died"  # their process is gone (or their restart failed)
    LEAVING = "leaving"  # nbrpc makes them leave: their connections' end is expected
    RESTARTING = "restarting"  # being replaced; they are leaving too
    LEFT = "left"  # their old processes (``ranks``) are out of the group for good
    REJOINED = "rejoined"  # a fresh process under each name (a restart)
    STOPPED = "stopped"  # they left at a shutdown
    SETTLED = "settled"  # what follows a join is done: their lanes and side doors are open


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
class Roster:
    """One cluster's processes: ``records``, the kernel's first, then its workers in rank
    order (``nbrpc.rank()``), each with its ipyparallel engine; and ``joining``: the
    engine of each worker asked to join that has no record yet (a boot's, a grow's, a
    restart's fresh process), from the moment its join was asked. A cluster keeps its
    roster after it stopped (its records then say "stopped"). Read anywhere; written
    only by this module's functions."""

    records: list[WorkerRecord] = field(default_factory=list)
    joining: dict[str, int] = field(default_factory=dict)

    def workers(self) -> list[WorkerRecord]:
        """The workers' records (the kernel's left out), in rank order."""
        return self.records[1:]

    def ready(self) -> list[str]:
        """The names of the workers that are ready, in rank order."""
        return [r.name for r in self.records[1:] if r.state is WorkerState.READY]

    def find(self, name: str) -> WorkerRecord | None:
        """Worker ``name``'s record (None: no worker of this cluster)."""
        return next((r for r in self.records[1:] if r.name == name), None)

    def engines(self) -> dict[str, int]:
        """Every worker asked to join, joined or not, and its engine (a restarted
        worker's: its fresh process's, from its join on)."""
        found = {r.name: r.engine_id for r in self.records[1:] if r.engine_id is not None}
        return {**found, **self.joining}


@dataclass
class _Owner:
    lock: threading.RLock = field(default_factory=threading.RLock)
    roster: Roster = field(default_factory=Roster)  # the current cluster's
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
    record = _owner.roster.find(name)
    return record.state if record is not None else None


def orders() -> dict[str, int]:
    """The ``nbrpc.rank()`` of each worker of the running cluster ({}: none here, as in a
    worker process, or it stopped)."""
    with _owner.lock:
        records = _owner.roster.workers()
    return {r.name: r.order for r in records if r.state is not WorkerState.STOPPED}


def asked_to_join(roster: Roster, name: str, engine_id: int) -> None:
    """Worker ``name`` of ``roster`` was asked to join from engine ``engine_id``."""
    with _owner.lock:
        roster.joining[name] = engine_id


def not_joined(roster: Roster, names: list[str]) -> None:
    """The joins ``names`` were asked for failed or were stopped: their engines stop."""
    with _owner.lock:
        for name in names:
            roster.joining.pop(name, None)


def booted(roster: Roster, records: list[WorkerRecord]) -> None:
    """A boot's processes joined (``records``: the kernel's first, then the workers in
    rank order); :func:`adopt` makes them the running cluster's."""
    with _owner.lock:
        roster.records = list(records)
        for record in records:
            roster.joining.pop(record.name, None)


def adopt(roster: Roster) -> None:
    """A new cluster's workers joined: their states are owned here from now on, and no
    call fails for an earlier cluster's workers."""
    with _owner.lock:
        _owner.roster = roster
        _owner.failing.clear()
        _owner.departed.clear()
    _tell(WorkerChange(Change.JOINED, tuple(r.name for r in roster.workers())))


def grew(workers: list[WorkerRecord]) -> None:
    """New workers joined the running cluster (a scale): in its roster beside the others,
    in rank order; a name that left at an earlier scale is a worker again."""
    with _owner.lock:
        roster = _owner.roster
        for record in workers:
            roster.joining.pop(record.name, None)
            _owner.failing.pop(record.name, None)
            _owner.departed.pop(record.name, None)
        roster.records[1:] = sorted([*roster.records[1:], *workers], key=lambda r: r.order)
    _tell(WorkerChange(Change.JOINED, tuple(r.name for r in workers)))


def departed_at_scale(names: list[str], ranks: list[int], at: str) -> None:
    """``names`` (the processes of ``ranks``) left the cluster at a scale, at ``at``: they
    are no longer its workers; calls to them and their RRefs say so."""
    with _owner.lock:
        roster = _owner.roster
        for name in names:
            _owner.failing.pop(name, None)
            _owner.departed[name] = at
            roster.joining.pop(name, None)
            record = roster.find(name)
            if record is not None:
                _move(record, WorkerState.LEFT)
                roster.records.remove(record)
    _tell(WorkerChange(Change.LEFT, tuple(names), tuple(ranks), at=at))


def mark_dead(name: str, detail: str = "") -> None:
    """Worker ``name``'s process is gone (a call lost its connection, or its engine or pid
    is gone): calls to it fail at once from now on, with the first ``detail`` given. A
    ready worker becomes dead; one that is already dead or being restarted stays so."""
    with _owner.lock:
        _owner.failing.setdefault(name, detail)
        record = _owner.roster.find(name)
        if record is None or record.state is not WorkerState.READY:
            return
        _move(record, WorkerState.DEAD)
    _tell(WorkerChange(Change.DIED, (name,), detail=detail))


def restarting(names: list[str], detail: str) -> None:
    """``names`` are being replaced by fresh processes: their calls fail at once meanwhile
    (with ``detail``, unless they were already dead) and they are leaving."""
    with _owner.lock:
        for name in names:
            _owner.failing.setdefault(name, detail)
        _move_all(names, WorkerState.RESTARTING)
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
        roster = _owner.roster
        for record in fresh:
            _owner.failing.pop(record.name, None)
            roster.joining.pop(record.name, None)
            old = roster.find(record.name)
            assert old is not None, "a restart replaces workers of the running cluster"
            old.rank, old.pid, old.host, old.role = (
                record.rank,
                record.pid,
                record.host,
                record.role,
            )
            old.devices, old.engine_id = record.devices, record.engine_id
            _move(old, WorkerState.READY)
    _tell(WorkerChange(Change.REJOINED, tuple(r.name for r in fresh)))


def failed(names: list[str], detail: str) -> None:
    """The restart of ``names`` failed: they are dead, their calls fail with ``detail``."""
    with _owner.lock:
        for name in names:
            _owner.failing[name] = detail
        _move_all(names, WorkerState.DEAD)
    _tell(WorkerChange(Change.DIED, tuple(names), detail=detail))


def stopped(names: list[str]) -> None:
    """``names`` left at a shutdown (or were dropped by one that is not graceful)."""
    with _owner.lock:
        _move_all(names, WorkerState.STOPPED)
    _tell(WorkerChange(Change.STOPPED, tuple(names)))


def settled(names: list[str]) -> None:
    """What follows the join of ``names`` is done (a boot's, a grow's, a restart's:
    ``_lifecycle.boot.Joining.after_join``): their lanes and side doors are open. No state
    changes."""
    _tell(WorkerChange(Change.SETTLED, tuple(names)))


def leaving(names: Iterable[str], why: str = "") -> None:
    """nbrpc makes ``names`` leave (a shutdown, a boot that failed, a scale: ``why``): no
    state changes yet, but the end of their connections is expected."""
    _tell(WorkerChange(Change.LEAVING, tuple(names), detail=why))


def _move_all(names: list[str], state: WorkerState) -> None:
    for name in names:
        record = _owner.roster.find(name)
        assert record is not None, f"{name} is a worker of the running cluster"
        _move(record, state)


def _move(record: WorkerRecord, state: WorkerState) -> None:
    """``record``'s state becomes ``state`` (staying where it is is no change). Raises
    :class:`~nbrpc.ClusterClosedError` for a transition :data:`NEXT` lacks (a stopped
    worker cannot become ready)."""
    if state is not record.state and state not in NEXT[record.state]:
        raise ClusterClosedError(
            f"{record.name} is {record.state.value} and cannot become {state.value}"
        )
    record.state = state
