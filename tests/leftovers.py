"""What a test session leaves behind, checked at its end (a pytest plugin the conftest
registers): a process, a ``/dev/shm`` entry, a ``/tmp/nbrpc-*`` folder or a file in the
per-user one, an ipyparallel file (a cluster, connection or log file in a profile), a
network namespace, a Slurm or munge daemon.

Each kind is read at the session's start and again at its end; what is new and still
there after :data:`SETTLE_S` (a watchdog exits within a second of its kernel) is a
leftover, named in the terminal summary. ``--leftovers=fail`` fails the run (``make test``
gives it to each of its pytest runs); ``--leftovers=warn``, the default of a pytest run
typed by hand, only says so, as it must for a developer whose other sessions run tests on
the same machine at the same time: their files count as this one's.

Under pytest-xdist (``make test TEST_WORKERS=2``: two workers) each worker reads the
processes under it, as a session run alone does, and hands what it left to the controller
(``workeroutput``); the controller reads the files, namespaces and daemons, which are the
machine's and not one worker's, before its workers start and after the last one ended, and
judges the whole run.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import subprocess
import tempfile
import time

import psutil
import pytest

SETTLE_S = 15.0
LEFT_KEY = "nbrpc_leftovers"  # a worker's workeroutput: kind -> what it left
DEFAULT = "warn"  # make test says "fail"
_DAEMONS = ("slurmctld", "slurmd", "munged")


def _ipython_files() -> set[str]:
    home = os.environ.get("IPYTHONDIR") or os.path.expanduser("~/.ipython")
    return {
        path
        for folder in ("security", "log", "pid")
        for path in glob.glob(os.path.join(glob.escape(home), "profile_*", folder, "*"))
    }


_OWNER = re.compile(r"^(?:nbrpc-(\d+)-|[^.]+\.(\d+)-)")  # nbrpc-PID-..., HOST.PID-START.*


def _of_a_live_process(path: str) -> bool:
    """A file or folder that names a process of this host that is still running (this
    session's own pytest process has its stack files until it exits)."""
    name = os.path.basename(path)
    match = _OWNER.match(name)
    if match is None:
        return False
    if match.group(2) is not None and not name.startswith(socket.gethostname() + "."):
        return False  # another host's (a fake host's): not this host's pid
    return psutil.pid_exists(int(match.group(1) or match.group(2)))


def _tmp_files() -> set[str]:
    tmp = tempfile.gettempdir()
    found = set(glob.glob(os.path.join(tmp, "nbrpc-*")))
    mine = os.path.join(tmp, f"nbrpc-{os.getuid()}")  # the user's own: kept, its files not
    found.discard(mine)
    found.update(glob.glob(os.path.join(mine, "*", "*")))
    return {path for path in found if not _of_a_live_process(path)}


def _netns() -> set[str]:
    try:
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _daemons() -> set[str]:
    found = set()
    for p in psutil.process_iter(["pid", "name"]):
        if p.info["name"] in _DAEMONS:
            found.add(f"{p.info['name']} (pid {p.info['pid']})")
    return found


def _processes(skip: set[int]) -> set[str]:
    found = set()
    for p in psutil.Process().children(recursive=True):
        if p.pid in skip:
            continue
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                found.add(f"pid {p.pid}: {' '.join(p.cmdline()[:4])}")
    return found


PROCESSES = "processes"  # the one kind a worker of a distributed run reads


def now(skip: set[int] = frozenset(), kinds: str = "all") -> dict[str, set[str]]:  # type: ignore[assignment]
    """Everything of each kind there is now (``skip``: pids that are not the session's
    leftovers, such as the hang watchdog, stopped after this check). ``kinds``: ``"all"``,
    :data:`PROCESSES` alone (a worker of a distributed run), or ``"machine"``: all but the
    processes (its controller, whose workers' processes are not its children)."""
    processes = {PROCESSES: _processes(set(skip))} if kinds != "machine" else {}
    if kinds == PROCESSES:
        return processes
    shm = (
        {os.path.join("/dev/shm", e) for e in os.listdir("/dev/shm")}
        if os.path.isdir("/dev/shm")
        else set()
    )
    return {
        **processes,
        "/dev/shm": shm,
        "/tmp/nbrpc-*": _tmp_files(),
        "ipyparallel files": _ipython_files(),
        "network namespaces": _netns(),
        "Slurm and munge daemons": _daemons(),
    }


def add_option(parser: pytest.Parser) -> None:
    """``--leftovers``: what a session that leaves anything behind does (from the
    conftest's ``pytest_addoption``: a plugin registered later adds no option)."""
    parser.addoption(
        "--leftovers",
        choices=("fail", "warn", "off"),
        default=DEFAULT,
        help=f"what a session that leaves processes or files behind does (default: {DEFAULT})",
    )


def _role(config: pytest.Config) -> str:
    """``"all"`` for a session run alone; under pytest-xdist, :data:`PROCESSES` in a worker
    and ``"machine"`` in the controller."""
    if hasattr(config, "workerinput"):
        return PROCESSES
    if config.pluginmanager.hasplugin("dsession"):  # xdist's controller, -n given
        return "machine"
    return "all"


class Leftovers:
    """The plugin: the kinds at the start, compared at the end."""

    def __init__(self) -> None:
        self.before: dict[str, set[str]] = {}
        self.left: dict[str, list[str]] = {}
        self.from_workers: dict[str, set[str]] = {}  # the controller's: what workers left

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if session.config.getoption("--leftovers", DEFAULT) != "off":
            self.before = now(kinds=_role(session.config))

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist, never called
    def pytest_testnodedown(self, node, error) -> None:  # type: ignore[no-untyped-def]
        """The controller: a worker ended, with what it left (its ``workeroutput``)."""
        for kind, items in getattr(node, "workeroutput", {}).get(LEFT_KEY, {}).items():
            worker = node.gateway.id
            self.from_workers.setdefault(kind, set()).update(f"{worker}: {i}" for i in items)

    @pytest.hookimpl(trylast=True)  # after the conftest's own (the fake hosts go down there)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        mode = session.config.getoption("--leftovers", DEFAULT)
        if mode == "off" or not self.before:
            return
        role = _role(session.config)
        watchdog = getattr(session.config, "_nbrpc_hang_watchdog", None)
        skip = {watchdog.pid} if watchdog is not None else set()
        deadline = time.monotonic() + SETTLE_S
        while True:
            found = now(skip, kinds=role)
            self.left = {
                kind: sorted(found[kind] - self.before.get(kind, set()))
                for kind in found
                if found[kind] - self.before.get(kind, set())
            }
            if not self.left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for kind, items in self.from_workers.items():
            self.left[kind] = sorted({*self.left.get(kind, ()), *items})
        if role == PROCESSES:  # a worker: the controller judges and says it
            session.config.workeroutput[LEFT_KEY] = self.left  # type: ignore[attr-defined]
            self.left = {}
            return
        if self.left and mode == "fail" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
        if not self.left:
            return
        terminalreporter.section("left behind by this session", sep="=", red=True)
        for kind, items in self.left.items():
            terminalreporter.line(f"{kind}: {len(items)}")
            for item in items[:20]:
                terminalreporter.line(f"    {item}")
            if len(items) > 20:
                terminalreporter.line(f"    ... and {len(items) - 20} more")
