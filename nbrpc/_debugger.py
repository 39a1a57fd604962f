"""pdb for code running on a worker, typed into the cell that called it.

**Worker side.** ``breakpoint()`` and ``pdb.set_trace()`` inside an RPC call open a
:class:`RemotePdb`: Python's own pdb, whose stdin and stdout are the kernel. Each time pdb
wants a command, what it printed and its prompt (``(Pdb worker1)``) travel to the kernel
(:func:`kernel_prompt`, an RPC from the call's own thread) and the line typed there comes
back. ``c`` ends the session and the call returns as usual; ``q`` ends the call with
:class:`~nbrpc.DebuggerQuitError`. Source lines of notebook code are fetched once from the
kernel's ``linecache`` (the worker has no file for a cell), so ``l`` and ``->`` show them.

**Kernel side.** Prompts arrive on torch's RPC threads, but input can only be read on the
main thread: ipykernel ties an input request to the cell being run, and a terminal belongs
to the main thread. The main thread waits for nbrpc calls in short slices
(``_agent.Future.wait``); a prompt wakes it and :func:`serve` runs ``input(prompt)``
there. One session at a time: a second worker's breakpoint waits until the first session
continues or quits, and each session opens with a line naming its worker. The stop button
(KeyboardInterrupt in ``input``) quits the open session and the waiting ones, then
interrupts the cell. While a session is open, the clock of nbrpc's call timeouts stands
still (:mod:`nbrpc._deadlines`).

**No input channel, no hang.** nbval and nbclient (``make demo``) run cells without an
input box, and a script's stdin may not be a terminal: the worker is told so at its first
prompt, prints a warning line and runs on. The same happens when the kernel's main thread
does not wait on an nbrpc call for :data:`GRACE_S` (it sleeps, computes, or blocks in a
plain torch call). ``PYTHONBREAKPOINT=0`` (the worker's or the kernel's) skips silently.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import pdb
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, cast

import torch.distributed.rpc as rpc

from . import _deadlines, _remote

__all__ = [
    "GRACE_S",
    "RemotePdb",
    "breakpointhook",
    "forget_worker",
    "install",
    "kernel_end",
    "kernel_prompt",
    "kernel_sources",
    "main_thread_waits",
    "no_input_reason",
    "open_post_mortem",
    "reset",
    "serve",
    "set_trace",
]

GRACE_S = 2.0  # how long a prompt waits for the kernel's main thread to wait on a call

# Modules pdb does not stop in when stepping: nbrpc's and torch's machinery around a call.
_SKIP = ["nbrpc.*", "torch.*", "cloudpickle.*", "threading", "concurrent.*"]

# -- worker side ---------------------------------------------------------------------------

_original_set_trace = pdb.set_trace
_debuggers: dict[int, RemotePdb] = {}  # thread id -> its debugger, while its call runs
_sessions = itertools.count(1)


class _KernelIO:
    """pdb's stdin and stdout for one worker thread: the kernel, one prompt at a time."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.debugger: RemotePdb | None = None
        self.session: str | None = None
        self._text: list[str] = []

    def write(self, text: str) -> int:
        self._text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def _take_text(self) -> str:
        text, self._text = "".join(self._text), []
        return text

    def readline(self) -> str:
        assert self.debugger is not None
        prompt = self.debugger.prompt
        text = self._take_text().removesuffix(prompt)
        title = ""
        if self.session is None:  # a new session: its first prompt
            self.session = f"{_remote.worker_name()}/{os.getpid()}/{next(_sessions)}"
            title = self.title
        _remote.drain_output()  # the call's own prints show before pdb's
        try:
            kind, value = rpc.rpc_sync(
                _remote.kernel_name(),
                kernel_prompt,
                args=(_remote.worker_name(), self.session, text, prompt, title),
                timeout=0,
            )
        except Exception as exc:  # the kernel is gone: leave the debugger, run on
            kind, value = "skip", f"the kernel did not answer ({str(exc).splitlines()[0]})"
        if kind == "line":
            return "" if value is None else value + "\n"  # "" is EOF: pdb quits
        if kind == "quit":
            return "q\n"
        # "skip": nobody can type here; run on
        self.session = None
        if value:
            where = self.debugger.where_text()
            sys.stderr.write(f"nbrpc: breakpoint() at {where} skipped: {value}.\n")
        self.debugger.clear_all_breaks()
        return "c\n"

    def end(self) -> None:
        """The session ends (c, q, or the call's end): the kernel may serve the next."""
        if self.session is None:
            return
        session, self.session = self.session, None
        with contextlib.suppress(Exception):  # the kernel is gone
            rpc.rpc_async(
                _remote.kernel_name(),
                kernel_end,
                args=(_remote.worker_name(), session, self._take_text()),
                timeout=0,
            )


class RemotePdb(pdb.Pdb):
    """pdb on a worker, served by the kernel (see the module doc)."""

    def __init__(self, title: str = "") -> None:
        self.io = _KernelIO(title)
        io = cast(IO[str], self.io)  # pdb needs write, flush and readline only
        super().__init__(stdin=io, stdout=io, skip=_SKIP, nosigint=True, readrc=False)
        self.io.debugger = self
        self.use_rawinput = False
        self.prompt = f"(Pdb {_remote.worker_name()}) "
        self._sources_asked: set[str] = set()

    def where_text(self) -> str:
        frame = getattr(self, "curframe", None)
        if frame is None:
            return "?"
        code = frame.f_code
        return f"{code.co_name} ({code.co_filename}, line {frame.f_lineno})"

    def setup(self, f: Any, tb: Any) -> None:
        super().setup(f, tb)
        self._fetch_sources([frame.f_code.co_filename for frame, _ in self.stack])

    def _fetch_sources(self, filenames: list[str]) -> None:
        """Notebook cells have no file here: their lines come from the kernel, once."""
        missing = sorted(
            {fn for fn in filenames if fn not in self._sources_asked and not linecache.getlines(fn)}
        )
        if not missing:
            return
        self._sources_asked.update(missing)
        try:
            found = rpc.rpc_sync(_remote.kernel_name(), kernel_sources, args=(missing,), timeout=10)
        except Exception:
            return
        for fn, text in found.items():
            lines = text.splitlines(True)
            linecache.cache[fn] = (len(text), None, lines, fn)

    def set_continue(self) -> None:
        super().set_continue()
        self.io.end()

    def set_quit(self) -> None:
        super().set_quit()
        self.io.end()


def _debugger_here(title: str) -> RemotePdb:
    thread = threading.get_ident()
    debugger = _debuggers.get(thread)
    if debugger is None:
        debugger = _debuggers[thread] = RemotePdb(title)
    return debugger


def _open(frame: Any, header: str | None) -> None:
    debugger = _debugger_here(
        f"{_remote.worker_name()} (pid {os.getpid()}). c continues, q ends the call"
    )
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def breakpointhook(*args: Any, **kws: Any) -> Any:
    """``sys.breakpointhook`` on workers: pdb through the kernel inside an RPC call."""
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook == "0":
        return None
    if (hook and hook != "pdb.set_trace") or not _remote.calling():
        return sys.__breakpointhook__(*args, **kws)
    return _open(sys._getframe(1), kws.get("header"))


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace`` on workers: the same as ``breakpoint()`` inside an RPC call."""
    if not _remote.calling():
        return _original_set_trace(header=header)
    _open(sys._getframe(1), header)


def _after_call() -> None:
    """A call ends on this thread: its debugger goes, and tracing stops here."""
    if not _debuggers:
        return
    debugger = _debuggers.pop(threading.get_ident(), None)
    if debugger is not None:
        sys.settrace(None)
        debugger.io.end()


def install() -> None:
    """On a worker: ``breakpoint()`` and ``pdb.set_trace()`` open :class:`RemotePdb`."""
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    _remote.after_call(_after_call)


def open_post_mortem(failure_id: str) -> str:
    """Run by RPC on a worker: pdb on the frames of its kept failure (``%rpc_debug``)."""
    from ._errors import NbrpcError

    kept = _remote.kept_failure()
    if kept is None or kept[0] != failure_id:
        raise NbrpcError(
            f"{_remote.worker_name()} no longer keeps that traceback: it keeps only its "
            "last failed call, and another has failed there since. Run %rpc_debug right "
            "after the failure you want to inspect."
        )
    exc = kept[1]
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("nbrpc."):
        tb = tb.tb_next  # start at the user's frames, not nbrpc's run_function
    summary = f"{type(exc).__name__}: {exc}"
    debugger = RemotePdb(f"post-mortem on {_remote.worker_name()}: {summary}. c or q leaves")
    debugger.reset()
    try:
        debugger.interaction(None, tb or exc.__traceback__)
    finally:
        debugger.io.end()
    return summary


# -- kernel side ---------------------------------------------------------------------------


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


_cond = threading.Condition()
_queue: list[_Prompt] = []  # prompts waiting for the main thread
_open_session: dict[str, str] = {}  # "session", "worker": the one being served
_waiters: set[threading.Event] = set()  # main-thread waits in progress (at most one)
_idle = {"since": time.monotonic()}  # when the main thread last stopped waiting


def _ipython() -> Any:
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def no_input_reason() -> str | None:
    """Why nobody can type a debugger command here (None: someone can; "": turned off)."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return ""
    shell = _ipython()
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
    with _cond:
        _queue.append(request)
        for woke in _waiters:
            woke.set()
        while request.answer is None:
            if not request.taken and not _waiters and _open_session.get("session") != session:
                idle = time.monotonic() - max(_idle["since"], request.asked)
                if idle > GRACE_S:
                    _queue.remove(request)
                    return (
                        "skip",
                        "the kernel is not waiting on an nbrpc call (pdb opens while "
                        "nbrpc.rpc_sync, a future's wait() or to_here() waits in the calling "
                        "cell)",
                    )
            _cond.wait(0.25)
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
    with _cond:
        if _open_session.get("session") != session:
            return
        _open_session.clear()
        for woke in _waiters:
            woke.set()
        _cond.notify_all()
    _deadlines.clock.resume()


@contextlib.contextmanager
def main_thread_waits(woke: threading.Event) -> Any:
    """The main thread waits on a call: prompts set ``woke``; it then calls :func:`serve`."""
    with _cond:
        _waiters.add(woke)
        if _queue:
            woke.set()
    try:
        yield
    finally:
        with _cond:
            _waiters.discard(woke)
            _idle["since"] = time.monotonic()


def _next_prompt() -> tuple[_Prompt | None, bool]:
    with _cond:
        current = _open_session.get("session")
        for request in _queue:
            if current is None or request.session == current:
                _queue.remove(request)
                request.taken = True
                if current is None:
                    _open_session.update(session=request.session, worker=request.worker)
                    return request, True
                return request, False
    return None, False


def _answer(request: _Prompt, answer: tuple) -> None:
    with _cond:
        request.answer = answer
        _cond.notify_all()


def serve() -> None:
    """On the main thread: read the commands the waiting prompts ask for, one session at
    a time. The stop button quits every session waiting here, then interrupts."""
    while True:
        request, opening = _next_prompt()
        if request is None:
            return
        if opening:
            _deadlines.clock.pause()
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
    with _cond:
        for request in [r for r in _queue if worker is None or r.worker == worker]:
            _queue.remove(request)
            request.answer = answer
        ours = worker is None or _open_session.get("worker") == worker
        session = _open_session.get("session") if ours else None
        _cond.notify_all()
    if session:
        _end(session)


def forget_worker(name: str) -> None:
    """A worker died: its prompts are dropped and its open session ends."""
    _answer_waiting(("skip", ""), name)


def reset(why: str = "the cluster is shutting down") -> None:
    """Shutdown: waiting prompts are answered (the workers run on), sessions end."""
    _answer_waiting(("skip", why))
    _remote.forget_failures()
