"""Engines on this host: forked from a process that imported torch once, kept warm.

The source of a local cluster (``%rpc_init -n 2``). ipyparallel launches, watches and
stops every engine; what this module changes (measured on 2 cores, ipyparallel 9):

- Every engine would import torch itself (1.8 s of CPU each here). Here one process, the
  zygote (:mod:`.zygote`), imports it once while the controller comes up, and every engine
  is a fork of it, through :class:`.forked.ForkedEngineSetLauncher`. A cluster of N
  workers is N engines, the controller, its heart monitor, the zygote and the watchdog:
  N + 4 processes (ipyparallel's defaults: 2N + 10).
- torch cannot ``init_rpc`` twice in one process, so a worker's engine is never reused.
  After a shutdown the controller stays, and up to :data:`SPARES_MAX` fresh engines are
  started in the background (torch imported, registered, idle: blocked in zmq, no CPU),
  so the next ``%rpc_init`` only joins them. ``nbrpc.shutdown(release=True)``
  (``%rpc_shutdown --release``) stops the controller and the spares at once; so does
  interpreter exit, and the watchdog does it when the kernel dies.
- The first cluster need not wait either: ``%load_ext nbrpc`` calls :func:`prewarm`,
  which starts the controller, the zygote and :data:`PREWARM_SPARES` spares in a
  background thread while the person reads and types the next cell (never on
  ``import nbrpc``). An ``init`` that comes before they are ready waits for that thread
  (:func:`_wait_for_warming`) rather than starting a second controller.

The controller's own settings (heartbeats, threads) are in :mod:`.controller`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from nbrpc import _options, _process
from nbrpc._errors import BootError, ConfigError, counted
from nbrpc._views import bytes_text
from nbrpc._wire import shm, stacks

from . import controller, watchdog
from .controller import ENGINE_ARGS, Controller, ControllerSource, last_words, tail
from .forked import KERNEL_ENV, MARKS_ENV, ZYGOTE_TIMEOUT_S, ForkedEngineSetLauncher, Zygote
from .watchdog import process_alive

log = logging.getLogger("nbrpc")

SPARES_MAX = 8
#: The memory one more worker on this host needs at least, for a count that cannot fit to
#: be refused before anything forks: an idle forked worker measured 32 MB of its own and
#: 84 MB with its share of the zygote's pages (torch's, shared until written), and its
#: first calls add to that. ``%rpc_init -n 100000`` forked ~720 engines, then the
#: out-of-memory killer took the kernel.
WORKER_MEMORY_BYTES = 100 * 2**20
#: Spares :func:`prewarm` starts: ``%rpc_init``'s default ``-n``. A first cluster of more
#: starts the rest at its boot; one of fewer leaves the others as spares for the next.
PREWARM_SPARES = 2


class LocalController(Controller):
    """A controller on this host and the engines it runs; kept between clusters.

    ``listen``: the controller's address (loopback unless the cluster opens to other
    hosts). ``python``: the interpreter engines run. A cluster asking for either one
    differently gets a new :class:`LocalController` (the old one is released).
    """

    def __init__(self, listen: str | None, python: str) -> None:
        self.listen = listen
        self.python = python
        workdir = tempfile.mkdtemp(prefix="nbrpc-launch-")
        # loopback unless --listen opens it
        super().__init__(listen or "127.0.0.1", workdir, ForkedEngineSetLauncher)
        self._launchers: dict[int, Any] = {}  # pid -> launcher of every engine still ours
        # pid -> (its log, open, and the log's size when it started): kept after the
        # engine died. Open, because ipyparallel removes an engine's log as it sees the
        # engine stop (``_log_output``), racing with the kernel's read of its last words:
        # a crash report read by path was there in one run and gone in the next.
        self._logs: dict[int, tuple[int, int]] = {}
        self._handed_out: set[int] = set()  # engine ids given to a cluster: never again
        self._watch()  # the watchdog first: a kernel killed from here on leaves nothing
        # then the zygote: a bad interpreter fails here, before the controller starts
        try:
            self.zygote = Zygote(python, self._workdir)  # imports torch meanwhile
        except BaseException:
            self._stop_watchdog()
            raise
        self._start_controller()

    @property
    def key(self) -> tuple[str | None, str]:
        return (self.listen, self.python)

    # -- engines ---------------------------------------------------------------------

    def _fork(self, n: int) -> None:
        """Start ``n`` engines now; they register in the background."""
        if n <= 0:
            return
        # the stop button while ipyparallel starts them left a set half started (the next
        # start finished it), or started but not recorded: engines nobody counted, and a
        # cluster of 2 ran 4. Held until they are recorded here.
        with _process.interrupts_deferred():
            try:
                set_id = self._ipp.start_engines_sync(
                    n,
                    zygote=self.zygote,
                    engine_args=list(ENGINE_ARGS),
                    delay=0,
                    environment={MARKS_ENV: self._workdir, KERNEL_ENV: str(os.getpid())},
                )
            except OSError as exc:
                raise BootError(f"could not start an engine: {exc}") from exc
            for launcher in self._ipp.engines[set_id].launchers.values():
                self._launchers[launcher.pid] = launcher
                fd = os.open(launcher.output_file, os.O_RDONLY | os.O_CREAT, 0o600)
                self._logs[launcher.pid] = (fd, os.fstat(fd).st_size)
            self._watch()

    def last_output(self, pid: int) -> str:
        """What engine ``pid`` printed last (see :func:`last_words`); "" if nothing."""
        fd, start = self._logs.get(pid, (-1, 0))
        if fd < 0:
            return ""
        words = last_words(fd, start)
        deadline = time.monotonic() + DYING_S
        while not words and process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # still dying: its report may be on its way to the log
            words = last_words(fd, start)
        return words

    def _forget_log(self, pid: int) -> None:
        fd, _ = self._logs.pop(pid, (-1, 0))
        if fd >= 0:
            os.close(fd)

    def _spare_ids(self) -> list[int]:
        return [i for i in sorted(self.client().ids) if i not in self._handed_out]

    def _starting(self) -> int:
        """Engines launched and running that the controller has not registered yet."""
        running = sum(1 for la in self._launchers.values() if la.state == "running")
        registered = len(self.client().ids)
        return max(0, running - registered)

    def spawn(self, n: int) -> None:
        """Make sure ``n`` unused engines are registered or on their way: spares count,
        the rest are forked now."""
        if self._client is None:
            have = sum(1 for la in self._launchers.values() if la.state == "running")
        else:
            have = len(self._spare_ids()) + self._starting()
        self._fork(n - have)

    def take(self, n: int, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Wait for ``n`` unused registered engines and hand them out (never again).

        An engine that exits before it registers (a bad interpreter, an import error) is
        a :class:`BootError` at once, with the end of the engine's own output.
        """
        self.spawn(n)
        deadline = time.monotonic() + timeout
        while True:
            spare = self._spare_ids()
            registered(len(spare))
            if len(spare) >= n:
                ids = spare[:n]
                self._handed_out.update(ids)
                return ids
            if self._raise_if_an_engine_failed():
                self.spawn(n)  # a spare died while idle: start another
            if time.monotonic() > deadline:
                raise BootError(
                    f"only {len(spare)} of {n} engines registered with the controller "
                    f"within {timeout:.0f} s. Engine logs: {self.log_dir}"
                )
            time.sleep(0.02)

    @property
    def log_dir(self) -> str:
        return os.path.join(self._ipp.profile_dir, "log")

    def _raise_if_an_engine_failed(self) -> bool:
        """Drop engines that exited; raise if one never got through its imports.

        Returns whether any was dropped (a spare that died is replaced by the caller).
        """
        dropped = False
        for pid, launcher in list(self._launchers.items()):
            if launcher.state != "after" and process_alive(pid):
                continue
            del self._launchers[pid]
            self._forget_log(pid)
            dropped = True
            if os.path.exists(os.path.join(self._workdir, str(pid))):
                continue  # it had started: a spare that was killed, not a bad start
            self._watch()
            raise BootError(
                f"an engine failed to start (pid {pid}, forked from {self.python} -m "
                f"nbrpc._engines.zygote). Its output:\n{tail(launcher.get_output())}"
            )
        if dropped:
            self._watch()
        return dropped

    def retire(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop engines a cluster used: ask them to exit, then signal what is left. With
        the controller gone no request reaches them: they are signalled at once (a
        release waited its whole 5 s for them before)."""
        if not engine_ids and not pids:
            return
        asked = self._controller_runs()
        if asked:
            self.ask_to_exit(engine_ids)
        deadline = time.monotonic() + (controller.ENGINE_EXIT_WAIT_S if asked else 0.0)
        while time.monotonic() < deadline and any(process_alive(p) for p in pids):
            time.sleep(0.02)
        for pid in pids:
            self._forget_log(pid)
            launcher = self._launchers.pop(pid, None)
            if launcher is not None:  # its log goes with it (a kept controller's piled up)
                with contextlib.suppress(OSError):
                    os.unlink(launcher.output_file)
            if process_alive(pid) and launcher is not None:
                watchdog.reap([pid])
        self._forget_stopped_sets()
        self._watch()
        stacks.sweep()  # a killed engine leaves its stack files
        for pid in [p for p in pids if not process_alive(p)]:  # their arenas' pages are memory
            watchdog.sweep_segments(f"{shm.prefix()}-arena-{pid}")  # (kept till the shutdown)

    def warm(self, n: int) -> None:
        """Keep up to ``n`` spare engines (at most :data:`SPARES_MAX`), started now."""
        self.spawn(min(n, SPARES_MAX))

    def registered_spares(self) -> int:
        """Spare engines that are registered and idle: the next ``init`` only joins them."""
        return len(self._spare_ids()) if self._client is not None else 0

    def spares(self) -> int:
        """Spare engines registered or starting (for tests and the summary)."""
        if self._client is None:
            return sum(1 for la in self._launchers.values() if la.state == "running")
        return len(self._spare_ids()) + self._starting()

    def pids(self) -> list[int]:
        """Every process of this controller and its engines that is still alive."""
        pids = [p for p in self._launchers if process_alive(p)]
        if hasattr(self, "zygote") and self.zygote.proc.poll() is None:
            pids.append(self.zygote.pid)
        return pids + self.controller_pids()

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        """Read on this host: one engine per pid."""
        found = stacks.collect(pids, timeout)
        return {eid: found[pid] for eid, pid in zip(engine_ids, pids, strict=True)}

    def _forget_stopped_sets(self) -> None:
        for set_id, engine_set in list(self._ipp.engines.items()):
            if all(la.state == "after" for la in engine_set.launchers.values()):
                self._ipp.engines.pop(set_id, None)

    # -- release -------------------------------------------------------------------------

    def release(self) -> None:
        """Stop every engine (spares included), the controller and the watchdog."""
        self.zygote.close()
        # every process at once (ipyparallel stops them one after another, ~4 s here)
        self._stop_processes()
        try:
            self._ipp.stop_cluster_sync()  # finds them stopped
        except Exception as exc:
            log.warning("stopping ipyparallel's controller and engines: %s", exc)
        self._launchers.clear()
        for pid in list(self._logs):
            self._forget_log(pid)
        self._stop_watchdog()
        # the cluster file and connection files (ipyparallel's stop left them when it
        # failed: at interpreter exit its event loop may be gone, one set per such exit)
        watchdog.remove_cluster_files(self.cluster_file)
        stacks.sweep()  # the stopped engines' stack files
        self._stop_loop()


#: How long the last words of an engine that still exists are waited for (a call that
#: lost it may fail a moment before its process is gone).
DYING_S = 0.5


KEPT = "kept from the last cluster"
WARMED = "warmed up at %load_ext"


@dataclass
class _Kept:
    """This kernel's controller, zygote and spare engines, kept between clusters."""

    controller: LocalController | None = None
    #: how the kept controller came to be there (KEPT or WARMED), said by the next boot
    origin: str = ""
    #: set as prewarm's thread ends; None when no warm-up was started or it was waited for.
    #: An event, not the thread's is_alive(): on Python 3.11 a stop that lands in
    #: ``Thread.join`` can leave the thread marked stopped while it runs on, and the next
    #: %rpc_init started a second controller, zygote and watchdog beside the warm-up's
    #: (issue 66's fourth finding)
    warming: threading.Event | None = None
    #: what prewarm's thread hit, if it failed (the next boot starts afresh, and says)
    warm_error: str = ""
    #: seconds prewarm took, from %load_ext to spares registered
    warm_seconds: float | None = None


_kept = _Kept()


def kept() -> LocalController | None:
    """The controller kept from the last cluster (and its spares), if any."""
    return _kept.controller


def prewarm(spares: int = PREWARM_SPARES) -> bool:
    """Start this host's controller, zygote and ``spares`` engines in a background thread;
    returns at once. False (nothing started) when a controller is kept or warming already.

    Costs, measured in ``make bench``: see docs/benchmarks.md (idle CPU, memory). The
    watchdog stops them if the kernel dies; interpreter exit and
    ``%rpc_shutdown --release`` stop them as they stop a kept controller.
    """
    if _kept.controller is not None or _kept.warming is not None:
        return False
    t0 = time.monotonic()

    done = threading.Event()

    def warm() -> None:
        ours = None
        try:
            ours = LocalController(None, sys.executable)
            ours.client()  # connected now, not at the first init
            ours.warm(spares)
            deadline = time.monotonic() + ZYGOTE_TIMEOUT_S
            while ours.registered_spares() < min(spares, SPARES_MAX):
                if time.monotonic() > deadline or ours._raise_if_an_engine_failed():
                    break  # the first init waits for them, or says why they failed
                time.sleep(0.05)
            _kept.warm_seconds = time.monotonic() - t0
            _kept.controller, _kept.origin = ours, WARMED
        except BaseException as exc:  # an init after it starts afresh and reports its own
            _kept.warm_error = f"{type(exc).__name__}: {exc}"
            log.debug("nbrpc: warming up failed: %s", _kept.warm_error)
            if ours is not None:
                with contextlib.suppress(Exception):
                    ours.release()
        finally:
            done.set()

    _kept.warm_error = ""
    _kept.warming = done
    threading.Thread(target=warm, name="nbrpc-prewarm", daemon=True).start()
    return True


def _wait_for_warming() -> None:
    """Wait for prewarm's thread to end, if it was started (in short waits: the stop
    button works, and a stop leaves the warm-up to be waited for by the next boot)."""
    done = _kept.warming
    while done is not None and not done.wait(0.05):
        pass
    _kept.warming = None


def release() -> None:
    """Stop this kernel's controller and every engine it runs (spares included)."""
    _wait_for_warming()
    ours, _kept.controller = _kept.controller, None
    if ours is not None:
        ours.release()


class LocalSource(ControllerSource[LocalController]):
    """Engines forked on this host from the kept controller's zygote (the default): the
    controller and spares stay between clusters (``stop`` keeps them)."""

    remote = False
    cannot_replace = ""
    cannot_scale = ""

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        return True  # the default, asked last

    @classmethod
    def release_kept(cls) -> None:
        release()

    @classmethod
    def check_room(cls, count: int) -> None:
        """Refuse ``count`` more workers than this host's available memory holds, at
        :data:`WORKER_MEMORY_BYTES` each, with the machine's figures and what to do."""
        memory = psutil.virtual_memory()
        fits = memory.available // WORKER_MEMORY_BYTES
        if count <= fits:
            return
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        need = bytes_text(count * WORKER_MEMORY_BYTES)
        raise ConfigError(
            f"{counted(count, 'worker')} {'does' if count == 1 else 'do'} not fit on this host: "
            "each needs at least "
            f"{bytes_text(WORKER_MEMORY_BYTES)} of memory ({need} in all), and it has "
            f"{bytes_text(memory.available)} available of {bytes_text(memory.total)}"
            + (f" and {cpus} cores" if cpus else "")
            + f", room for at most {fits} more. Nothing was started. Ask for fewer, or place "
            "workers on other machines (--hosts, --slurm)."
        )

    def start(self) -> None:
        _wait_for_warming()  # a controller warming up is this one, or is released below
        if _kept.warm_error:  # said once, by the boot that starts afresh in its place
            self.afresh_because = f"the warm-up at %load_ext failed: {_kept.warm_error}"
            _kept.warm_error = ""
        key = (self.settings.listen, self.settings.python)
        ours = _kept.controller
        self.reused = _kept.origin if ours is not None and ours.key == key else ""
        if ours is not None and not self.reused:
            release()  # another interpreter or address: what was kept cannot serve
        if _kept.controller is None:
            with _process.interrupts_deferred():  # kept, so that a stop's cleanup finds it
                _kept.controller = LocalController(*key)
        _kept.origin = KEPT  # for the next cluster, if this one keeps it
        self.controller = _kept.controller

    def import_seconds(self) -> float | None:
        return 0.0 if self.reused else (self._ours().zygote.ready_seconds or 0.0)

    def last_output(self, pid: int) -> str:
        return self._ours().last_output(pid)

    def stop(self, engine_ids: list[int], pids: list[int], keep_warm: bool) -> None:
        """Retire the engines; the controller stays (kept), with spares if asked."""
        ours = self.controller
        if ours is None:  # its start failed: nothing of it runs
            return
        ours.retire(engine_ids, pids)
        if keep_warm and engine_ids:
            ours.warm(len(engine_ids))

    def replace(self, engine_ids: list[int], pids: list[int], timeout: float) -> list[int]:
        """Kill them (a restart is for a worker that is broken or stuck: no waiting for a
        graceful exit), then fork as many new ones (a spare if one is registered)."""
        ours = self._ours()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ours.retire(engine_ids, pids)
        return ours.take(len(engine_ids), timeout, lambda *_: None)

    def grow(
        self, n: int, hosts: tuple[str, ...], timeout: float, registered: Callable[..., None]
    ) -> list[int]:
        """Forks of the zygote (registered spares first)."""
        return self._ours().take(n, timeout, registered)

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        self._ours().retire(engine_ids, pids)
