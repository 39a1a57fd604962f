"""The worker side of the debugger: pdb whose stdin and stdout are the calling cell.

``breakpoint()`` and ``pdb.set_trace()`` inside an RPC call open a :class:`RemotePdb`:
Python's own pdb, whose stdin and stdout are the kernel. Each time pdb wants a command,
what it printed and its prompt (``(Pdb worker1)``) travel to the kernel
(:func:`nbrpc._debugger.prompts.kernel_prompt`, an RPC from the call's own thread) and the
line typed there comes back. ``c`` ends the session and the call returns as usual; ``q``
ends the call with :class:`~nbrpc.DebuggerQuitError`. Source lines of notebook code are
fetched once from the kernel's ``linecache`` (the worker has no file for a cell), so ``l``
and ``->`` show them.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import pdb
import sys
import threading
from typing import IO, Any, cast

from nbrpc import _process, _torch
from nbrpc._wire import callee, failures, output

from .prompts import kernel_end, kernel_prompt, kernel_sources

# Modules pdb does not stop in when stepping: nbrpc's and torch's machinery around a call.
_SKIP = ["nbrpc.*", "torch.*", "cloudpickle.*", "threading", "concurrent.*"]

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
        try:
            return self._readline()
        except KeyboardInterrupt:  # the stop button cancelled the call (nbrpc._calls.cancel)
            return "q\n"  # pdb's own loop would catch it and prompt again

    def _readline(self) -> str:
        assert self.debugger is not None
        prompt = self.debugger.prompt
        text = self._take_text().removesuffix(prompt)
        title = ""
        if self.session is None:  # a new session: its first prompt
            self.session = f"{_process.name()}/{os.getpid()}/{next(_sessions)}"
            title = self.title
        output.drain_output()  # the call's own prints show before pdb's
        try:
            kind, value = _torch.rpc_sync(
                output.kernel_name(),
                kernel_prompt,
                args=(_process.name(), self.session, text, prompt, title),
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
            _torch.rpc_async(
                output.kernel_name(),
                kernel_end,
                args=(_process.name(), session, self._take_text()),
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
        self.prompt = f"(Pdb {_process.name()}) "
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
            found = _torch.rpc_sync(
                output.kernel_name(), kernel_sources, args=(missing,), timeout=10
            )
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
        f"{_process.name()} (pid {os.getpid()}). c continues, q ends the call"
    )
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def breakpointhook(*args: Any, **kws: Any) -> Any:
    """``sys.breakpointhook`` on workers: pdb through the kernel inside an RPC call."""
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook == "0":
        return None
    if (hook and hook != "pdb.set_trace") or not output.calling():
        return sys.__breakpointhook__(*args, **kws)
    return _open(sys._getframe(1), kws.get("header"))


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace`` on workers: the same as ``breakpoint()`` inside an RPC call."""
    if not output.calling():
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
    callee.after_call(_after_call)


def open_post_mortem(failure_id: str) -> str:
    """Run by RPC on a worker: pdb on the frames of its kept failure (``%rpc_debug``)."""
    from nbrpc._errors import NbrpcError

    kept = failures.kept_failure()
    if kept is None or kept[0] != failure_id:
        raise NbrpcError(
            f"{_process.name()} no longer keeps that traceback: it keeps only its "
            "last failed call, and another has failed there since. Run %rpc_debug right "
            "after the failure you want to inspect."
        )
    exc = kept[1]
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("nbrpc."):
        tb = tb.tb_next  # start at the user's frames, not nbrpc's run_function
    summary = f"{type(exc).__name__}: {exc}"
    debugger = RemotePdb(f"post-mortem on {_process.name()}: {summary}. c or q leaves")
    debugger.reset()
    try:
        debugger.interaction(None, tb or exc.__traceback__)
    finally:
        debugger.io.end()
    return summary
