"""Who this process is: its name in the RPC group, its id token, whether a notebook runs it.

Facts that modules of every layer ask about the process they run in (a failure names the
worker that raised it, a code key and a failure id must be unique to their process, the
boot shows widgets only in a notebook), kept at the bottom so that any of them may ask.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal.signal's own; no stub)
import _thread
import ast
import contextlib
import inspect
import os
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.rpc as rpc

from . import _fork, _timers
from ._errors import SharedHostWarning

_named: list[str] = []  # this process's name once it joined: it keeps it for life


def name() -> str:
    """This process's name in the group, or ``"?"`` outside one (asked of torch until it
    has one; every call it sends names its caller)."""
    if _named:
        return _named[0]
    try:
        found = rpc.get_worker_info().name
    except Exception:
        return "?"
    _named.append(found)
    return found


@dataclass
class _Identity:
    token: str = ""

    def renew(self) -> None:
        self.token = f"{os.getpid()}.{os.urandom(4).hex()}"


_identity = _Identity()
_identity.renew()
_fork.in_child(_identity.renew)  # workers are forked from the zygote
_fork.in_child(_named.clear)


def token() -> str:
    """This process's own prefix for ids it hands out (failure ids, code keys): unique to
    it, also among processes forked from one parent, which get a new one at the fork."""
    return _identity.token


def other_users() -> dict[int, str]:
    """Other people with processes on this host: uid -> name, for uids of human accounts
    (1000 and up, as Debian and most distributions number them), this process's excepted."""
    import pwd

    me = os.getuid()
    found: dict[int, str] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue
        if uid >= 1000 and uid != me and uid != 65534 and uid not in found:  # 65534: nobody
            try:
                found[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                found[uid] = str(uid)
    return found


def shell() -> Any:
    """This process's IPython shell, or None (a script: IPython not even imported)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def in_notebook() -> bool:
    """Whether a Jupyter kernel runs this process (widgets can be shown)."""
    return getattr(shell(), "kernel", None) is not None


@dataclass
class _Warned:
    shared_host: bool = False


_warned = _Warned()


def warn_if_the_host_is_shared() -> None:
    """Once per process: say that other users of this host can reach the cluster."""
    if _warned.shared_host:
        return
    others = other_users()
    if not others:
        return
    _warned.shared_host = True
    who = ", ".join(f"{name} (uid {uid})" for uid, name in sorted(others.items())[:5])
    warnings.warn(
        f"other users run processes on this host: {who}. torch RPC has no authentication, "
        "and they can reach this cluster's ports on loopback: with them, run code as you, "
        "read your files and stop your kernel. docs/security.md says what they can do, and "
        "how to get a host of your own (a per-user container or pod, or a VM).",
        SharedHostWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside nbrpc: a warning names the user's line."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("nbrpc"):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class _Cells:
    """Whether a cell runs in this kernel now (watched once a cluster starts in it), and
    where ipykernel is in the execute request around it (:func:`guard_stops`)."""

    watched: bool = False
    running: bool = True  # until watched: a script, or the cell that started watching
    handling: bool = True  # an execute request is handled (the one that started watching)
    ran: bool = True  # its cell has started (pre_run_cell)
    cells: int = 0  # cells started: a stop delivered again goes to its own cell only
    pending: bool = False  # a stop pressed before its cell started, delivered when it does
    guarded: bool = False
    run_code: Any = None  # IPython's InteractiveShell.run_code's code: the cell's code runs in it


_cells = _Cells()


def watch_cells() -> None:
    """In an IPython kernel, once: follow whether a cell runs (IPython's events)."""
    ipython = shell()
    if _cells.watched or ipython is None:
        return
    _cells.watched = True

    def started(*_: Any) -> None:
        _cells.running = _cells.ran = True
        _cells.cells += 1

    def ended(*_: Any) -> None:
        _cells.running = False

    ipython.events.register("pre_run_cell", started)
    ipython.events.register("post_run_cell", ended)


def cell_running() -> bool:
    """Whether output now has a cell to go to (always, outside IPython)."""
    return _cells.running


#: how soon a stop that a finalizer swallowed is delivered again (the finalizer has returned)
STOP_AGAIN_S = 0.02


@dataclass
class _Stops:
    """The stop button's interrupts that a finalizer swallowed, delivered again."""

    kept: bool = False
    again: int = 0  # how many (tests read it)


_stops = _Stops()


def keep_stops() -> None:
    """Once per process: the stop button is never lost in a finalizer.

    Python raises a pending SIGINT's KeyboardInterrupt at the main thread's next bytecode.
    When that bytecode is a weakref callback's or a ``__del__``'s (a tensor received
    through shared memory is freed, and the slot it held is given back: a
    ``WeakValueDictionary``'s callback), Python prints "Exception ignored in ...
    KeyboardInterrupt" and drops it: the cell ran on to its end (the soak, seed 1: 6 of 7
    presses during a loop of 16 MB calls were lost). Such an interrupt is delivered again,
    from a short-lived thread (``nbrpc-stop-again``) once the finalizer has returned, as the
    stop button delivers it (``_thread.interrupt_main``: nothing happens where Python does
    not handle SIGINT, as in an idle kernel; nor once the cell has ended)."""
    if _stops.kept:
        return
    _stops.kept = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        swallowed = unraisable.exc_type is not None and issubclass(
            unraisable.exc_type, KeyboardInterrupt
        )
        if swallowed and threading.current_thread() is threading.main_thread():
            _stops.again += 1
            _timers.after(STOP_AGAIN_S, _interrupt_if_a_cell_runs, _cells.cells)
            return
        previous(unraisable)

    sys.unraisablehook = hook


def _interrupt_if_a_cell_runs(cell: int) -> None:
    """Deliver a swallowed stop again, unless its cell (the ``cell``-th started) has ended
    meanwhile: an interrupt landing in ipykernel's own code as it sends a cell's reply
    loses that reply (the notebook shows the cell busy for good), and the next cell, sent
    as that reply came, is not the one the stop was for (the soak: a cell that only drops
    names got the stop of a `%rpc_scale` that had ended 0.01 s after the press)."""
    if _cells.running and _cells.cells == cell:
        _thread.interrupt_main()


def guard_stops() -> None:
    """In an IPython kernel, once: the stop button never lands in ipykernel's own code
    around a cell, where it loses the cell's reply.

    ipykernel raises the stop's KeyboardInterrupt wherever the main thread is while it
    handles an execute request. In the cell's code IPython catches it and the cell ends
    with it; before the cell's code runs (the request's start, the cell's transformation)
    or after it (the reply being made) ipykernel logs "KeyboardInterrupt caught in
    kernel." and sends no reply: the notebook shows the cell running for good (the soak:
    a stop 0.07 s after ``%rpc_scale 2 --remove worker1`` was sent, no reply in 180 s).
    Here a stop in the cell's code raises as before; one before the cell starts is held,
    and the cell's code becomes ``raise KeyboardInterrupt`` (an AST transformer of
    IPython's: the cell ends stopped, as if pressed in its first line); one between its
    start and its code, or between its code and its end, is delivered again shortly
    (while the cell runs); one after its end is dropped (the cell is over). Outside
    execute requests, ipykernel's handling stands."""
    ipython = shell()
    kernel = getattr(ipython, "kernel", None)
    handlers = getattr(kernel, "shell_handlers", None)
    if _cells.guarded or kernel is None or not isinstance(handlers, dict):
        return
    execute = handlers.get("execute_request")
    before = getattr(kernel, "pre_handler_hook", None)
    if execute is None or before is None:
        return
    _cells.guarded = True
    _cells.run_code = getattr(getattr(type(ipython), "run_code", None), "__code__", None)

    async def guarded_execute(*args: Any, **kwargs: Any) -> Any:
        _cells.handling, _cells.ran, _cells.pending = True, False, False
        try:
            result = execute(*args, **kwargs)
            return (await result) if inspect.isawaitable(result) else result
        finally:
            _cells.handling = _cells.pending = False

    def pre_handler_hook() -> None:
        before()  # ipykernel's: keeps the handler to restore, sets Python's default
        _signal.signal(signal.SIGINT, _stop_pressed)

    handlers["execute_request"] = guarded_execute
    kernel.pre_handler_hook = pre_handler_hook
    ipython.ast_transformers.append(_HeldStop())


class _HeldStop(ast.NodeTransformer):
    """A cell whose stop was pressed before it started runs ``raise KeyboardInterrupt``
    instead of its code (:func:`guard_stops`); other cells are left as they are."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        if not _cells.pending:
            return node
        _cells.pending = False
        stop = ast.Raise(exc=ast.Name(id="KeyboardInterrupt", ctx=ast.Load()), cause=None)
        return ast.fix_missing_locations(ast.Module(body=[stop], type_ignores=[]))


def _stop_pressed(signum: int, frame: types.FrameType | None) -> None:
    """SIGINT while ipykernel handles a shell request (see :func:`guard_stops`)."""
    if not _cells.handling or _in_cell_code(frame):
        raise KeyboardInterrupt
    if _cells.running:  # the cell started, its code not yet (or no more)
        _timers.after(STOP_AGAIN_S, _interrupt_if_a_cell_runs, _cells.cells)
    elif not _cells.ran:  # the request began, its cell not yet
        _cells.pending = True
    # else: the cell ended; the stop came as its reply was made


def _in_cell_code(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs inside IPython's ``run_code`` (the cell's own code, where
    IPython catches a KeyboardInterrupt and ends the cell with it)."""
    while frame is not None:
        if frame.f_code is _cells.run_code:
            return True
        frame = frame.f_back
    return False


def stops_delivered_again() -> int:
    """How many stops a finalizer swallowed and :func:`keep_stops` delivered again."""
    return _stops.again


#: A CPU figure over a window longer than this says little of now (88 % just after a
#: cancelled spin, the process idle): :func:`cpu_percent` samples anew instead.
CPU_RECENT_S = 2.0
CPU_SAMPLE_S = 0.2


@dataclass
class _Meter:
    """This process's CPU reading, one for every caller (the live views' thread and a
    cell's ``%rpc_status`` read it at once: psutil's own "since the previous call", read
    from two threads, gave the kernel 323 % of one core on a 2-core host)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    mark: tuple[float, float] = (0.0, 0.0)  # (CPU seconds, wall seconds) at the last reading


_meter = _Meter()


def _cpu_mark() -> tuple[float, float]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, time.monotonic()


def cpu_percent(sample: bool = True) -> float | None:
    """This process's CPU use, in % of one core: since the last reading, or, where that
    was over :data:`CPU_RECENT_S` ago (or never), over a fresh :data:`CPU_SAMPLE_S` of
    sleep. ``sample=False`` never sleeps nor waits for the reading of another thread (a
    side door answering past busy threads keeps the GIL): the figure since the last
    reading, or None."""
    if not _meter.lock.acquire(blocking=sample):
        return None
    try:
        cpu, wall = _cpu_mark()
        last_cpu, last_wall = _meter.mark
        if sample and (not last_wall or wall - last_wall > CPU_RECENT_S):
            time.sleep(CPU_SAMPLE_S)
            (last_cpu, last_wall), (cpu, wall) = (cpu, wall), _cpu_mark()
        _meter.mark = (cpu, wall)
    finally:
        _meter.lock.release()
    if not last_wall or wall <= last_wall:
        return None
    return max(0.0, 100.0 * (cpu - last_cpu) / (wall - last_wall))


def resources() -> dict[str, Any]:
    """What this process uses now (``%rpc_status``'s card, ``nbrpc.status()``'s rows):
    ``cpu_percent`` of one core, of late (:func:`cpu_percent`), ``memory_rss`` in bytes,
    and ``cuda``: per device, the memory torch's allocator holds and the device's
    utilisation (see :func:`cuda_memory`)."""
    import psutil

    rss = psutil.Process().memory_info().rss
    return {"cpu_percent": cpu_percent(), "memory_rss": rss, "cuda": cuda_memory()}


def cuda_memory() -> list[dict[str, Any]]:
    """Per CUDA device this process uses: ``allocated`` and ``reserved`` bytes (torch's
    caching allocator) and ``utilization`` (%, ``None`` without NVML). Empty where this
    process has not initialised CUDA: asking would create a CUDA context in it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        try:
            utilization: int | None = int(torch.cuda.utilization(index))
        except Exception:  # no NVML (pynvml) here: the memory figures stand alone
            utilization = None
        devices.append(
            {
                "device": f"cuda:{index}",
                "allocated": int(torch.cuda.memory_allocated(index)),
                "reserved": int(torch.cuda.memory_reserved(index)),
                "utilization": utilization,
            }
        )
    return devices


def raise_open_file_limit() -> None:
    """Lift the kernel's soft limit on open files to its hard limit (capped at 65536).

    torch 2.13's TensorPipe agent keeps its pipe to every worker that left a dynamic group:
    4 sockets with the "uv" transport, 24 shared-memory descriptors with "shm", per worker
    the kernel called, for every %rpc_init; under a common soft limit of 1024 re-runs end
    in "too many open files". nbrpc cannot close torch's pipes, so it makes room.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """The stop button's interrupt (SIGINT) held until the block ends, then delivered:
    for a step that starts processes and records them, whose cleanup must know everything
    it started (a press inside ``subprocess.Popen``, or while ipyparallel's thread starts
    a controller, left processes that nothing stopped). Keep the block short: the stop
    waits for it. Elsewhere than the main thread, which gets no signal, it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[tuple[int, Any]] = []
    # _signal's own function: signal.signal converts both handlers to and from enums, 14
    # against 0.7 µs a pair here, and every send through TensorPipe on the main thread
    # holds twice (nbrpc._wire.cancelling.sends_held)
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: pressed.append((signum, frame)))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
    if pressed:
        if callable(previous):
            previous(*pressed[0])
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt  # (SIG_IGN: the process ignores the interrupt)
