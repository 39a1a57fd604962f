"""``nbrpc.stacks()`` / ``%rpc_stacks``: what every thread of the cluster is doing now.

A worker's stacks are read on its host without its GIL and without its RPC threads
(:mod:`nbrpc._wire.stacks`: a thread of its own asked through a pipe, or a signal and
faulthandler where a thread holds the GIL in C), by the engine source that
started it (this host: a signal from here; ``--hosts``: one ssh per host over the
cluster's open connection), all workers at once; so a worker whose every RPC thread is
busy, or whose thread holds the GIL in a long C++ call, answers like an idle one. The
kernel's own threads are read with ``sys._current_frames()``. Each thread is labelled
with the call it serves and the call's caller, as the callee wrote them when the call
began. Workers of an attached cluster (hosts nbrpc has no way into) are asked by RPC.
"""

from __future__ import annotations

import os
import time
from typing import Any

from nbrpc._calls import facade as calls
from nbrpc._engines import EngineSource
from nbrpc._errors import NbrpcError, UnknownWorkerError
from nbrpc._rows import StackRow, ThreadStack, WorkerRecord, WorkerState
from nbrpc._wire import stack_dumps, stacks as _dumps

TIMEOUT_S = 2.0


def of_processes(
    processes: list[WorkerRecord], source: EngineSource, *names: str, timeout: float = TIMEOUT_S
) -> list[StackRow]:
    """The Python stack of every thread of each process (``processes``, the kernel's
    first: the cluster's records, which ``source`` started; or ``names`` only), labelled
    with the call each thread serves and its caller. ``nbrpc.stacks()`` passes the
    current cluster's (:meth:`nbrpc.Cluster.stacks`).

    Read from outside each worker (see the module doc): it answers within ``timeout``
    seconds also when all its RPC threads are busy or a thread holds the GIL in C++, and
    the running code goes on undisturbed.
    """
    records = [r for r in processes if r.state != WorkerState.STOPPED]
    known = [r.name for r in records]
    wanted = [n for part in names for n in part.replace(",", " ").split() if n] or known
    for name in wanted:
        if name not in known:
            raise UnknownWorkerError(name, known)
    chosen = [r for r in records if r.name in wanted]
    workers = [r for r in chosen if r.engine_id is not None]
    started = time.monotonic()
    engine_ids = [r.engine_id for r in workers if r.engine_id is not None]
    dumps = source.dump_stacks(engine_ids, [r.pid for r in workers], timeout)
    rows: list[StackRow] = []
    for r in chosen:
        if r.engine_id is None:
            rows.append(_kernel_row(r.name, r.host))
            continue
        part = dumps.get(r.engine_id)
        if part is None:  # a source that cannot reach the host: by RPC
            left = max(0.2, timeout - (time.monotonic() - started))
            rows.append(_by_rpc(r.name, r.pid, r.host, left))
            continue
        rows.append(_row(r.name, r.pid, r.host, part.get("how", "signal"), part))
    return rows


def _row(name: str, pid: int, host: str, how: str, part: dict[str, Any]) -> StackRow:
    if "error" in part:
        return StackRow(name=name, pid=pid, host=host, how=how, threads=[], error=part["error"])
    labels = {int(k): v for k, v in part.get("labels", {}).items()}
    threads: list[ThreadStack] = []
    for t in stack_dumps.parse(part["dump"]):
        if t["current"] and not t["frames"]:
            continue  # the thread that took the signal, outside Python: not the program's
        threads.append(
            ThreadStack(
                thread=t["thread"],
                name=t["name"],
                current=t["current"],
                frames=t["frames"],
                serving=labels.get(t["thread"]),
            )
        )
    return StackRow(name=name, pid=pid, host=host, how=how, threads=threads, error=None)


def _kernel_row(name: str, host: str) -> StackRow:
    return _row(name, os.getpid(), host, "this process", here())


def here() -> dict[str, Any]:
    """This process's threads, as :func:`nbrpc._wire.stacks.collect` reports one."""
    return {"dump": _dumps.format_threads(), "labels": _dumps.own_labels()}


def _by_rpc(name: str, pid: int, host: str, timeout: float) -> StackRow:
    try:
        part = calls.rpc_sync(name, here, timeout=timeout)
    except (NbrpcError, RuntimeError) as exc:
        return StackRow(
            name=name,
            pid=pid,
            host=host,
            how="rpc",
            threads=[],
            error=f"no answer by RPC ({type(exc).__name__}): its host is not nbrpc's to "
            "signal (an attached cluster), and every RPC thread may be busy",
        )
    return _row(name, pid, host, "rpc", part)
