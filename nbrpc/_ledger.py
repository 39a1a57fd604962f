"""What each process knows about its RRefs and calls: the data behind ``nbrpc.ownership()``.

torch keeps RRefs in a C++ context that Python cannot list, so every process keeps its own
ledger of the Python RRef handles it holds, with weak references: a handle that is dropped
and garbage-collected leaves the ledger by itself. A handle enters the ledger where it is
born in that process:

* ``torch.distributed.rpc.remote`` (and so ``nbrpc.remote``): patched to record the result
  with a label such as ``remote(worker1, ParameterServer)``;
* ``RRef(value)``: the local-owner constructor, patched the same way;
* unpickling: an RRef that arrives as an argument or a return value. nbrpc's pickler
  (:mod:`nbrpc._wire.pickling`) reduces RRefs through :func:`reduce_rref`, so the label and the
  value's type travel with the fork and the receiver records them.

The kernel asks every process for :func:`snapshot` and :func:`merge` joins them by RRef id:
one row per live RRef with its owner and the processes that hold a user reference.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from . import _process, _timers, _torch
from ._rows import OwnershipRow
from ._torch import PyRRef

_TYPE_WAIT_S = 1.0  # how long one snapshot waits for owners to say what their values are
HOLD_SWEEP_S = 0.2  # how often the timer service looks at the held remote() handles
SETTLED_FOR_S = 0.1  # how long a handle stays held after its owner's confirmation was seen


@dataclass
class _Entry:
    created_by: str
    type: str | None
    creator: str
    owner: int = -1  # the owner's rank when the handle was made (-1: not known)


@dataclass
class _Ledger:
    """The Python RRef handles this process holds (weakly), and torch's originals of the
    two places nbrpc patches to record them."""

    handles: weakref.WeakKeyDictionary[PyRRef, _Entry] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``[handle, when its confirmation was first seen (0: not yet)]`` for each handle
    #: ``remote()`` made here whose creation is not settled: see :func:`_hold`
    held: list[list] = field(default_factory=list)
    sweep: _timers.Timer | None = None  # the timer service's next look at ``held``
    remote: Any = None  # torch.distributed.rpc.remote
    rref_init: Any = None  # RRef.__init__


_ledger = _Ledger()


def _record(rref: PyRRef, created_by: str, type_name: str | None, creator: str) -> PyRRef:
    try:  # known now; once a restart replaced the owner, torch no longer knows its rank
        owner = _torch.original_owner(rref).id
    except RuntimeError:
        owner = -1
    with _ledger.lock:
        _ledger.handles[rref] = _Entry(created_by, type_name, creator, owner)
    return rref


def owner_rank(rref: PyRRef) -> int:
    """The rank of ``rref``'s owner when this process got the handle (-1: not known)."""
    with _ledger.lock:
        entry = _ledger.handles.get(rref)
    return entry.owner if entry is not None else -1


def _callable_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or type(func).__name__
    if name.startswith("_VariableFunctionsClass."):  # torch.add and the other builtins
        return "torch." + name.split(".", 1)[1]
    return name


def _destination_name(to: Any) -> str:
    return getattr(to, "name", None) or str(to)


def _patched_remote(to: Any, func: Any, *args: Any, **kwargs: Any) -> PyRRef:
    rref = _ledger.remote(to, func, *args, **kwargs)
    _torch.remember_creation(rref)
    _hold(rref)
    return label(rref, to, func)


def _hold(rref: PyRRef) -> None:
    """Hold a handle ``remote()`` just made until its owner confirmed it, and let it go on a
    Python thread (which holds the GIL), never on one of torch's RPC threads.

    Why: without this, an RRef the user dropped before its owner confirmed it dies in
    torch's confirmation callback, on an RPC thread. torch's ``RRefContext::delUser`` there
    takes the context's lock and sends the delete; the send can finish an earlier message
    inline and free its Python tensor, which waits for the GIL, still under the lock. A
    Python thread dropping another RRef at that moment holds the GIL and waits for the
    lock: a deadlock inside torch (10,000 RRefs made and dropped hung 2 of 10 test runs).
    Let go on a thread that holds the GIL, a delete never waits for it under the lock.

    torch marks a handle confirmed a moment before its callback lets go of its own
    reference: a handle is let go :data:`SETTLED_FOR_S` after its confirmation was first
    seen (a failed creation is confirmed too, with its error kept in the handle)."""
    if rref.is_owner():
        return
    with _ledger.lock:
        _ledger.held.append([rref, 0.0])
        if _ledger.sweep is None:
            _ledger.sweep = _timers.after(HOLD_SWEEP_S, _sweep_held)


def _sweep_held() -> None:
    """(The timer service, every :data:`HOLD_SWEEP_S` while any handle is held.)"""
    let_go_settled()
    with _ledger.lock:
        _ledger.sweep = _timers.after(HOLD_SWEEP_S, _sweep_held) if _ledger.held else None


def let_go_settled(everything: bool = False) -> None:
    """Let go of the held handles whose creation settled (``everything``: of all, as the
    group is left), on this thread: see :func:`_hold`."""
    if not _ledger.held:
        return
    now = time.monotonic()
    settled: list[list] = []
    kept: list[list] = []
    with _ledger.lock:
        for entry in _ledger.held:
            if not entry[1] and entry[0].confirmed_by_owner():
                entry[1] = now
            late = everything or (entry[1] and now - entry[1] >= SETTLED_FOR_S)
            (settled if late else kept).append(entry)
        _ledger.held = kept
    del settled, kept  # (here, outside the lock: a last reference sends its delete)


def _refs_of_first(entry: list) -> int:
    return sys.getrefcount(entry[0])


#: what :func:`_refs_of_first` says of a held entry's handle nothing else refers to
_ONLY_HELD = _refs_of_first([object(), 0.0])


def _handles() -> list[tuple[PyRRef, _Entry]]:
    """The handles this process holds, as its code sees them: not one that only the hold
    keeps alive (its code dropped it; it goes once its creation settles: :func:`_hold`)."""
    with _ledger.lock:
        only_held = {id(e[0]) for e in _ledger.held if _refs_of_first(e) <= _ONLY_HELD}
        return [(r, e) for r, e in _ledger.handles.items() if id(r) not in only_held]


def label(rref: PyRRef, to: Any, func: Any) -> PyRRef:
    """Record ``rref`` as made by ``remote(to, func)`` (``func``: what the user asked to
    run, also where another function carried it to the worker)."""
    type_name = func.__qualname__ if isinstance(func, type) else None
    created_by = f"remote({_destination_name(to)}, {_callable_name(func)})"
    return _record(rref, created_by, type_name, _process.name())


def _rref_init(self: PyRRef, value: Any, *args: Any, **kwargs: Any) -> None:
    _ledger.rref_init(self, value, *args, **kwargs)
    type_name = type(value).__qualname__
    _record(self, f"RRef({type_name})", type_name, _process.name())


def _receive(fork_data: tuple, created_by: str, type_name: str | None, creator: str) -> PyRRef:
    """Unpickling side of :func:`reduce_rref` (what torch's own receiver does, recorded)."""
    return _record(_torch.rref_from_fork(fork_data), created_by, type_name, creator)


def reduce_rref(rref: PyRRef) -> tuple:
    """Pickle an RRef as torch does (a fork of it), carrying its label and type along."""
    entry = _ledger.handles.get(rref) or _Entry("unknown", None, "?")
    return (_receive, (_torch.rref_fork(rref), entry.created_by, entry.type, entry.creator))


def install() -> None:
    """Patch the places where RRef handles are born (idempotent; every process)."""
    if _ledger.remote is not None:
        return
    _ledger.remote = _torch.patch_api("remote", _patched_remote)
    _ledger.rref_init = _torch.patch_api("RRef.__init__", _rref_init)


rref_id = _torch.rref_id


def holds_user_rrefs() -> bool:
    """Whether this process holds a live handle to an RRef another process owns."""
    return any(not rref.is_owner() for rref, _ in _handles())


def _type_of(rref: PyRRef, entry: _Entry, pending: list, dead: frozenset[str]) -> None:
    """The type of ``rref``'s value, asked of its owner once. Never of a dead owner: torch
    sends the RRef itself along, a fork that only the owner can confirm, and an unconfirmed
    fork stays pending in this process for good (every later shutdown waited its whole
    bound: "Timed out waiting for pending UserRRefs to be confirmed by owner and parent")."""
    if entry.type is not None:
        return
    try:
        if rref.is_owner():
            entry.type = type(rref.local_value()).__qualname__
        elif _torch.owner_name(rref) not in dead:  # torch caches the answer in the handle
            pending.append((entry, _torch.rref_type_future(rref)))
    except Exception:
        entry.type = "?"


#: The owner shown for an RRef whose owner is no longer in the group.
GONE = "(gone)"


def snapshot(dead: frozenset[str] = frozenset()) -> dict[str, Any]:
    """This process's handles and how many RRefs it owns (see ``_gather.census.figures``);
    ``dead``: workers known dead, whose RRefs' types are not asked."""
    held = _handles()
    pending: list = []
    rows = []
    for rref, entry in held:
        _type_of(rref, entry, pending, dead)
    deadline = time.monotonic() + _TYPE_WAIT_S
    for entry, fut in pending:
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.005)
        if fut.done():
            try:
                entry.type = fut.wait().__qualname__
            except Exception:
                entry.type = "?"
    for rref, entry in held:
        rows.append(
            {
                "id": rref_id(rref),
                # an RRef whose owner left the group (a dead worker, an earlier cluster)
                "owner": _torch.owner_name(rref) or GONE,
                "is_owner": rref.is_owner(),
                "type": entry.type,
                "created_by": entry.created_by,
                "creator": entry.creator,
            }
        )
    return {"handles": rows, "owned": _torch.owned_rref_count()}


def handle_count() -> int:
    """How many Python RRef handles this process's code holds now."""
    return len(_handles())


def merge(snapshots: list[dict[str, Any]]) -> list[OwnershipRow]:
    """One row per live RRef from every process's :func:`snapshot`, sorted by id.

    ``holders``: processes holding a user reference (not the owner);
    ``creator``: the process whose code made it;
    ``owner_holds``: whether the owner itself holds a Python handle;
    ``handles``: how many Python handles exist in all.
    """
    rows: dict[str, OwnershipRow] = {}
    for snap in snapshots:
        for handle in snap["handles"]:
            row = rows.setdefault(
                handle["id"],
                {
                    "id": handle["id"],
                    "owner": handle["owner"],
                    "holders": [],
                    "owner_holds": False,
                    "type": None,
                    "created_by": None,
                    "creator": None,
                    "handles": 0,
                },
            )
            row["handles"] += 1
            if handle["is_owner"]:
                row["owner_holds"] = True
            elif snap["name"] not in row["holders"]:
                row["holders"].append(snap["name"])
            if row["type"] in (None, "?") and handle["type"]:
                row["type"] = handle["type"]
            if row["created_by"] in (None, "unknown"):
                row["created_by"] = handle["created_by"]
                row["creator"] = handle["creator"]
    for row in rows.values():
        row["holders"].sort()
    return sorted(rows.values(), key=lambda r: tuple(int(p) for p in r["id"].split(":")))
