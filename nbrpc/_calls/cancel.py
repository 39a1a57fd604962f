"""The stop button stops the work it started: the caller's side of cancelling.

When the stop button ends a cell (its ``KeyboardInterrupt`` seen in one of nbrpc's
waits, or, for a cell stopped anywhere else, IPython's ``post_run_cell``) or a script's
Ctrl-C ends an nbrpc wait, :func:`stop_pressed` cancels the calls of the main thread's
current cell (their *origins*, :mod:`nbrpc._wire.cancelling`) in every process of the
cluster: those the cell made, still running or not started yet, and the calls they made
in turn. The
kernel asks each worker through its engine (ipyparallel's channel, served on the
worker's main thread, which busy RPC threads do not hold), so a worker whose every RPC
thread is busy is reached too. Then:

* one line per cancelled function and worker is printed in the cell;
* a call that did not end within :data:`nbrpc._wire.cancelling.GRACE_S` (inside C code,
  or catching ``BaseException``) is named at once, and :data:`REPORT_AFTER_S` after the
  stop, if it still runs, the cell shows its stack and how to restart its worker.

:func:`cancel` does the same for one future (``nbrpc.cancel(fut)``), from any thread.
Calls made from other threads than the main one, and futures of earlier cells, are left
alone (docs/errors.md).
"""

from __future__ import annotations

import collections
import contextvars
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbrpc import _process, _timers
from nbrpc._errors import library_dirs, show_short
from nbrpc._wire import cancelling

#: seconds after the stop at which calls still running are shown with their stacks
REPORT_AFTER_S = 5.0

#: ``broadcast(ranges, grace, ask)`` -> ``{process name: rows}`` (set by the lifecycle
#: while a cluster is up): :func:`nbrpc._wire.cancelling.cancel` in every process, the
#: kernel included
Broadcast = Callable[[cancelling.Ranges, float, bool], dict[str, list[dict[str, Any]]]]


@dataclass
class _Cancel:
    broadcast: Broadcast | None = None
    #: ``stacks(name)`` -> the process's thread rows (nbrpc.stacks), for the late report
    stacks: Callable[[str], list[dict[str, Any]]] | None = None


_cancel = _Cancel()


def set_cluster(broadcast: Broadcast | None, stacks: Any = None) -> None:
    """A cluster is up (its broadcast) or gone (None)."""
    _cancel.broadcast, _cancel.stacks = broadcast, stacks


def new_cell(*_: Any) -> None:
    """A cell starts: its calls get origins of their own (IPython's ``pre_run_cell``)."""
    cancelling.next_cell()


@dataclass
class _Watched:
    cells: bool = False


_watched = _Watched()


def watch_cells() -> None:
    """In an IPython kernel, once: each cell's calls are its own, and a cell the stop
    button ended has them cancelled (IPython's events)."""
    ipython = _process.shell()
    if ipython is None or _watched.cells:
        return
    _watched.cells = True
    ipython.events.register("pre_run_cell", new_cell)
    ipython.events.register("post_run_cell", cell_ended)


def cell_ended(result: Any) -> None:
    """IPython's ``post_run_cell``: a cell the stop button ended outside nbrpc's waits
    (``time.sleep`` after ``rpc_async``) has its calls cancelled too. The interrupt's
    traceback, which IPython keeps until the next error, lets go of nbrpc's frames: they
    hold the objects waited on (an RRef whose creation was cancelled would stay owned)."""
    stop = getattr(result, "error_in_exec", None)
    if isinstance(stop, KeyboardInterrupt):
        stop_pressed()
        _drop_library_frames(stop.__traceback__)


def _drop_library_frames(tb: Any) -> None:
    """Cut ``tb`` after the user's last frame before the libraries' (nbrpc's, torch's)."""
    libraries, users = library_dirs(), None
    while tb is not None:
        library = os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(libraries)
        if users is not None and library:
            users.tb_next = None
            return
        if not library:
            users = tb
        tb = tb.tb_next


def stop_pressed() -> None:
    """The main thread was stopped: cancel its cell's calls everywhere, say what stopped."""
    origins = cancelling.cell_origins()
    if origins is None or _cancel.broadcast is None:
        return  # no call since the cell started (or since the last cancel)
    cancelling.next_cell()  # calls made from now on are not this cancel's
    _report(_cancel.broadcast([origins], cancelling.GRACE_S, False), origins)


def calls_text(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``"spin on worker1 (16 calls)"`` per function and process in ``rows`` (as
    :func:`nbrpc._wire.cancelling.cancel` returns them, by process name)."""
    counts = collections.Counter((r["name"], worker) for worker, mine in rows.items() for r in mine)
    return [
        f"{name} on {worker}" + (f" ({n} calls)" if n > 1 else "")
        for (name, worker), n in counts.items()
    ]


def _report(rows: dict[str, list[dict[str, Any]]], origins: tuple[int, int]) -> None:
    stopped = {w: [r for r in mine if r["stopped"]] for w, mine in rows.items()}
    running = {w: [r for r in mine if not r["stopped"]] for w, mine in rows.items()}
    running = {w: mine for w, mine in running.items() if mine}
    lines = [f"nbrpc: cancelled {text}" for text in calls_text(stopped)]
    for worker, mine in running.items():
        sending = ", ".join(sorted({r["name"] for r in mine if r.get("sending")}))
        names = ", ".join(sorted({r["name"] for r in mine if not r.get("sending")}))
        if sending:  # the stop waits for a send (nbrpc._wire.cancelling.sends_held)
            lines.append(
                f"nbrpc: cancelling {sending} on {worker}: it is sending a call (its arguments"
                " are being pickled), and stops as soon as the call is handed to torch."
            )
        if names:
            lines.append(
                f"nbrpc: cancelling {names} on {worker}: it still runs, inside C code"
                " (time.sleep, a long operation) or catching BaseException, and stops at its"
                f" next Python line. If it still runs {REPORT_AFTER_S:g} s after the stop, this"
                " cell shows its stack."
            )
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
    if running:
        context = contextvars.copy_context()  # the cell's: the late report goes there
        # the report asks every process and reads stacks (seconds at most): on a thread
        # of its own, not the timer service's, whose deadlines must not wait for it
        _timers.after(
            REPORT_AFTER_S - cancelling.GRACE_S,
            _timers.on_its_own_thread,
            context.run,
            _late_report,
            origins,
        )


def _late_report(origins: tuple[int, int]) -> None:
    broadcast, stacks = _cancel.broadcast, _cancel.stacks
    if broadcast is None:
        return
    try:
        still = broadcast([origins], 0.0, True)
    except Exception:
        return
    lines = []
    for worker, rows in still.items():
        if not rows:
            continue
        frames = _frames(stacks, worker, {r["thread"] for r in rows})
        names = ", ".join(sorted({r["name"] for r in rows}))
        lines.append(
            f"nbrpc: {names} on {worker} still runs {REPORT_AFTER_S:g} s after the stop "
            f"button; it ends when its C code returns to Python.{frames}\n"
            f"  To stop it now: %rpc_restart {worker} (a new process under the same name; "
            "its state is lost)."
        )
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def _frames(stacks: Any, worker: str, threads: set[int]) -> str:
    if stacks is None:
        return ""
    try:
        (row,) = stacks(worker)
    except Exception:
        return ""
    out: list[str] = []
    libraries = library_dirs()  # nbrpc's, IPython's, torch's: not the user's frames
    for t in row["threads"]:
        if t["thread"] in threads:
            frames = [f for f in t["frames"] if not f["file"].startswith(libraries)][-4:]
            out.extend(f"\n    {f['file']}:{f['line']} in {f['function']}" for f in frames)
    return "\n  Its stack (innermost last):" + "".join(out) if out else ""


def cancel(*futures: Any) -> int:
    """Cancel the calls behind ``futures`` (futures nbrpc's ``rpc_async`` returned) where
    they run, with the calls they made, from any thread; how many had not finished.
    Their ``wait()`` then raises :class:`~nbrpc.CallCancelledError`. ``futures`` that are
    done, or that nbrpc did not start (torch's own), are left alone. Raises ``TypeError``
    for anything that is not a future, before it cancels any."""
    wrong = [f for f in futures if not callable(getattr(f, "done", None))]  # torch's too
    if wrong:
        error = TypeError(
            f"nbrpc.cancel takes the futures nbrpc.rpc_async returned, not {_kind(wrong[0])}: "
            "nbrpc.cancel(fut) or nbrpc.cancel(*futs). A cell's own calls are cancelled by "
            "the stop button."
        )
        show_short(error)  # the cell's line and the error, not this module's frames
        raise error
    pending = [f for f in futures if not f.done() and getattr(f, "origin", None) is not None]
    if not pending or _cancel.broadcast is None:
        return 0
    _cancel.broadcast([(f.origin, f.origin) for f in pending], cancelling.GRACE_S, False)
    deadline = time.monotonic() + cancelling.GRACE_S
    while not all(f.done() for f in pending) and time.monotonic() < deadline:
        time.sleep(0.005)
    return len(pending)


def _kind(value: Any) -> str:
    """``"42 (an int)"``, ``"a list"``: what was given, in a few words."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" or kind == "RRef" else "a"
    if isinstance(value, (int, float, str, bytes)) and len(repr(value)) <= 20:
        return f"{value!r} ({article} {kind})"
    return f"{article} {kind}"


cancelling.on_stop(stop_pressed)
