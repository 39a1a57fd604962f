"""Calls made inside calls that use up the RPC threads: noticed, and ended with the reason.

A call made from inside a call (``ping`` on worker1 calling ``ping`` on worker2, and so
on) holds its RPC thread until the answer comes. When every RPC thread of the workers
involved waits that way and more requests wait for a thread, none can ever finish: torch
says nothing, the calls wait out their timeouts (a 40-deep ping-pong between two workers
jammed both for a minute here), and the error only says "timed out".

nbrpc notices it instead, without guessing from time alone:

* **Each worker** knows which of its RPC threads wait on a call they made, and to whom
  (:func:`waiting`, around the wait of every nbrpc call made from a thread serving a
  call). While some do, a monitor thread reads torch's figures every :data:`POLL_S`: when
  no RPC thread is idle and every one waits on a nested call, the worker is *stuck*, and
  after :data:`STUCK_S` it tells the kernel so, with the workers its threads wait on.
* **Each stuck worker** then writes that (and the workers it waits on) in the group's own
  store, and reads the others': a deadlock is certain when every stuck worker waits on
  stuck workers alone. Then every thread of those workers waits on a call to one of them,
  so the innermost call of each chain is queued for a thread that never frees: none can
  ever finish (measured: worker1 had 1 request queued, worker2 none, both with 16 of 16
  threads waiting). The store, not an RPC, because a stuck worker cannot even read an
  answer: torch completes a call's response on the same exhausted thread pool. Each
  stuck worker then fails the calls its threads wait on with
  :class:`~nbrpc.ThreadsExhaustedError`, whose message names the workers, the pool and
  the fixes. The error travels back up the chain like any exception, every thread is
  freed, and the cluster answers again at once.

A worker whose threads wait on a worker that still computes is not stuck in this sense:
nothing is failed while any worker on the chain can still make progress.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _process, _torch
from nbrpc._errors import ThreadsExhaustedError

POLL_S = 0.25  # how often a worker with nested waits reads its pool's figures
STUCK_S = 1.0  # how long a worker must be stuck before it says so (a passing peak is not)
#: a stuck worker's word in the store is current for this long (it renews it every POLL_S
#: and clears it once free; the margin covers clocks of other hosts)
FRESH_S = 10.0
KEY_PREFIX = "nbrpc-stuck/"


@dataclass
class _Waits:
    """This worker's nested waits (thread id -> (callee, the call's future)), and its
    monitor thread, started at the first nested wait and idle while there is none."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    by_thread: dict[int, tuple[str, Any]] = field(default_factory=dict)
    monitor: threading.Thread | None = None


_waits = _Waits()


@contextmanager
def waiting(dest: str, future: Any) -> Iterator[None]:
    """This thread, serving a call, now waits on ``future``, a call it made to ``dest``."""
    ident = threading.get_ident()
    with _waits.cond:
        _waits.by_thread[ident] = (dest, future)
        if _waits.monitor is None:
            _waits.monitor = threading.Thread(target=_watch, name="nbrpc-deadlock", daemon=True)
            _waits.monitor.start()
        _waits.cond.notify()
    try:
        yield
    finally:
        with _waits.cond:
            _waits.by_thread.pop(ident, None)


def _stuck() -> tuple[int, int, list[str]] | None:
    """``(pool size, requests queued, workers waited on)`` when every RPC thread of this
    process waits on a call it made (none can make progress by itself), else None."""
    metrics = _torch.agent().get_metrics()
    pool = int(metrics.get("agent.thread_pool_size", 0))
    idle = int(metrics.get("agent.num_idle_threads", 0))
    queued = int(metrics.get("agent.server_active_calls", 0)) - (pool - idle)
    with _waits.cond:
        waits = list(_waits.by_thread.values())
    if pool == 0 or idle > 0 or len(waits) < pool:
        return None
    return pool, max(queued, 0), sorted({dest for dest, _ in waits})


def _watch() -> None:
    since: float | None = None
    published = False
    while True:
        with _waits.cond:
            while not _waits.by_thread:
                if published:
                    published = _publish(None)
                since = None
                _waits.cond.wait()
        try:
            stuck = _stuck()
            now = time.monotonic()
            since = None if stuck is None else since or now
            if stuck is not None and since is not None and now - since >= STUCK_S:
                published = _publish(stuck)
                verdict = _verdict()
                if verdict:
                    _fail_waits(verdict)
            elif published:
                published = _publish(None)
        except Exception:  # the agent or its store is gone (shutdown): nothing to watch
            pass
        time.sleep(POLL_S)


def _key(name: str) -> str:
    return f"{KEY_PREFIX}{name}"


def _publish(stuck: tuple[int, int, list[str]] | None) -> bool:
    """Say in the group's store whether this worker is stuck (and on whom); returns it."""
    store = _torch.agent().store
    if stuck is None:
        store.set(_key(_process.name()), "")
        return False
    pool, queued, targets = stuck
    store.set(_key(_process.name()), json.dumps([time.time(), pool, queued, targets]))
    return True


def _verdict() -> str:
    """Why the calls deadlock, when every stuck worker of the group waits on stuck
    workers alone (read from the store: no RPC thread is free to ask); "" otherwise."""
    store = _torch.agent().store
    now = time.time()
    stuck: dict[str, tuple[int, int, list[str]]] = {}
    for info in _torch.agent().get_worker_infos():
        key = _key(info.name)
        if not store.check([key]):
            continue
        raw = store.get(key).decode()
        if raw:
            when, pool, queued, targets = json.loads(raw)
            if now - when <= FRESH_S:
                stuck[info.name] = (pool, queued, targets)
    if not stuck or any(t not in stuck for _, _, targets in stuck.values() for t in targets):
        return ""  # someone on the chain can still make progress
    ring = sorted(stuck)
    pools = ", ".join(f"{w} {stuck[w][0]}" for w in ring)
    return (
        f"the RPC threads of {', '.join(ring)} ({pools} threads) all wait on calls they made "
        f"to {' and '.join(ring) if len(ring) > 1 else 'itself'}, and more calls wait for a "
        "free thread: none can ever finish. A call made inside a call holds its thread "
        "until the answer comes, so calls nested deeper than the pool deadlock. Start the "
        "cluster with more threads (%rpc_init --threads N, num_worker_threads=N), or let "
        "the function wait without a thread: decorate it @rpc.functions.async_execution "
        "and return nbrpc.rpc_async(...) (a torch.futures.Future) instead of waiting"
    )


def _fail_waits(why: str) -> None:
    """Fail every call this worker's threads wait on: each thread raises, unwinding."""
    with _waits.cond:
        waits = list(_waits.by_thread.values())
    for _, future in waits:
        if not future.done():
            with contextlib.suppress(RuntimeError):  # it finished meanwhile
                future.set_exception(ThreadsExhaustedError(why))
