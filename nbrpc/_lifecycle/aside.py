"""A cluster's workers reached past their RPC threads: the stop button's cancel and
``%rpc_status``'s figures, while every RPC thread is busy or calls are queued.

A question by RPC waits behind the calls queued before it. This asks each worker of this
host at its side door (:mod:`nbrpc._wire.side_door`: a socket beside its lanes, a thread
of its own) and the others through their engines (ipyparallel, served on the worker's
main thread, which busy RPC threads do not hold, though a worker whose every thread runs
Python hands it the GIL slowly: seconds, measured).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbrpc import _engines, _states
from nbrpc._calls import cancel
from nbrpc._gather import census
from nbrpc._wire import cancelling, lanes, side_door

from .booted import Booted

#: beyond a cancel's grace: how long it waits for a worker to answer
CANCEL_REACH_S = 3.0


class Aside:
    """The workers of one cluster (``booted.roster``: their engines, kept current by
    restarts), the kernel ``self_name`` among the processes a cancel reaches."""

    def __init__(self, engines: _engines.Engines, booted: Booted, self_name: str) -> None:
        self.engines, self.booted, self.self_name = engines, booted, self_name

    def keep_doors_open(self, close: bool = False, renew: Iterable[str] = ()) -> None:
        """Connect to this host's workers' side doors now, while they are idle (a
        connection made when a question comes takes the GIL once more there), or close
        the connections (``close``: the cluster is gone). ``renew``: workers a restart
        replaced, whose new process opened a door at the same path."""
        directory = lanes.directory()
        if close or directory is None:
            side_door.forget_kept()
            return
        paths = [side_door.path_of(directory, n) for n in self.booted.roster.engines()]
        renewed = [side_door.path_of(directory, n) for n in renew]
        side_door.keep_open([p for p in paths if os.path.exists(p)], renew=renewed)

    def on_worker_change(self, change: _states.WorkerChange) -> None:
        """Listens to :mod:`nbrpc._states` while the cluster is ready: the doors follow
        the workers. Once joined workers settled, their doors are open (a restart's fresh
        process opened its door at the old path: renewed); a worker that left at a scale
        closed its own."""
        if change.kind is _states.Change.SETTLED:
            self.keep_doors_open(renew=change.names)
        elif change.kind is _states.Change.LEFT and change.at:
            self.keep_doors_open()

    def ask(
        self, names: list[str], question: str, func: Callable[..., Any], args: tuple, timeout: float
    ) -> dict[str, Any]:
        """``func(*args)`` in the workers ``names`` (``question`` names ``func`` at a side
        door), all in parallel: the answers by name, within ``timeout``."""
        names = [n for n in names if n not in _states.unreachable]
        found: dict[str, Any] = {}
        directory = lanes.directory()
        if directory is not None:
            doors = {n: side_door.path_of(directory, n) for n in names}
            doors = {n: path for n, path in doors.items() if os.path.exists(path)}
            found.update(side_door.ask(doors, question, args, timeout))
        asked = {}
        # ipyparallel's client is the main thread's (a late report asks from a timer's)
        by_engine = threading.current_thread() is threading.main_thread()
        engine_of = self.booted.roster.engines()
        for name in names:
            eid = engine_of.get(name)
            if eid is None or name in found or not by_engine:
                continue
            with contextlib.suppress(Exception):  # an engine ipyparallel lost meanwhile
                asked[name] = self.engines.apply(eid, func, *args)
        deadline = time.monotonic() + timeout
        for name, ar in asked.items():
            with contextlib.suppress(Exception):
                found[name] = ar.get(timeout=max(0.1, deadline - time.monotonic()))
        return found

    def figures(self, names: list[str], args: tuple, timeout: float) -> dict[str, Any]:
        """:func:`nbrpc._gather.census.busy_figures` of ``names`` (``%rpc_status``)."""
        return self.ask(names, "figures", census.busy_figures, args, timeout)

    def cancel(
        self, ranges: cancelling.Ranges, grace: float, ask: bool
    ) -> dict[str, list[dict[str, Any]]]:
        """:func:`nbrpc._wire.cancelling.cancel` in every live process, the kernel's own
        RPC threads included: its rows by process name."""
        here = cancelling.cancel(ranges, 0.0, ask)  # the kernel's: interrupted, not waited on
        names = list(self.booted.roster.engines())
        found = self.ask(
            names, "cancel", cancelling.cancel, (ranges, grace, ask), grace + CANCEL_REACH_S
        )
        # the kernel's, meanwhile: which still run (its RPC threads had the workers' time)
        still = {r["thread"] for r in cancelling.cancel(ranges, 0.0, True)} if here else set()
        for row in here:
            row["stopped"] = row["thread"] not in still
        return {self.self_name: here, **found}

    def cancel_everything(self) -> None:
        """The stop button during a shutdown: every call still running is cancelled."""
        with contextlib.suppress(Exception):
            self.cancel(cancelling.EVERYTHING, cancelling.GRACE_S, False)
        print(
            "nbrpc: the stop button during shutdown: the calls still running were "
            "cancelled and the workers stopped without waiting; %rpc_init starts anew.",
            file=sys.stderr,
        )

    def say_waiting(self, left: float) -> None:
        """A graceful shutdown waits on calls: the cell says which, for how long at most,
        and that the stop button cancels them."""
        try:
            rows = self.cancel(cancelling.EVERYTHING, 0.0, True)
        except Exception:
            rows = {}
        running = cancel.calls_text(rows)
        print(
            f"nbrpc: shutdown waits up to {left:.0f} s for the calls still running"
            + (f": {', '.join(running)}" if running else "")
            + ". The stop button cancels them and shuts down at once.",
            file=sys.stderr,
            flush=True,
        )
