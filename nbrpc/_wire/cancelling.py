"""Calls cancelled where they run: the stop button's reach beyond the kernel.

torch has no cancellation. nbrpc gives every user call an *origin*, in its header
(:mod:`nbrpc._wire.recording`): a number unique in the cluster, the caller's random prefix
above a count. A call made inside a call, on the thread serving it, has the origin of the
call it serves, however deep the chain goes; any other call has a new one. The main
thread's (a notebook's cells, a script's) count up in their own range, so the calls of
one cell are the origins from its first call to its last (:func:`cell_origins`; the kernel
starts a new range as each cell starts, and after each cancel). Calls from other threads
(a ``.then`` callback, a thread the user started) count elsewhere: the stop button
leaves them alone, ``nbrpc.cancel(fut)`` reaches them one by one.

Cancelling a range of origins (:func:`cancel`, run on every process of the cluster by the kernel,
on each worker's engine thread, which the busy RPC threads do not hold) does two things:

* every thread serving a call of that origin gets ``KeyboardInterrupt`` raised in it, once,
  asynchronously (``PyThreadState_SetAsyncExc``: Python delivers it at the thread's next
  bytecode; a thread inside one long C call, ``time.sleep`` or a C loop, stops when it
  returns to Python). A thread waiting in torch's C++ wait on a call it made to another
  worker stops when that call, cancelled there too, answers;
* the origin is remembered: a call of it that starts later (queued behind busy threads,
  or still on its way) fails at once, unrun.

The race ``%%rpc`` cells guard against is guarded here the same way: the interrupt is set
only while the thread is registered as running that call, under the lock that
:func:`leave` takes to unregister it and to clear an interrupt set but not yet delivered.
So an interrupt never fires after the function returned, inside the reply's pickling
(which torch runs in C++ right after), and a call that finished keeps its result.

Nor does it fire inside a send (:func:`sends_held`, around each of torch's): torch counts
an RRef's fork as it pickles the RRef into a message (the owner's fork, or the sender's
pending child that the receiver confirms). An interrupt after that pickling and before
torch handed the message over left a fork no message carries, and every later shutdown
waited its whole bound on it, saying so in red ("Timed out waiting for pending UserRRefs
to be confirmed", "... OwnerRRefs to be deleted": the RL tutorial's ``%rpc_shutdown``
after the stop button, 2 runs in 4). A cancel that finds the thread sending raises its
interrupt as the send ends.

The cancelled call fails with :class:`~nbrpc.CallCancelledError`, which its caller
raises: ``fut.wait()`` of a future the cell never waited on, ``to_here()`` of an RRef
whose creation was cancelled.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _fork, _process

from . import side_door

#: origins are this process's prefix (random: unique in a cluster, for all practical
#: purposes) above a counter: the main thread's calls count up from 1, other threads'
#: from :data:`_OTHERS`
_OTHERS = 1 << 32


def _new_prefix() -> int:
    return (random.getrandbits(30) | 1) << 33


#: origins cancelled here, remembered for calls of theirs that start later: cells' ranges
#: (looked through at each call's start) and single calls' origins
_REMEMBERED = 64
_REMEMBERED_SINGLE = 8192
EVERY = (1 << 64) - 1  # cancel(0, EVERY): every call of every origin (a shutdown's)
GRACE_S = 0.5  # how long cancel() waits for the interrupted calls to end


@dataclass
class Running:
    """A call of a cancellable origin, running on ``thread``."""

    origin: int
    name: str
    caller: str
    thread: int
    outer: int | None  # the origin this thread's nested calls had before this call
    interrupted: bool = False
    waiter: _Waiter | None = None  # the cancel waiting for it to end
    ended: bool = False  # the waiter was told
    #: the call returned and its end waits for its output to reach the caller: a cancel
    #: calls this (what was not sent is dropped) instead of interrupting
    draining: Any = None


class _Waiter:
    """A cancel waiting for the calls it interrupted to end: one wake-up when the last
    ends (a poll would take the GIL from the busy threads, and wait for it, every time)."""

    def __init__(self, count: int) -> None:
        self.count, self.done = count, threading.Event()

    def ended(self) -> None:  # under _here.lock
        self.count -= 1
        if self.count <= 0:
            self.done.set()


@dataclass
class _Here:
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: dict[int, Running] = field(default_factory=dict)  # id(entry) -> entry
    cancelled: list[tuple[int, int]] = field(default_factory=list)  # (lo, hi), newest last
    single: dict[int, None] = field(default_factory=dict)  # single origins, oldest first
    main: int = 0  # the main thread's last origin (counter part)
    cell_first: int = 1  # the first origin of the main thread's current cell
    others: Any = field(default_factory=lambda: itertools.count(_OTHERS + 1))
    prefix: int = field(default_factory=_new_prefix)
    main_thread: int | None = threading.main_thread().ident
    sending: set[int] = field(default_factory=set)  # threads inside a send (sends_held)
    owed: set[int] = field(default_factory=set)  # of those, the ones a cancel interrupts


class _Thread(threading.local):
    """``origin``: of the call this thread serves; ``last``: of its last call (class
    defaults: a missing attribute costs an exception inside ``getattr``)."""

    origin: int | None = None
    last: int | None = None


def _after_fork() -> None:
    _here.prefix = _new_prefix()
    _here.main_thread = threading.main_thread().ident  # the thread that forked
    _here.sending.clear()  # the parent's threads: not this process's
    _here.owed.clear()


_here = _Here()
# a worker is a fork of a zygote that imported this: each process draws its own prefix
# (run after threading's own handler, which makes the forking thread the main thread)
_fork.in_child(_after_fork)
_thread = _Thread()


def origin_here() -> int | None:
    """The origin of a call made on this thread now: the served call's (a nested call),
    a new one per call otherwise (the main thread's count within its cell)."""
    origin = _thread.origin
    if origin is None:
        if threading.get_ident() == _here.main_thread:
            _here.main += 1
            origin = _here.prefix | _here.main
        else:
            origin = _here.prefix | next(_here.others)
    _thread.last = origin
    return origin


def forget_last() -> None:
    """A call is about to be sent: :func:`last_origin` is its, or None if it has none."""
    _thread.last = None


def last_origin() -> int | None:
    """The origin of the last call this thread made (read right after it was sent)."""
    return _thread.last


def next_cell() -> None:
    """The main thread's calls from now on are a new cell's (or come after a cancel:
    they are not its)."""
    _here.cell_first = _here.main + 1


def cell_origins() -> tuple[int, int] | None:
    """The origins of the main thread's calls in its current cell (None: it made none)."""
    if _here.main < _here.cell_first:
        return None
    return _here.prefix | _here.cell_first, _here.prefix | _here.main


class Cancelled(Exception):
    """Raised in place of running a call of an origin cancelled before it started."""


def running(origin: int, name: str, caller: str) -> Running:
    """A call of ``origin`` about to run on this thread (registered by :func:`enter`)."""
    return Running(origin, name, caller, threading.get_ident(), _thread.origin)


def enter(entry: Running) -> None:
    """This thread starts serving ``entry``'s call; its nested calls carry its origin.
    Raises :class:`Cancelled` if the origin was cancelled already. Called inside the
    ``try`` whose ``finally`` calls :func:`leave`: an interrupt may fire as this returns."""
    origin = entry.origin
    with _here.lock:
        if origin in _here.single:
            raise Cancelled(entry.name)
        for lo, hi in _here.cancelled:
            if lo <= origin <= hi:
                raise Cancelled(entry.name)
        _here.running[id(entry)] = entry
    _thread.origin = origin


def leave(entry: Running, draining: Any = None) -> None:
    """The call ended (idempotent: called again where an interrupt fired inside the first
    call): no interrupt for it may fire from now on, and a cancel waiting for it is told.

    ``draining``: the call returned, but its end still waits for its output to reach the
    caller (a flood's lines, seconds of them): until :func:`drained`, a cancel of its
    origin calls ``draining()``, which drops what was not sent, and counts the call as
    stopped. Before, the stop button pressed then found nothing running, and the lines
    went on reaching the next cells (the soak, docs/soak.md)."""
    _thread.origin = entry.outer
    with _here.lock:
        if entry.interrupted:  # set, maybe not delivered yet: never after this
            _set_async_exc(entry.thread, None)
            _here.owed.discard(entry.thread)
        if draining is not None and not entry.interrupted:
            entry.draining = draining  # it stays listed, for a cancel to reach its output
        elif entry.draining is None:
            _here.running.pop(id(entry), None)
        if entry.waiter is not None and not entry.ended:
            entry.ended = True
            entry.waiter.ended()


def drained(entry: Running) -> None:
    """The call's end is over, its output sent or dropped (see :func:`leave`)."""
    with _here.lock:
        entry.draining = None
        _here.running.pop(id(entry), None)


@contextlib.contextmanager
def sends_held() -> Iterator[None]:
    """A send on this thread, from its pickling to torch's hand-over: the stop button's
    interrupt waits for its end (the module's docstring says why). Both of them: the
    main thread's SIGINT (:func:`nbrpc._process.interrupts_deferred`) and a cancel's,
    raised in this thread as the send ends. Nested sends hold once."""
    me = threading.get_ident()
    if me in _here.sending:  # (only this thread adds or removes itself)
        yield
        return
    with _here.lock:
        _here.sending.add(me)
    try:
        with _process.interrupts_deferred():
            yield
    finally:
        with _here.lock:
            _here.sending.discard(me)
            if me in _here.owed:  # the call is still running (leave() clears it)
                _here.owed.discard(me)
                _set_async_exc(me, KeyboardInterrupt)


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


#: origins as ``(lo, hi)`` ranges, both ends included
Ranges = list[tuple[int, int]]
#: every call of every origin (a shutdown's cancel)
EVERYTHING: Ranges = [(0, EVERY)]


def cancel(ranges: Ranges, grace: float = GRACE_S, ask: bool = False) -> list[dict[str, Any]]:
    """Cancel the calls of the origins in ``ranges`` in this process (see the module's
    docstring) and wait up to ``grace`` seconds for the running ones to end; ``ask``:
    cancel nothing, list those still running. One row per call that was running:
    ``name``, ``caller``, ``thread``, ``pid``, ``stopped`` (it ended within ``grace``),
    ``sending`` (it has not, and is inside a send, which the interrupt waits for)."""
    drops = []
    with _here.lock:
        hit = [e for e in _here.running.values() if any(lo <= e.origin <= hi for lo, hi in ranges)]
        if not ask:
            _remember(ranges)
        waiter = _Waiter(len(hit))
        for entry in hit:
            if entry.draining is not None:  # returned: its output's rest is dropped
                if not ask:
                    drops.append(entry.draining)
                waiter.count -= 1
                continue
            if not ask and not entry.interrupted:
                entry.interrupted = True
                if entry.thread in _here.sending:  # raised as its send ends
                    _here.owed.add(entry.thread)
                else:
                    _set_async_exc(entry.thread, KeyboardInterrupt)
            if entry.interrupted and entry.waiter is None:
                entry.waiter = waiter
            else:  # asked only, or another cancel waits for it already: not waited for here
                waiter.count -= 1
    for drop in drops:  # (outside the lock: it takes the output's)
        drop()
    if hit and waiter.count > 0 and grace > 0:
        waiter.done.wait(grace)
    left = set(_still([id(e) for e in hit if e.draining is None]))
    with _here.lock:
        sending = set(_here.sending)
    return [
        {
            "name": e.name,
            "caller": e.caller,
            "thread": e.thread,
            "pid": os.getpid(),
            "stopped": id(e) not in left,
            "sending": id(e) in left and e.thread in sending,  # the stop waits for its send
        }
        for e in hit
    ]


def forget_cancelled() -> None:
    """This process joins a cluster: what an earlier one cancelled (a shutdown cancels
    everything) no longer applies (an attached engine serves cluster after cluster)."""
    with _here.lock:
        _here.cancelled.clear()
        _here.single.clear()


def _remember(ranges: Ranges) -> None:
    """Keep ``ranges`` for calls of theirs that start later (under the lock): single
    origins (``nbrpc.cancel(fut)``) in a set, a cell's ranges in a short list."""
    for lo, hi in ranges:
        if lo == hi:
            _here.single[lo] = None
        else:
            _here.cancelled.append((lo, hi))
    del _here.cancelled[:-_REMEMBERED]
    while len(_here.single) > _REMEMBERED_SINGLE:
        del _here.single[next(iter(_here.single))]


def _still(keys: list[int]) -> list[int]:
    with _here.lock:
        return [k for k in keys if k in _here.running]


# -- the caller's side: the stop button seen in one of nbrpc's waits -----------------------


@dataclass
class _Stop:
    handler: Any = None  # set by nbrpc._calls.cancel: cancel the main thread's calls


_stop = _Stop()


def on_stop(handler: Any) -> None:
    """``handler()`` runs when the stop button (``KeyboardInterrupt``) ends one of nbrpc's
    waits on the main thread (:func:`stopped`)."""
    _stop.handler = handler


def stopped() -> None:
    """The main thread's wait ended with ``KeyboardInterrupt``: its calls are cancelled."""
    if _stop.handler is not None:
        _stop.handler()


side_door.answer("cancel", cancel)
