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
  the fixes. The first to find it writes it for the others too: its own threads
  unwind and free it before they may read its word, and they must not stay jammed
  (:class:`Watch`). The error travels back up the chain like any exception, every
  thread is freed, and the cluster answers again at once.

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
VERDICT_PREFIX = "nbrpc-deadlocked/"  # a stuck worker told by another that it deadlocks


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
    watch: Watch | None = None
    of: Any = None  # the agent ``watch`` is of (a new group, a new watch)
    while True:
        with _waits.cond:
            idle = not _waits.by_thread
        if idle:
            if watch is not None:  # outside the lock: a slow store holds up no nested call
                with contextlib.suppress(Exception):  # the agent or its store is gone
                    watch.step(None, time.monotonic())
            with _waits.cond:
                while not _waits.by_thread:
                    _waits.cond.wait()
        try:
            agent = _torch.agent()
            if watch is None or of is not agent:
                watch, of = Watch(agent.store, _process.name()), agent
            why = watch.step(_stuck(), time.monotonic(), agent.get_worker_infos)
            if why:
                _fail_waits(why)
        except Exception:  # the agent or its store is gone (shutdown): nothing to watch
            pass
        time.sleep(POLL_S)


def _key(name: str) -> str:
    return f"{KEY_PREFIX}{name}"


def _verdict_key(name: str) -> str:
    return f"{VERDICT_PREFIX}{name}"


@dataclass
class Watch:
    """One worker's side of the watch, a poll at a time (:meth:`step`), over the group's
    store.

    The worker that first finds the deadlock certain fails its own waits and tells the
    other stuck workers so, in the store: its threads unwinding free it, and it clears
    its word, while theirs still wait. A worker told that it deadlocks fails its waits
    at its next poll if it is still stuck, whether or not the teller still is (without
    it, a teller that freed itself and cleared its word before the other read it left
    that one jammed, unseen: the order of two workers' polls decided it).

    A verdict names the *episode* it was found in (when the worker's stuck spell began,
    written with its word): one that arrives after the worker was freed is of an
    episode that ended, and a later jam, deadlocked or not, is never failed by it.
    """

    store: Any
    me: str
    since: float | None = None  # stuck since (monotonic), None while not stuck
    episode: str = ""  # this stuck spell's name (its wall-clock start), "" while not stuck
    published: bool = False

    def step(
        self, stuck: tuple[int, int, list[str]] | None, now: float, members: Any = None
    ) -> str:
        """Publish this poll's state; why this worker's waits must fail now, or ""."""
        if stuck is None:
            self.since, self.episode = None, ""
            if self.published:
                self.store.set(_verdict_key(self.me), "")
                self.published = _publish(self.store, self.me, None, "")
            return ""
        if self.since is None:
            self.since, self.episode = now, f"{time.time():.6f}"
        if now - self.since < STUCK_S:
            return ""
        self.published = _publish(self.store, self.me, stuck, self.episode)
        names = [info.name for info in members()] if members is not None else []
        why, ring = _verdict(self.store, names)
        if not why:
            why = _told(self.store, self.me, self.episode)
        else:
            for other, episode in ring.items():
                if other != self.me:
                    self.store.set(_verdict_key(other), json.dumps([time.time(), why, episode]))
        if why:  # its waits fail now: a jam seen after this is a new spell
            self.since, self.episode = None, ""
        return why


def _publish(store: Any, me: str, stuck: tuple[int, int, list[str]] | None, episode: str) -> bool:
    """Say in the group's store whether this worker is stuck (and on whom); returns it."""
    if stuck is None:
        store.set(_key(me), "")
        return False
    pool, queued, targets = stuck
    store.set(_key(me), json.dumps([time.time(), pool, queued, targets, episode]))
    return True


def _fresh(store: Any, key: str) -> list | None:
    """The value at ``key`` when one was written there less than FRESH_S ago."""
    if not store.check([key]):
        return None
    raw = store.get(key).decode()
    if not raw:
        return None
    value = json.loads(raw)
    return value if time.time() - value[0] <= FRESH_S else None


def _told(store: Any, me: str, episode: str) -> str:
    """Why this worker deadlocks, when another stuck worker found it in this episode."""
    told = _fresh(store, _verdict_key(me))
    if told is None:
        return ""
    store.set(_verdict_key(me), "")  # used up, or of an episode that ended
    return told[1] if told[2] == episode else ""


def _verdict(store: Any, names: list[str]) -> tuple[str, dict[str, str]]:
    """Why the calls deadlock, and the stuck workers (each with its episode), when every
    stuck worker of the group waits on stuck workers alone (read from the store: no RPC
    thread is free to ask); ``("", {})`` otherwise."""
    stuck: dict[str, tuple[int, int, list[str]]] = {}
    episodes: dict[str, str] = {}
    for name in names:
        value = _fresh(store, _key(name))
        if value is not None:
            _, pool, queued, targets, episodes[name] = value
            stuck[name] = (pool, queued, targets)
    if not stuck or any(t not in stuck for _, _, targets in stuck.values() for t in targets):
        return "", {}  # someone on the chain can still make progress
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
    ), {name: episodes[name] for name in ring}


def _fail_waits(why: str) -> None:
    """Fail every call this worker's threads wait on: each thread raises, unwinding."""
    with _waits.cond:
        waits = list(_waits.by_thread.values())
    for _, future in waits:
        if not future.done():
            with contextlib.suppress(RuntimeError):  # it finished meanwhile
                future.set_exception(ThreadsExhaustedError(why))
