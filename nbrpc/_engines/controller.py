"""The ipyparallel controller nbrpc runs on this host, and the watchdog that stops its
processes should the kernel die.

The local source (:mod:`.local`: engines forked here) and the ssh source (:mod:`.ssh`:
engines on other hosts) both start one. What nbrpc changes from ipyparallel's defaults,
measured on 2 cores with ipyparallel 9 (where they put a notebook user's 8–9 s per
``%rpc_init``):

- An engine counts as registered only after the controller's heart monitor has seen its
  first heartbeat, and ``HeartMonitor.period`` is 3000 ms. Here it is
  :data:`HEARTBEAT_MS` (500). The engine's heart is a zmq device thread that echoes pings
  in C without the GIL, so a worker busy in Python or in a long C++ op still answers
  (tested); a killed engine is declared dead after :data:`HEARTBEAT_MISSES` silent periods.
  The monitor looked at a new heart's answer only at its next ping, one to two periods
  after the heart started; the controller's process (:mod:`.controller_process`) counts
  the engine registered at the first answer.
- ``Cluster.delay`` sleeps 1 s between controller and engines, and by default engines
  start only once the controller wrote its connection file. Here both start at once.
- The controller forks about 8 processes (queues, schedulers, broadcast tree);
  ``IPController.use_threads`` runs them as threads. Engines run without ipyparallel's
  nanny process: nbrpc never signals engines through ipyparallel.

An engine's output is read here too: :func:`tail`, and :func:`last_words` (the report of
a crash in its log, for a ``WorkerDiedError``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import psutil

from nbrpc import _options
from nbrpc._errors import BootError

from . import controller_process, watchdog
from .base import EngineSource

log = logging.getLogger("nbrpc")

#: The controller's heartbeat period. ipyparallel's 3000 ms makes every engine wait up to
#: two periods to count as registered. 500 ms measured here: idle CPU 0.3 % of a core for
#: the heart monitor and 0.1 % per engine (200 ms: 0.8 % and 0.4 %).
HEARTBEAT_MS = 500
#: The controller declares an engine dead after HEARTBEAT_MISSES + 1 silent periods (2 s;
#: measured 2.3 s from kill -9 to the client's notice). The engine's heart echoes pings
#: from a zmq thread in C, without the GIL: busy workers still answer (tested).
HEARTBEAT_MISSES = 3
#: An engine stops by itself after this many checks, every HEARTBEAT_MS + 500 ms, without
#: hearing the controller (10 s): engines do not outlive a controller that died.
ENGINE_ORPHAN_MISSES = 10
CONTROLLER_TIMEOUT_S = 60.0
#: the client asks the controller again this often, and in between sees whether it still
#: runs: one that exited as it started is said at once, not after CONTROLLER_TIMEOUT_S
ANSWER_SLICE_S = 5.0
ENGINE_EXIT_WAIT_S = 5.0


#: What every engine nbrpc starts is told, here or on another host: no nanny process,
#: stdout/stderr that leave file descriptors 1 and 2 on the engine's log (see
#: ``zygote.EngineOutStream``), wait for the controller's connection file, and stop after
#: ENGINE_ORPHAN_MISSES heartbeats without the controller.
ENGINE_ARGS = (
    "--IPEngine.enable_nanny=False",
    "--IPEngine.out_stream_factory=nbrpc._engines.zygote.EngineOutStream",
    f"--IPEngine.wait_for_url_file={CONTROLLER_TIMEOUT_S:.0f}",
    f"--IPEngine.max_heartbeat_misses={ENGINE_ORPHAN_MISSES}",
)


class Controller:
    """An ipyparallel controller nbrpc runs on this host, and the watchdog that stops its
    processes should the kernel die. :class:`.local.LocalController` (engines here),
    :class:`.ssh.HostController` (engines over ssh) and :class:`.slurm.SlurmController`
    (a Slurm job's tasks) build on it.

    The controller tier: every controller writes :meth:`spawn`, :meth:`take` and
    :meth:`retire`, with these signatures, and may override :meth:`release`;
    :class:`ControllerSource` turns them into an engine source's ``launch``, ``take`` and
    ``stop``. ``tests/unit/test_layers.py`` holds every controller to these signatures.

    ``listen``: the controller's address. ``workdir``: a private directory of this
    controller's (the watchdog's pid file; removed at release). Subclasses add their own
    processes to :meth:`pids` and start the controller with :meth:`_start_controller`.
    """

    def __init__(self, listen: str, workdir: str, engine_launcher_class: type) -> None:
        import ipyparallel as ipp

        self._ipp = ipp.Cluster(
            controller_ip=listen,
            log_level=logging.ERROR,  # nbrpc reports failures itself, with advice
            shutdown_atexit=False,  # nbrpc's own atexit hook releases it (quietly)
            delay=0,
            send_engines_connection_env=False,  # engines wait for the file themselves
            engine_launcher_class=engine_launcher_class,
            controller_args=[
                "--IPController.use_threads=True",
                f"--HeartMonitor.period={HEARTBEAT_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            ],
        )
        self._client: Any = None
        #: ipyparallel's file of this cluster, kept here once it may no longer write it
        self._cluster_file = str(self._ipp.cluster_file)
        self._workdir = workdir
        self._pidfile = os.path.join(workdir, "pids")
        self._watcher: subprocess.Popen | None = None
        self.controller_seconds: float | None = None
        self._started = time.monotonic()
        #: the controller's log, open: ipyparallel removes it as it sees the controller stop,
        #: and a read by path after that found nothing (:meth:`_no_answer`; engines' logs,
        #: :class:`.local.LocalController`, are kept open for the same reason)
        self._log_fd = -1

    @property
    def cluster_file(self) -> str:
        """ipyparallel's file of this controller, in the profile's ``security`` directory
        (the watchdog removes it should the kernel die)."""
        return self._cluster_file

    @property
    def client_file(self) -> str:
        """ipyparallel's connection file for this controller's clients (the controller
        writes it once its hub listens; ipyparallel's launcher names it)."""
        return str(self._ipp.controller.connection_files["client"])

    @property
    def watchdog_pid(self) -> int | None:
        """The watchdog's pid, once started."""
        return self._watcher.pid if self._watcher is not None else None

    @property
    def pidfile(self) -> str:
        """The file where the watchdog reads which pids to stop."""
        return self._pidfile

    @property
    def controller_pid(self) -> int | None:
        return getattr(self._ipp.controller, "pid", None)

    @property
    def _marker(self) -> str:
        """How ipyparallel tells the controller (and every process it forks) its cluster."""
        return f"IPP_CLUSTER_ID={self._ipp.cluster_id}"

    def controller_pids(self) -> list[int]:
        """The controller and the processes it forked (its heart monitor), if running."""
        pid = self.controller_pid
        if not pid:
            return []
        pids = [pid]
        with contextlib.suppress(psutil.Error):
            pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        return pids

    def pids(self) -> list[int]:
        """Every process of this host that the watchdog stops should the kernel die."""
        return self.controller_pids()

    # -- the tier: what every controller writes -----------------------------------------

    def spawn(self, n: int) -> None:
        """Have ``n`` engines for the next :meth:`take` registered or on their way; they
        register in the background (returns once they are asked for)."""
        raise NotImplementedError

    def take(self, n: int, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Ids of ``n`` registered engines in worker order, never handed out again;
        ``registered(count)`` as engines arrive, or ``registered(count, note)`` with what
        they wait for (a job in Slurm's queue). ``timeout``: how long they may take to
        register (a source with a queue bounds the wait in it with its own options)."""
        raise NotImplementedError

    def retire(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop the engines a cluster used (``pids``: those of this host, where known);
        the controller stays up (:meth:`release` stops it)."""
        raise NotImplementedError

    def ask_to_exit(self, engine_ids: list[int]) -> None:
        """Ask the engines of ``engine_ids`` that ipyparallel still lists to exit (a
        retire's, a shrink's); their exit is waited for, or forced, by the caller."""
        if self._client is None or not engine_ids:
            return
        live = [i for i in engine_ids if i in self._client.ids]
        if live:
            try:  # not block=True: it would wait forever for a dead engine's reply
                self._client.shutdown(targets=live, hub=False, block=False)
            except Exception as exc:
                log.warning("asking engines to exit: %s", exc)

    def client(self) -> Any:
        """The ipyparallel client, connected once the controller is up."""
        if self._client is None:
            # ipyparallel's client waits 10 s for the controller's first answer; a controller
            # starting on a busy host took longer once ("Hub connection request timed out")
            deadline = time.monotonic() + CONTROLLER_TIMEOUT_S
            while self._client is None:
                left = deadline - time.monotonic()
                try:
                    self._client = self._ipp.connect_client_sync(
                        timeout=max(1.0, min(ANSWER_SLICE_S, left))
                    )
                except TimeoutError as exc:  # gone: said at once, not after the whole wait
                    if not self._controller_runs() or time.monotonic() >= deadline:
                        raise BootError(self._no_answer(exc)) from None
            self.controller_seconds = time.monotonic() - self._started
            self._watch()  # the controller's forks exist by now
        return self._client

    def _controller_runs(self) -> bool:
        pid = self.controller_pid
        return pid is not None and watchdog.process_alive(pid)

    def _no_answer(self, exc: BaseException) -> str:
        """What a kernel says when the controller never answered its client: what ipyparallel
        said, whether the controller runs, which of its ports it listens on against the
        one the client asked, and its log's end (removed at the release that follows)."""
        pid = self.controller_pid
        seen = [f"ipyparallel said: {exc}"]
        proc, state = None, "not started" if not pid else "gone"
        if self._controller_runs():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                state = proc.status()  # running, sleeping, stopped...
        seen.append(f"the controller (pid {pid}) is {state}")
        asked = _registration_port(self.client_file)
        if proc is not None and asked is not None:
            with contextlib.suppress(psutil.Error):
                listening = sorted(
                    c.laddr.port for c in proc.net_connections("tcp") if c.status == "LISTEN"
                )
                holder = "it" if asked in listening else _listener_of(asked)
                seen.append(f"the client asked port {asked}, listened on by {holder}")
        text = log_tail(self._log_fd) if self._log_fd >= 0 else ""
        if text:
            seen.append(f"its log:\n{tail(text, 12)}")
        if state == "gone" and "Address already in use" in text:
            why = (
                "the ipyparallel controller exited as it started: another process took a "
                "port it had chosen (ipyparallel picks free ports, then binds them a moment "
                "later). "
            )
        else:
            why = f"the ipyparallel controller did not answer within {CONTROLLER_TIMEOUT_S:.0f} s. "
        return (
            why
            + "; ".join(seen)
            + "\nRun %rpc_init again: nothing of this attempt is left running, and a new "
            "controller picks new ports. If it happens again, the host may be out of CPU or "
            "ports (docs/errors.md)."
        )

    def _start_controller(self) -> None:
        """Start the controller; a failure releases everything started so far."""
        try:  # ipyparallel's controller, an engine registered at its first heartbeat
            command = [sys.executable, controller_process.__file__]
            self._ipp.start_controller_sync(controller_cmd=command)
            log_file = self._ipp.controller.output_file
            self._log_fd = os.open(log_file, os.O_RDONLY | os.O_CREAT, 0o600)
            self._watch()
        except BaseException:
            self.release()
            raise

    def _watch(self) -> None:
        """Tell the watchdog which pids to stop should this kernel die (start it once)."""
        watchdog.write_pids(self._pidfile, self.pids())
        if self._watcher is None:
            self._watcher = subprocess.Popen(
                [
                    sys.executable,
                    watchdog.__file__,
                    str(os.getpid()),
                    self._pidfile,
                    self._marker,
                    self.cluster_file,
                ],
                start_new_session=True,  # not hit by the signal that kills the kernel's group
                stdin=subprocess.DEVNULL,
            )

    def _stop_processes(self) -> None:
        """Close the client and stop this controller's processes on this host, at once
        (every release's first step).

        Found by pid and by ipyparallel's cluster-id marker, as the watchdog finds them:
        a controller that died alone leaves its forked heart monitor, which no longer
        shows among its children (seen: two such processes outlived their kernels).

        ipyparallel writes the cluster's file no more from here on (an empty name is its
        off switch; the release removes the file). It rewrites the file whenever it sees a
        part of the cluster stop, on its event loop's thread, a moment after the stop:
        seeing the controller stop while an engine set still looked running (a Slurm job,
        cancelled), it wrote the file again after the release had removed it (two fresh
        runs of the suite on two workers left one each).
        """
        with contextlib.suppress(Exception):
            self._ipp.cluster_file = ""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        ours = self.pids() + watchdog.started_with(self._marker)
        watchdog.reap(sorted({p for p in ours if p != os.getpid()}))
        if self._log_fd >= 0:  # its log is read no more
            os.close(self._log_fd)
            self._log_fd = -1

    def release(self) -> None:
        """Stop the controller, whatever engines are left and the watchdog, and remove
        ipyparallel's files of this controller (a Slurm job's left its cluster file)."""
        self._stop_processes()
        self._stop_watchdog()
        watchdog.remove_cluster_files(self.cluster_file)
        self._stop_loop()

    def _stop_loop(self) -> None:
        """End the thread on which ipyparallel's ``Cluster`` runs its ``*_sync`` methods
        where an event loop already runs (a Jupyter kernel's): ipyparallel starts one per
        ``Cluster`` and nothing ever stops it, so each controller released left a thread
        and its event loop's epoll descriptor in the kernel (the soak, docs/soak.md: one
        more of each per ``%rpc_shutdown --release``). Its attributes are ipyparallel's
        own (``AsyncFirst``, no public close); absent, there is nothing to stop."""
        loop = getattr(self._ipp, "_thread_loop", None)
        thread = getattr(self._ipp, "_async_thread", None)
        if loop is None or thread is None:
            return
        loop.add_callback(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            with contextlib.suppress(Exception):
                loop.close()
            self._ipp._async_thread = None

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        """Every thread's stack of the engines, read on their hosts (see
        ``EngineSource.dump_stacks``); {} where this controller cannot reach them."""
        return {}

    def _stop_watchdog(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)  # alone, it would exit within 1 s
        if self._watcher is not None:
            self._watcher.terminate()
            self._watcher.wait()
            self._watcher = None
        # again: a process that was starting as the first removal ran (an engine writes
        # its mark file there as it starts, and removes it as it fails) left the folder
        # behind, empty (seen once after a whole test run)
        shutil.rmtree(self._workdir, ignore_errors=True)


C = TypeVar("C", bound=Controller)


class ControllerSource(EngineSource, Generic[C]):
    """A source whose engines come with a :class:`Controller` of this host (local, ssh,
    Slurm): ``start`` makes the controller (``controller``), and the rest is the
    controller tier's: ``launch`` is its :meth:`~Controller.spawn`, ``take`` its
    :meth:`~Controller.take`, ``stop`` its :meth:`~Controller.retire` then
    :meth:`~Controller.release` (a source that keeps its controller between clusters
    overrides ``stop``). By default its engines run on other hosts and import torch
    there; nothing is kept between clusters."""

    remote = True

    def __init__(self, settings: _options.Settings) -> None:
        super().__init__(settings)
        self.controller: C | None = None

    def _ours(self) -> C:
        assert self.controller is not None, "start() comes first"
        return self.controller

    def launch(self, n: int) -> None:
        self._ours().spawn(n)

    def client(self) -> Any:
        return self._ours().client()

    def take(self, n: int | None, timeout: float, registered: Callable[..., None]) -> list[int]:
        assert n is not None, "only an attached cluster's size can be unknown"
        return self._ours().take(n, timeout, registered)

    def stop(self, engine_ids: list[int], pids: list[int], keep_warm: bool) -> None:
        ours = self.controller
        if ours is None:  # its start failed: nothing of it runs
            return
        try:
            ours.retire(engine_ids, pids)
        finally:
            ours.release()
            self.controller = None

    def controller_seconds(self) -> float | None:
        return 0.0 if self.reused else self._ours().controller_seconds

    def controller_pid(self) -> int | None:
        return self._ours().controller_pid

    def dump_stacks(
        self, engine_ids: list[int], pids: list[int], timeout: float
    ) -> dict[int, dict[str, Any]]:
        return self._ours().dump_stacks(engine_ids, pids, timeout)


def _registration_port(client_file: str) -> int | None:
    """The port the client asks the hub on, from ipyparallel's client connection file."""
    import json

    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads(pathlib.Path(client_file).read_text())["registration"])
    return None


def _listener_of(port: int) -> str:
    """Which process listens on ``port`` of this host: a pid, or "nothing"."""
    with contextlib.suppress(psutil.Error):
        for c in psutil.net_connections("tcp"):
            if c.status == "LISTEN" and c.laddr.port == port:
                return f"pid {c.pid}" if c.pid else "another user's process"
    return "nothing"


def tail(text: str, lines: int = 25) -> str:
    """The last ``lines`` non-blank lines of an engine's output, indented for an error."""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(f"    {line}" for line in kept) or "    (no output)"


#: faulthandler's first line when a process gets a fatal signal (a segfault; an abort,
#: which is how C++ ends on an uncaught exception). Engines enable faulthandler.
_FATAL = "Fatal Python error: "
#: Lines that are not a dying process's own words: ipyparallel's log ("2026-11-22
#: 22:14:28.813 [IPEngine.0] ...") and torch's ("[E1122 23:09:46.506 file.cpp:561] ...",
#: errors of earlier calls that their callers already got).
_LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[|\[[EWIF]\d{4} )")
BEFORE_LINES, STACK_LINES = 4, 12
#: how much of a log's end is read for a crash report: faulthandler's report lists every
#: thread's stack (up to 100 frames each) and the extension modules after its first line,
#: which a 16 KB tail missed now and then in a worker with many threads (the report was
#: there, its first line before the tail: the error said nothing of the crash)
CRASH_TAIL_BYTES = 1 << 20


def log_tail(log: str | int, start: int = 0) -> str:
    """A log's end: its bytes ``start`` on, at most the last :data:`CRASH_TAIL_BYTES` (a
    path, or an open descriptor, read through a copy of it); "" if it cannot be read."""
    try:
        fd = os.dup(log) if isinstance(log, int) else os.open(log, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - CRASH_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_words(log: str | int, start: int = 0) -> str:
    """What an engine wrote as it crashed, from its log (a path, or an open descriptor;
    bytes ``start`` on): the lines just before faulthandler's report (a C++ abort's
    "terminate called ... what(): ..."), and the report itself (the crashing thread's
    Python stack). "" when the log holds no crash report (``kill -9``, the OOM killer,
    ``os._exit``) or cannot be read."""
    lines = log_tail(log, start).splitlines()
    fatal = [i for i, line in enumerate(lines) if _FATAL in line]
    if not fatal:
        return ""
    at = fatal[-1]
    cut = lines[at].index(_FATAL)  # after a line another thread had begun, if not 0: then
    lines[at] = lines[at][cut:]  # the lines before are not the crash's own
    before: list[str] = []
    for line in reversed(lines[max(0, at - BEFORE_LINES) : at] if cut == 0 else []):
        if not line.strip() or _LOGGED.match(line):
            break
        before.insert(0, line)
    report = [lines[at]]
    # the crashing thread's stack: faulthandler lists every thread, that one as "Current
    # thread", not always first (the others, idle, say nothing of the crash)
    rest = lines[at + 1 :]
    first = next((i for i, line in enumerate(rest) if line.startswith("Current thread")), 0)
    for line in rest[first : first + STACK_LINES - 1]:
        if line.startswith("Extension modules: ") or (report[1:] and not line.strip()):
            break
        report.append(line)
    return "\n".join(f"    {line[:300]}" for line in before + report if line.strip())
