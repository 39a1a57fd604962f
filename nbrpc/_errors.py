"""Every error nbrpc raises on its own account.

One base class, so ``except nbrpc.NbrpcError`` catches them all; each also derives from
the builtin a caller would naturally catch (``ValueError`` for bad names, ``TimeoutError``
for deadlines, ``RuntimeError`` for lifecycle mistakes). Where torch raises its own error
for the same mistake (always a ``RuntimeError``: a timeout, an unknown destination, a
lost peer, something that cannot be pickled), nbrpc's class derives from ``RuntimeError``
too, so code written for torch (``except RuntimeError``, ``assertRaisesRegex``) still
catches it; a timeout's message keeps torch's words ("RPC ran for more than")::

    NbrpcError
    ├── NotInitializedError      (RuntimeError)   a call before %rpc_init / nbrpc.init
    ├── AlreadyInitializedError  (RuntimeError)   %rpc_init twice without %rpc_shutdown
    ├── ClusterClosedError       (RuntimeError)   a handle used after its cluster shut down
    ├── BootError                (RuntimeError)   workers did not start or join in time
    ├── AutogradContextError     (RuntimeError)   distributed autograd outside its context
    ├── ConfigError              (ValueError)     a bad setting: n, names, --listen, ...
    ├── UnknownWorkerError       (ValueError, RuntimeError)  a worker not in the group
    ├── DeviceMapError           (ValueError)     a device map names a device a process lacks
    ├── RpcTimeoutError          (TimeoutError, RuntimeError)  a call outlived its timeout
    ├── SerializationError       (TypeError, RuntimeError)  cannot be pickled or imported
    ├── WorkerDiedError          (ConnectionError, RuntimeError)  the worker's process is gone
    ├── ThreadsExhaustedError    (RuntimeError)   calls made inside calls used up the RPC threads
    ├── DebuggerQuitError        (RuntimeError)   q (or the stop button) in a worker's pdb
    ├── RpcCellError             (RuntimeError)   several workers failed in one %%rpc cell
    │                                             (defined with the cells, nbrpc._cells)
    └── RemoteError              (RuntimeError)   a worker raised, and the original type
                                                  could not be rebuilt here

A worker's exception whose type *can* be rebuilt is re-raised as that type (a
``ZeroDivisionError`` stays a ``ZeroDivisionError``); it carries ``worker`` and
``remote_traceback`` attributes and a note with the remote traceback. Messages say what
happened and what to do next.

In a notebook these errors show short (:func:`short_traceback`, IPython's
``_render_traceback_``): the cell's own lines, the error, and a worker's traceback where
there is one; not the frames of nbrpc, IPython and torch between them.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import re
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def counted(n: int, noun: str, plural: str = "") -> str:
    """``"1 worker"``, ``"2 workers"``, ``"0 processes"`` (``plural``: where it is not
    ``noun + "s"``): a count in a message, its noun agreeing with it."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def library_dirs() -> tuple[str, ...]:
    """Where nbrpc's, IPython's and torch's own code lives (their frames are not shown)."""
    import IPython
    import torch

    files = (__file__, IPython.__file__ or "", torch.__file__ or "")
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files)


def raised_in_rpc_code(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in nbrpc's code or torch's RPC code (``torch.distributed``,
    ``torch.futures``), or in a library they called (``threading.py``'s wait, ipyparallel's,
    in ``%rpc_init``): where the stop button's KeyboardInterrupt lands between nbrpc's
    waits, in code the user did not write. Read from the innermost frame out: the first
    frame of nbrpc's or torch's RPC says yes, the first of the user's own code says no."""
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__ or ""))
    dirs = tuple(
        d + os.sep
        for d in (
            os.path.dirname(os.path.abspath(__file__)),
            os.path.join(torch_dir, "distributed"),
            os.path.join(torch_dir, "futures"),
        )
    )
    others = _installed_dirs()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(dirs):
            return True
        if not path.startswith(others):
            return False  # the user's code
    return False


def _users_frame(frame: traceback.FrameSummary, libraries: tuple[str, ...]) -> bool:
    """A frame of the user's code: not nbrpc's, IPython's or torch's, nor the line IPython
    turns a magic into (``get_ipython().run_line_magic(...)``)."""
    if os.path.abspath(frame.filename).startswith(libraries):
        return False
    return not (frame.line or "").startswith("get_ipython().run_")


def _installed_frame(frame: traceback.FrameSummary) -> bool:
    """A frame of the standard library or an installed package (``threading.py``'s waits,
    ipyparallel's), not the user's own even where nbrpc called it."""
    return os.path.abspath(frame.filename).startswith(_installed_dirs())


@functools.cache
def _installed_dirs() -> tuple[str, ...]:
    """The standard library's folder and site-packages'."""
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(os.__file__), paths["purelib"], paths["platlib"]}
    return tuple(os.path.abspath(d) + os.sep for d in sorted(dirs))


#: where an installed Python keeps the standard library and packages, on any host
_INSTALLED = re.compile(r"/lib/(?:python\d+\.\d+|pypy[\d.]*)/|/(?:site|dist)-packages/")


def library_file(filename: str) -> bool:
    """Whether ``filename`` (a frame's, read in this process or on another host) is code
    of nbrpc's, IPython's, torch's, the standard library's or an installed package's: not
    the user's. Another host's paths are told by their shape (``.../lib/python3.11/``,
    ``site-packages``) and nbrpc's by its modules' names; the notebook's cells
    (``/tmp/ipykernel_PID/NNN.py``) and ``%%rpc`` cells (``<rpc-cell-N>``) are the user's,
    other ``<...>`` names (``<frozen ...>``, ``<string>``) not."""
    if filename.startswith("<"):
        return not filename.startswith("<rpc-cell-")
    path = os.path.abspath(filename)
    if path.startswith(library_dirs() + _installed_dirs()) or _INSTALLED.search(path):
        return True
    return _nbrpc_module(path)


@functools.cache
def _nbrpc_module(path: str) -> bool:
    """``path`` is a module of nbrpc installed elsewhere (a worker's own checkout): one
    whose path below a ``nbrpc`` folder names a module of this nbrpc."""
    own = os.path.dirname(os.path.abspath(__file__))
    _, sep, inside = path.rpartition(os.sep + "nbrpc" + os.sep)
    return bool(sep) and os.path.isfile(os.path.join(own, inside))


def cell_name(filename: str) -> str | None:
    """``"Cell In[5]"`` for the file a notebook cell was compiled as (ipykernel names it
    ``/tmp/ipykernel_PID/NNN.py``), as IPython's own tracebacks say; None for other files."""
    import sys

    IPython = sys.modules.get("IPython")
    shell = IPython.get_ipython() if IPython is not None else None
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(filename)
    return f"{named[0]} {named[1]}" if named else None


_FILE_LINE = re.compile(r'^  File "(.+)", line (\d+), in (.+)$')


def format_frames(frames: list[traceback.FrameSummary]) -> list[str]:
    """``traceback.StackSummary.format`` (repeated frames collapsed as Python does), with
    a notebook cell named as IPython names it: ``Cell In[5], line 3, in f``."""
    chunks = []
    for chunk in traceback.StackSummary.from_list(frames).format():
        first, newline, rest = chunk.partition("\n")
        match = _FILE_LINE.match(first)
        cell = cell_name(match.group(1)) if match else None
        if match and cell:
            first = f"  {cell}, line {match.group(2)}, in {match.group(3)}"
        chunks.append((first + newline + rest).rstrip("\n"))
    return chunks


def short_traceback(exc: BaseException) -> list[str]:
    """What a notebook shows for ``exc`` (IPython's ``_render_traceback_``): the user's own
    frames, the error in one line, and its notes (a worker's traceback), not the frames of
    nbrpc, IPython and torch it passed through."""
    libraries = library_dirs()
    frames = []
    inside = False  # in a library's code: the standard library it calls is not the user's
    for f in traceback.extract_tb(exc.__traceback__):
        if _users_frame(f, libraries) and not (inside and _installed_frame(f)):
            frames.append(f)
        inside = inside or os.path.abspath(f.filename).startswith(libraries)
    lines = []
    if frames:
        lines.append("Traceback (most recent call last):")
        lines.extend(format_frames(list(frames)))
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__") and not module.startswith("nbrpc"):
        name = f"{module}.{name}"
    lines.append(f"{name}: {exc}" if str(exc) else name)
    lines.extend(_cells_named(note.strip("\n")) for note in getattr(exc, "__notes__", ()))
    return lines


class ShortTraceback:
    """A rebuilt exception's ``_render_traceback_``: IPython shows the notebook's lines and
    the worker's traceback, not nbrpc's frames (:func:`short_traceback`).
    Not sent along if the exception travels on: the next receiver makes its own."""

    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    def __call__(self) -> list[str]:
        if self.exc is None:
            raise AttributeError("no exception to render")  # IPython then shows its own
        return short_traceback(self.exc)

    def __reduce__(self) -> tuple:
        return (ShortTraceback, (None,))


def shown_short(call: Callable[..., T]) -> Callable[..., T]:
    """``call`` (one of nbrpc's calls a notebook makes), whose errors a notebook shows
    short, as nbrpc's own: the cell's lines and the error, not the frames of nbrpc and
    torch an error of torch's passed through; so is the stop button's KeyboardInterrupt
    that lands while the call is being sent (measured: in torch's ``rpc_async``, an RL
    tutorial's cell showed nbrpc's and torch's frames). Type, message and traceback
    unchanged (a script, ``except RuntimeError`` and torch's ``assertRaisesRegex`` see
    torch's error)."""

    @functools.wraps(call)
    def shown(*args: Any, **kwargs: Any) -> T:
        try:
            return call(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:
            show_short_unless_rendered(exc)
            raise

    return shown


def show_short_unless_rendered(exc: BaseException) -> None:
    """:func:`show_short`, for an error that does not render itself already (nbrpc's own
    errors, a worker's rebuilt exception); one whose type takes no attribute (``__slots__``)
    stays as it is."""
    if getattr(exc, "_render_traceback_", None) is None:
        with contextlib.suppress(Exception):
            show_short(exc)


def show_short(exc: BaseException) -> None:
    """Have IPython show ``exc`` short: the cell's lines, not nbrpc's (the stop button's
    KeyboardInterrupt raised inside one of nbrpc's waits)."""
    exc._render_traceback_ = ShortTraceback(exc)  # type: ignore[attr-defined]


def _cells_named(note: str) -> str:
    """A remote traceback another worker formatted (an exception passed back through a
    nested call) names this kernel's cells by their files, which only the kernel can name:
    named here as IPython names them, each with its line of source."""
    lines = note.split("\n")
    named = []
    for i, line in enumerate(lines):
        match = _FILE_LINE.match(line)
        cell = cell_name(match.group(1)) if match else None
        if not match or not cell:
            named.append(line)
            continue
        named.append(f"  {cell}, line {match.group(2)}, in {match.group(3)}")
        has_source = i + 1 < len(lines) and lines[i + 1].startswith("    ")
        source = "" if has_source else linecache.getline(match.group(1), int(match.group(2)))
        if source.strip():
            named.append(f"    {source.strip()}")
    return "\n".join(named)


class NbrpcError(Exception):
    """Base class of every error nbrpc raises itself."""

    _init_args: tuple = ()  # set by subclasses whose __init__ builds the message
    #: the message names the worker and the call, and nbrpc raised it there, not the
    #: user's code: the kernel shows it without the worker's traceback, which would only
    #: repeat it (a cancelled call's, once per process it passed back through)
    says_where: bool = False

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of its traceback (see :func:`short_traceback`)."""
        return short_traceback(self)

    def __reduce__(self) -> tuple:
        # Pickled (a worker's error travelling to the kernel) with the constructor's own
        # arguments, not the finished message, which __init__ would wrap a second time.
        args = self._init_args or self.args
        return (type(self), args, self.__dict__)


class NotInitializedError(NbrpcError, RuntimeError):
    """A call, a magic or a view that needs a cluster, before ``%rpc_init`` or
    :func:`nbrpc.init` started one (or after :func:`nbrpc.shutdown`). ``what`` names the
    call in the message, which says to start a cluster first."""

    def __init__(self, what: str = "this call") -> None:
        self._init_args = (what,)
        super().__init__(
            f"nbrpc is not initialized, so {what} has no workers to reach. "
            "Run `%rpc_init -n 2` in the notebook (or `nbrpc.init(n=2)` in a script) first."
        )


class AlreadyInitializedError(NbrpcError, RuntimeError):
    """``%rpc_init`` or :func:`nbrpc.init` while a cluster is running in this process:
    one cluster at a time. ``%rpc_shutdown`` (:func:`nbrpc.shutdown`) first, then start
    the new one; a second init after a shutdown is supported."""


class ClusterClosedError(NbrpcError, RuntimeError):
    """A :class:`~nbrpc.Cluster` handle, or something it made, used after that cluster
    shut down (or a cluster started twice). Start a new cluster with :func:`nbrpc.init`;
    handles of the old one stay closed."""


class BootError(NbrpcError, RuntimeError):
    """Workers did not start or join the RPC group in time (an interpreter that cannot
    start, an engine that never registers, a store that cannot listen, a restart that
    failed). The message names the worker or the step, and what to check."""


class AutogradContextError(NbrpcError, RuntimeError):
    """A distributed autograd call outside of (or after) its context."""


class ConfigError(NbrpcError, ValueError):
    """A setting nbrpc cannot use (checked before any process starts)."""


class UnknownWorkerError(NbrpcError, ValueError, RuntimeError):
    """A destination (a name, or torch's id) that is not a member of the RPC group: a typo, or
    a worker that left at ``%rpc_scale`` (``left_at`` says when). ``name`` is what was
    asked for, ``known`` the members' names then. A ``ValueError`` and, as torch's own
    error for it, a ``RuntimeError``."""

    def __init__(self, name: object, known: list[str], left_at: str = "") -> None:
        self.name = name
        self.known = list(known)
        self._init_args = (name, self.known, left_at)
        if left_at:  # it was a worker: it left at a scale
            super().__init__(
                f"{name} left the cluster at a scale (%rpc_scale, at {left_at}): it is no "
                f"longer in this RPC group. Its workers now: {', '.join(known) or '(none)'}. "
                f"%rpc_scale --names {name} brings a new worker of that name."
            )
            return
        if isinstance(name, int):  # as torch takes it: torch's id, not nbrpc.rank()
            super().__init__(
                f"No worker with torch id {name} in this RPC group (an integer destination "
                "is torch's id, get_worker_info().id, which is not nbrpc.rank() from a "
                "kernel's second cluster on, nor after a restart). "
                f"Known workers: {', '.join(known) or '(none)'}. "
                "Name the worker instead, or list them with nbrpc.workers()."
            )
            return
        super().__init__(
            f"No worker named {name!r} in this RPC group. "
            f"Known workers: {', '.join(known) or '(none)'}. "
            "Check the spelling, or list them with nbrpc.workers()."
        )


class RpcTimeoutError(NbrpcError, TimeoutError, RuntimeError):
    """A call outlived its timeout (the call's ``timeout``, else the cluster's
    ``rpc_timeout``, 60 s by default). Its message keeps torch's words ("RPC ran for more
    than"), so code written for torch still matches it; a ``TimeoutError`` too."""


class SerializationError(NbrpcError, TypeError, RuntimeError):
    """An argument or a result that cannot travel: it cannot be pickled (an open file, a
    lock, a generator), or it cannot be unpickled on the other side (a module the other
    process cannot import). The message names the object and the side; a ``TypeError``
    and, as torch's own error for it, a ``RuntimeError``."""


class DeviceMapError(NbrpcError, ValueError):
    """A device map or ``--gpus`` plan that the processes' devices cannot satisfy."""


class WorkerDiedError(NbrpcError, ConnectionError, RuntimeError):
    """A worker's process is gone (killed, crashed, out of memory) or unreachable."""

    def __init__(
        self,
        worker: str,
        detail: str = "",
        last_output: str = "",
        restarted: int | None = None,
        left_at: str = "",
    ) -> None:
        self.worker = worker
        self.left_at = left_at
        self._init_args = (worker, detail, last_output, restarted, left_at)
        if left_at:  # an object of a worker that left at a scale
            super().__init__(
                f"{worker} left the cluster at a scale (%rpc_scale, at {left_at}), and the "
                f"objects it owned (RRefs) went with it. Make what you need again on a "
                "worker of the cluster (nbrpc.workers() lists them)."
            )
            return
        if restarted is not None:  # nbrpc.restart replaced the process (torch id ``restarted``)
            super().__init__(
                f"{worker} was restarted (nbrpc.restart): the process this refers to (torch "
                f"id {restarted}) is gone, and the objects it owned (RRefs) with it. The new "
                f"{worker} answers calls: make what you need again there."
            )
            return
        # ``detail``: why, as its writer words it ("torch said: ..." where torch said it)
        super().__init__(
            f"{worker} is gone: "
            + (detail or "its connection closed (the process died or was killed)")
            + f". Calls to {worker} fail and the objects it owned (RRefs) are lost. "
            f"%rpc_restart {worker} starts a new {worker} where the cluster can (%rpc_status "
            "shows which workers are dead); %rpc_shutdown then %rpc_init rebuilds the "
            "cluster in this kernel."
            + (f"\nThe last output of {worker}'s process:\n{last_output}" if last_output else "")
        )


class ThreadsExhaustedError(NbrpcError, RuntimeError):
    """Calls made inside calls hold every RPC thread of the workers involved, waiting on
    each other: none can finish (:mod:`nbrpc._calls.deadlock` notices it and says why)."""


class DebuggerQuitError(NbrpcError, RuntimeError):
    """The debugger on a worker was left with ``q`` (or the stop button): the call ends."""

    says_where = True

    def __init__(self, worker: str, call: str = "?") -> None:
        self.worker = worker
        self._init_args = (worker, call)
        super().__init__(
            f"the call of {call} on {worker} was ended in the debugger (q, or the stop "
            "button). Type c (continue) at the (Pdb) prompt to let a call run on and return."
        )


class CallCancelledError(NbrpcError, RuntimeError):
    """The call was cancelled where it ran: the stop button was pressed in the cell that
    started it (or ``nbrpc.cancel``, or a script's Ctrl-C), before it returned. Shown in
    one line: its message names the call and the worker."""

    says_where = True

    def __init__(self, worker: str, call: str = "?", started: bool = True, why: str = "") -> None:
        self.worker = worker
        self._init_args = (worker, call, started, why)
        how = "while it ran" if started else "before it started"
        if why:  # cut off by nbrpc itself, not by the caller's stop button
            super().__init__(f"the {call} on {worker} was cut off {how}: {why}")
            return
        super().__init__(
            f"the call of {call} on {worker} was cancelled {how}: the stop button was "
            "pressed in the cell that started it (or nbrpc.cancel, or Ctrl-C). Run the "
            "cell again to make the call again."
        )


class ConnectionLost(ConnectionError):
    """A route's own connection to a peer closed (a lane's; torch's own are known by their
    words): the call facade's translation makes it a :class:`WorkerDiedError`. Not a
    public name: a user sees the translation."""


class SharedHostWarning(UserWarning):
    """Other users run processes on this host: they can reach the cluster's loopback
    ports, and through them run code as you (docs/security.md). Filterable with Python's
    warnings: ``warnings.filterwarnings("ignore", category=nbrpc.SharedHostWarning)``."""


class RemoteError(NbrpcError, RuntimeError):
    """A worker raised an exception whose type could not be rebuilt in this process (a
    ``RuntimeError``, with torch's words for it, as torch's own caller raises).

    ``ename`` is the remote type's qualified name, ``evalue`` its message, ``worker`` the
    worker's name and ``remote_traceback`` the formatted remote traceback.
    """

    def __init__(self, ename: str, evalue: str, worker: str, remote_traceback: str) -> None:
        self.ename = ename
        self.evalue = evalue
        self.worker = worker
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{ename}: {evalue} (raised on {worker}; its type cannot be rebuilt here. "
            f"Original exception on remote side was {ename})"
        )

    def __reduce__(self):
        return (
            type(self),
            (self.ename, self.evalue, self.worker, self.remote_traceback),
        )
