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


def now(skip: set[int] = frozenset()) -> dict[str, set[str]]:  # type: ignore[assignment]
    """Everything of each kind there is now (``skip``: pids that are not the session's
    leftovers, such as the hang watchdog, stopped after this check)."""
    shm = (
        {os.path.join("/dev/shm", e) for e in os.listdir("/dev/shm")}
        if os.path.isdir("/dev/shm")
        else set()
    )
    return {
        "processes": _processes(set(skip)),
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


class Leftovers:
    """The plugin: the kinds at the start, compared at the end."""

    def __init__(self) -> None:
        self.before: dict[str, set[str]] = {}
        self.left: dict[str, list[str]] = {}

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if session.config.getoption("--leftovers", DEFAULT) != "off":
            self.before = now()

    @pytest.hookimpl(trylast=True)  # after the conftest's own (the fake hosts go down there)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        mode = session.config.getoption("--leftovers", DEFAULT)
        if mode == "off" or not self.before:
            return
        watchdog = getattr(session.config, "_nbrpc_hang_watchdog", None)
        skip = {watchdog.pid} if watchdog is not None else set()
        deadline = time.monotonic() + SETTLE_S
        while True:
            found = now(skip)
            self.left = {
                kind: sorted(found[kind] - self.before.get(kind, set()))
                for kind in found
                if found[kind] - self.before.get(kind, set())
            }
            if not self.left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
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
