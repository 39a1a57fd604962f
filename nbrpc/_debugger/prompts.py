"""The kernel side of the debugger: a worker's prompts, answered on the main thread.

Prompts arrive on torch's RPC threads, but input can only be read on the main thread:
ipykernel ties an input request to the cell being run, and a terminal belongs to the main
thread. The main thread waits for nbrpc calls in short slices (:func:`wait_on_main_thread`);
a prompt wakes it and :func:`serve` runs ``input(prompt)`` there. One session at a time: a
second worker's breakpoint waits until the first session continues or quits, and each
session opens with a line naming its worker. The stop button (KeyboardInterrupt in
``input``) quits the open session and the waiting ones, then interrupts the cell. While a
session is open, the clock of nbrpc's call timeouts stands still (:mod:`.deadlines`).

**No input channel, no hang.** nbval and nbclient (``make demo``) run cells without an
input box, and a script's stdin may not be a terminal: the worker is told so at its first
prompt, prints a warning line and runs on. The same happens when the kernel's main thread
does not wait on an nbrpc call for :data:`GRACE_S` (it sleeps, computes, or blocks in a
plain torch call). ``PYTHONBREAKPOINT=0`` (the worker's or the kernel's) skips silently.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _states, _torch
from nbrpc._errors import show_short
from nbrpc._process import shell as ipython_shell
from nbrpc._wire import cancelling, failures

from . import deadlines

GRACE_S = 2.0  # how long a prompt waits for the kernel's main thread to wait on a call
SIGNAL_CHECK_S = 0.1  # how often a waiting main thread lets Python run signal handlers


@dataclass
class _Prompt:
    worker: str
    session: str
    text: str
    prompt: str
    title: str
    asked: float = field(default_factory=time.monotonic)
    taken: bool = False
    answer: tuple[str, str | None] | None = None


@dataclass
class _Desk:
    """Prompts waiting for the main thread, the session being served, and the main
    thread's waits (at most one) with when the last one ended."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    queue: list[_Prompt] = field(default_factory=list)
    session: str | None = None  # the open session, and its worker
    worker: str | None = None
    waiters: set[threading.Event] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)


_desk = _Desk()


def no_input_reason() -> str | None:
    """Why nobody can type a debugger command here (None: someone can; "": turned off)."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return ""
    shell = ipython_shell()
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        # ipykernel's own switch for input requests, set per cell by the frontend
        if not getattr(kernel, "_allow_stdin", True):
            return (
                "this notebook runs without an input box (nbval, nbclient or another "
                "headless runner), so no debugger command can be typed; execution goes on"
            )
        return None
    if shell is not None:
        return None  # terminal IPython
    stdin = sys.stdin
    try:
        tty = stdin is not None and stdin.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return "this script's stdin is not a terminal, so no debugger command can be typed"
    return None


def kernel_prompt(worker: str, session: str, text: str, prompt: str, title: str) -> tuple:
    """Run by RPC in the kernel: show pdb's ``text`` and ``prompt``; the line typed.

    Returns ``("line", text or None for EOF)``, ``("quit", why)`` or ``("skip", why)``.
    """
    reason = no_input_reason()
    if reason is not None:
        return ("skip", reason)
    request = _Prompt(worker, session, text, prompt, title)
    with _desk.cond:
        _desk.queue.append(request)
        for woke in _desk.waiters:
            woke.set()
        while request.answer is None:
            if not request.taken and not _desk.waiters and _desk.session != session:
                idle = time.monotonic() - max(_desk.idle_since, request.asked)
                if idle > GRACE_S:
                    _desk.queue.remove(request)
                    return (
                        "skip",
                        "the kernel is not waiting on an nbrpc call (pdb opens while "
                        "nbrpc.rpc_sync, a future's wait() or to_here() waits in the calling "
                        "cell)",
                    )
            _desk.cond.wait(0.25)
    return request.answer


def kernel_end(worker: str, session: str, text: str) -> None:
    """Run by RPC in the kernel: a worker's session ended; the next may be served."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
    _end(session)


def kernel_sources(filenames: list[str]) -> dict[str, str]:
    """Run by RPC in the kernel: the source of notebook cells, from its ``linecache``."""
    found = {}
    for fn in filenames:
        lines = linecache.getlines(fn)
        if lines:
            found[fn] = "".join(lines)
    return found


def _end(session: str) -> None:
    with _desk.cond:
        if _desk.session != session:
            return
        _desk.session = _desk.worker = None
        for woke in _desk.waiters:
            woke.set()
        _desk.cond.notify_all()
    deadlines.clock.resume()


@contextlib.contextmanager
def main_thread_waits(woke: threading.Event) -> Any:
    """The main thread waits on a call: prompts set ``woke``; it then calls :func:`serve`."""
    with _desk.cond:
        _desk.waiters.add(woke)
        if _desk.queue:
            woke.set()
    try:
        yield
    finally:
        with _desk.cond:
            _desk.waiters.discard(woke)
            _desk.idle_since = time.monotonic()


def _next_prompt() -> tuple[_Prompt | None, bool]:
    with _desk.cond:
        current = _desk.session
        for request in _desk.queue:
            if current is None or request.session == current:
                _desk.queue.remove(request)
                request.taken = True
                if current is None:
                    _desk.session, _desk.worker = request.session, request.worker
                    return request, True
                return request, False
    return None, False


def _answer(request: _Prompt, answer: tuple) -> None:
    with _desk.cond:
        request.answer = answer
        _desk.cond.notify_all()


def serve() -> None:
    """On the main thread: read the commands the waiting prompts ask for, one session at
    a time. The stop button quits every session waiting here, then interrupts."""
    while True:
        request, opening = _next_prompt()
        if request is None:
            return
        if opening:
            deadlines.clock.pause()
            title = request.title or request.worker
            sys.stdout.write(f"--- pdb: {title} ---\n")
        if request.text:
            sys.stdout.write(request.text)
        sys.stdout.flush()
        try:
            line = input(request.prompt)
        except EOFError:
            _answer(request, ("line", None))
        except KeyboardInterrupt:
            _answer(request, ("quit", "the stop button"))
            _answer_waiting(("quit", "the stop button"))  # the other waiting ones too
            raise
        except Exception as exc:  # e.g. IPython's StdinNotImplementedError
            _answer(request, ("skip", f"input() failed here ({type(exc).__name__}: {exc})"))
            _end(request.session)
        else:
            _answer(request, ("line", line))


def _answer_waiting(answer: tuple, worker: str | None = None) -> None:
    """Answer every waiting prompt (of ``worker`` only, if given) with ``answer`` and end
    the open session (if it is ``worker``'s): the stop button, a death, a shutdown."""
    with _desk.cond:
        for request in [r for r in _desk.queue if worker is None or r.worker == worker]:
            _desk.queue.remove(request)
            request.answer = answer
        ours = worker is None or _desk.worker == worker
        session = _desk.session if ours else None
        _desk.cond.notify_all()
    if session:
        _end(session)


def forget_worker(name: str) -> None:
    """A worker died: its prompts are dropped and its open session ends."""
    _answer_waiting(("skip", ""), name)


def on_worker_change(change: _states.WorkerChange) -> None:
    """A listener of :mod:`nbrpc._states` (registered by the lifecycle): a worker that
    died is forgotten (:func:`forget_worker`)."""
    if change.kind is _states.Change.DIED:
        for name in change.names:
            forget_worker(name)


def reset(why: str = "the cluster is shutting down") -> None:
    """Shutdown: waiting prompts are answered (the workers run on), sessions end."""
    _answer_waiting(("skip", why))
    failures.forget_failures()


def wait_on_main_thread(fut: Any, limit: float = 0) -> bool:
    """Wait for ``fut`` on the main thread; False if ``limit`` seconds passed first.

    The wait is in slices of :data:`SIGNAL_CHECK_S`: the kernel's SIGINT may land on any
    of its threads, and then only the main thread's next bytecode runs Python's handler
    (found by a full test run: with the signal on another thread, an untimed wait slept
    through it). A worker's debugger prompt wakes it at once, and it is served here, in
    the waiting cell. ``limit`` (0: none) is measured on :data:`deadlines.clock`, which
    stands still while a debugger session is open.
    """
    woke = threading.Event()
    _torch.on_done(fut, lambda _: woke.set())

    def one_slice() -> bool:
        if not fut.done():
            woke.wait(SIGNAL_CHECK_S)
            woke.clear()
        return fut.done()

    return _wait(one_slice, woke, _deadline(limit))


def wait_in_slices_on_main_thread(one_slice: Any, limit: float = 0) -> bool:
    """:func:`wait_on_main_thread` for a wait that ``one_slice()`` makes in slices of
    :data:`SIGNAL_CHECK_S` (it returns whether the wait is over: a lane's read, which
    times out after a slice, :mod:`nbrpc._wire.lanes`); a prompt is served within a
    slice of it arriving. The first slice is waited on its own, before the prompts are
    looked at (a small call's answer comes within it), unless ``limit`` is shorter than
    two slices; it counts against ``limit`` as every other slice does."""
    deadline = _deadline(limit)
    if not 0 < limit < 2 * SIGNAL_CHECK_S:
        try:
            if one_slice():
                return True
        except KeyboardInterrupt as stop:
            _stopped(stop)
            raise
    return _wait(one_slice, threading.Event(), deadline)


def _deadline(limit: float) -> float | None:
    """When a wait of ``limit`` seconds (0: none) ends, on :data:`deadlines.clock`: the
    one clock of every call's timeout (a sync call's here, an async call's in
    :mod:`.deadlines`), which stands still while a debugger session is open."""
    return deadlines.clock.now() + limit if limit > 0 else None


def _wait(one_slice: Any, woke: threading.Event, deadline: float | None) -> bool:
    try:
        with main_thread_waits(woke):
            while not one_slice():
                serve()
                if deadline is not None and deadlines.clock.now() >= deadline:
                    return False
    except KeyboardInterrupt as stop:
        _stopped(stop)
        raise
    return True


def _stopped(stop: KeyboardInterrupt) -> None:
    """The stop button ended a main thread's wait: the cell's lines, not nbrpc's waits,
    and the cell's calls are cancelled where they run."""
    show_short(stop)
    cancelling.stopped()
