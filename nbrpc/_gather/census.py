"""What the kernel asks of every process at once: is it there (a probe), its figures
(``%rpc_status``), its RRefs (``nbrpc.ownership()``), or anything else (:func:`ask_all`).

Each question goes to all processes at once and waits for them together, with a deadline:
a process that died, left, or did not answer in time is left out (unknown, not absent).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.rpc as rpc

from nbrpc import _group, _ledger, _process, _states
from nbrpc._calls import facade as calls
from nbrpc._errors import NbrpcError, RpcTimeoutError, UnknownWorkerError, WorkerDiedError
from nbrpc._rows import OwnershipRow, StatusRow, WorkerRecord, WorkerState
from nbrpc._wire import callee, side_door

SNAPSHOT_TIMEOUT_S = 5.0
ASIDE_AFTER_S = 0.5  # a process that answers no RPC by then is asked another way
PROBE_TIMEOUT_S = 3.0


def _pong() -> None:
    """What :func:`probe` asks of a worker: nothing but an answer."""


def probe(names: list[str], timeout: float = PROBE_TIMEOUT_S) -> None:
    """Ask ``names`` for an answer at once: a worker whose process is gone refuses the
    connection and is marked dead (``_states.unreachable``), a live one answers at once."""
    asked = []
    for name in names:
        with contextlib.suppress(NbrpcError):
            asked.append(calls.start_call("probe", name, _pong, (), None, timeout))
    for fut in asked:
        with contextlib.suppress(Exception):
            fut.wait()


def figures(dead: frozenset[str] = frozenset()) -> dict[str, Any]:
    """This process's ledger snapshot and the user calls it served (run in every process,
    asked by the kernel for ``%rpc_status`` and ``nbrpc.ownership()``); ``dead``: workers
    known dead, whose RRefs are not asked anything."""
    calls = callee.call_counts()
    found = {
        **_ledger.snapshot(dead),
        **_process.resources(),
        "name": _process.name(),
        "calls_in_flight": calls["in_flight"],
        "calls_done": calls["done"],
    }
    _busy.last = found
    return found


@dataclass
class _Busy:
    last: dict[str, Any] | None = None  # the last figures() here


_busy = _Busy()


def busy_figures(dead: frozenset[str] = frozenset()) -> dict[str, Any]:
    """:func:`figures` of a process whose RPC threads are busy (asked at its side door):
    the calls now, its CPU since the last reading (never sleeping), the rest as the last
    :func:`figures` found them. Nothing here lets go of the GIL: a thread that does (a
    read of ``/proc``, a call into torch) waits for it again behind the busy threads,
    up to seconds each time with 16 threads running Python (measured: 0.3 s, then 1.2,
    3.9 and over 4 s for the full figures while calls ramped up)."""
    calls = callee.call_counts()
    found = dict(_busy.last or {"handles": [], "owned": None, "memory_rss": None, "cuda": []})
    found["cpu_percent"] = _process.cpu_percent(sample=False)
    found.update(name=_process.name(), calls_in_flight=calls["in_flight"], calls_done=calls["done"])
    return found


#: ``aside(names, args, timeout)``: :func:`figures` asked of each process past its RPC
#: threads (the lifecycle's: side doors, engines), the answers by name
Aside = Callable[[list[str], tuple, float], dict]


def snapshots(
    timeout: float = SNAPSHOT_TIMEOUT_S,
    skip: set[str] | frozenset = frozenset(),
    aside: Aside | None = None,
) -> dict:
    """Every live process's ledger snapshot (see :mod:`nbrpc._ledger`), by process name.

    Asked of all processes at once. A process that does not answer within ``timeout``
    (or is in ``skip``, e.g. known dead) is left out: its RRefs are unknown, not absent.
    ``aside``: see :func:`ask_all`.
    """
    _group.require_active("nbrpc.ownership()")
    me = rpc.get_worker_info().name
    skip = frozenset({*skip, *_states.unreachable})
    others = [name for name in _group.member_names() if name != me and name not in skip]
    return {me: figures(skip), **ask_all(others, figures, (skip,), timeout, aside)}


side_door.answer("figures", busy_figures)


def ask_all(
    names: list[str],
    func: Callable[..., Any],
    args: tuple,
    timeout: float,
    aside: Aside | None = None,
) -> dict:
    """``func(*args)`` on every process of ``names`` at once: the answers by name. A
    process that died, left, or did not answer within ``timeout`` is left out.

    ``aside``: the processes that did not answer by RPC within :data:`ASIDE_AFTER_S`
    (every RPC thread busy with calls, or calls queued before this one) are asked that
    way too (``func`` is :func:`figures` then), for the rest of ``timeout``:
    ``%rpc_status`` of a busy cluster answers."""
    asked = {}
    for name in names:
        try:
            asked[name] = calls.start_call("ask", name, func, args, None, timeout)
        except (WorkerDiedError, UnknownWorkerError):  # it left since the list was read
            continue
    deadline = time.monotonic() + timeout
    if aside is not None:
        quick = time.monotonic() + min(ASIDE_AFTER_S, timeout)
        while time.monotonic() < quick and not all(f.done() for f in asked.values()):
            time.sleep(0.005)
        slow = [name for name, fut in asked.items() if not fut.done()]
        if slow:
            with contextlib.suppress(Exception):
                found = aside(slow, args, max(0.1, deadline - time.monotonic()))
                for name in found:
                    asked.pop(name, None)
                return {**_answers(asked), **found}
    return _answers(asked)


def _answers(asked: dict[str, Any]) -> dict:
    found = {}
    for name, fut in asked.items():
        try:
            found[name] = fut.wait()
        except (RpcTimeoutError, WorkerDiedError, RuntimeError):
            continue
    return found


def ownership(timeout: float = SNAPSHOT_TIMEOUT_S) -> list[OwnershipRow]:
    """One dict per live RRef in the cluster, whoever made it.

    Keys: ``id`` (torch's RRef id, ``"creator's torch id:n"``), ``owner``, ``holders``
    (processes holding a user reference), ``owner_holds``, ``type`` (of the value), ``created_by``
    (e.g. ``"remote(worker1, ParameterServer)"``) and ``handles`` (Python handles in all).
    An RRef dropped everywhere and garbage-collected is gone from the list. A process
    that does not answer within ``timeout`` seconds is left out (its RRefs are unknown,
    not absent). Raises :class:`~nbrpc.NotInitializedError` when no cluster runs.
    """
    return _ledger.merge(list(snapshots(timeout).values()))


def status_rows(
    records: list[WorkerRecord], snaps: dict[str, dict], device_maps: dict
) -> list[StatusRow]:
    """``nbrpc.status()``'s rows: each process's record with the figures it answered
    (``snaps``, by name; None where it is not ready or did not answer)."""
    rows: list[StatusRow] = []
    for r in records:
        snap = snaps.get(r.name) if r.state is WorkerState.READY else None
        rows.append(
            StatusRow(
                name=r.name,
                rank=r.order,
                torch_id=r.rank,
                pid=r.pid,
                host=r.host,
                role=r.role,
                devices=list(r.devices),
                engine_id=r.engine_id,
                state=r.state,
                calls_in_flight=snap["calls_in_flight"] if snap else None,
                calls_done=snap["calls_done"] if snap else None,
                rrefs_owned=snap["owned"] if snap else None,
                rrefs_held=len(snap["handles"]) if snap else None,
                cpu_percent=snap["cpu_percent"] if snap else None,
                memory_rss=snap["memory_rss"] if snap else None,
                cuda=snap["cuda"] if snap else None,
                device_maps=device_maps.get(r.name, {}),
            )
        )
    return rows
