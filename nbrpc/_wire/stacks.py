"""Every thread's Python stack, read from outside the process, without its GIL.

A worker whose RPC threads are all busy cannot answer a call, and one whose thread holds
the GIL inside a long C++ operation cannot run any Python at all: asking it by RPC for
``sys._current_frames()`` waits as long as the work does. So each process of a cluster,
when it joins, registers the standard library's ``faulthandler`` for a signal
(:data:`SIGNAL`): its handler is C, runs without the GIL and writes every thread's Python
stack to a file of the process's own. It interrupts nothing: the signal is taken with
``SA_RESTART`` (system calls resume), no Python handler runs, the program goes on.

What each thread serves is written by the callee (:mod:`nbrpc._wire.callee`), as the call
starts and ends, into a second file mapped in memory (:data:`SLOT_BYTES` per thread, one
text line: thread id, call id, caller, function), readable at any moment.

Both files live in a directory private to the user (``$TMPDIR/nbrpc-<uid>/stacks``),
named by host, pid and the process's start time (so a reused pid never finds a stale
file, and hosts that share the directory's filesystem keep apart); a
process that has not registered yet has no file and is never signalled (the signal's
default action would end it).

:func:`collect` signals pids of this host and reads the files back; run as a script
(``python stacks.py PID...``, the ssh source does that on a worker's host) it prints the
same as JSON. This file imports only the standard library at the top, for that reason.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
SLOT_BYTES = 256
SLOTS = 128  # threads of one process with a label (torch's RPC threads: 16 by default)
DUMP_WAIT_S = 1.5  # how long collect waits for a dump to complete


def directory() -> str:
    """Where stack files are (made private to the user)."""
    path = os.path.join(tempfile.gettempdir(), f"nbrpc-{os.getuid()}", "stacks")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _started(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _base(pid: int) -> str | None:
    """The files' path without suffix: host, pid, start time (hosts may share ``/tmp``'s
    filesystem but never a pid namespace)."""
    started = _started(pid)
    if started is None:
        return None
    return os.path.join(directory(), f"{socket.gethostname()}.{pid}-{started}")


class _Labels:
    """This process's mapped label file and which slot each thread writes."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.slots: dict[int, int] = {}
        self.lock = threading.Lock()


_labels = _Labels()
_dump: Any = None  # the file faulthandler writes to (kept open: it holds the descriptor)
_installed: list[str] = []  # the files' base path, once installed in this process


def install() -> None:
    """Register the signal and make this process's files (idempotent; a forked child
    registers again, under its own pid)."""
    global _dump
    import faulthandler

    base = _base(os.getpid())
    if base is None or _installed == [base]:
        return
    _sweep()
    fd = os.open(base + ".calls", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SLOT_BYTES * SLOTS)
        _labels.map = mmap.mmap(fd, SLOT_BYTES * SLOTS)
    finally:
        os.close(fd)
    _labels.map[:] = (b" " * (SLOT_BYTES - 1) + b"\n") * SLOTS
    _labels.slots = {}
    dump = open(base + ".part", "w")  # noqa: SIM115 (faulthandler keeps writing to it)
    faulthandler.register(SIGNAL, file=dump, all_threads=True, chain=False)
    os.rename(base + ".part", base + ".stacks")  # signalled only once this name exists
    if _dump is not None:  # a forked child's copy of its parent's file
        _dump.close()
    _dump = dump
    _installed[:] = [base]


def _sweep() -> None:
    """Remove the files of this host's processes that are gone."""
    host = socket.gethostname() + "."
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory()):
            if not entry.startswith(host):
                continue
            pid, _, rest = entry[len(host) :].partition("-")
            if not pid.isdigit():
                continue
            if _started(int(pid)) != rest.split(".", 1)[0]:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory(), entry))


def label(text: str | None) -> None:
    """What this thread serves now (``None``: nothing)."""
    m = _labels.map
    if m is None:
        return
    ident = threading.get_ident()
    slot = _labels.slots.get(ident)
    if slot is None:
        with _labels.lock:
            slot = _labels.slots.setdefault(ident, len(_labels.slots))
        if slot >= SLOTS:
            return
    line = b"" if text is None else f"{ident} {text}".encode()[: SLOT_BYTES - 1]
    start = slot * SLOT_BYTES
    m[start : start + SLOT_BYTES - 1] = line.ljust(SLOT_BYTES - 1)


def own_labels() -> dict[int, str]:
    """What this process's threads serve now (its label file, read here)."""
    m = _labels.map
    return {} if m is None else _labels_of(m[:].decode(errors="replace"))


# -- the reading side -----------------------------------------------------------------------

_THREAD = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-f]+)(?: \[(.*)\])? \(most recent call first\):"
)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def collect(pids: list[int], timeout: float = DUMP_WAIT_S) -> dict[int, dict[str, Any]]:
    """Signal each pid of this host and read its dump and labels back: by pid,
    ``{"dump": text, "labels": {thread id: label}}``, or ``{"error": why}``."""
    found: dict[int, dict[str, Any]] = {}
    waiting: dict[int, tuple[str, int]] = {}
    for pid in pids:
        base = _base(pid)
        if base is None:
            found[pid] = {"error": "no such process"}
            continue
        path = base + ".stacks"
        try:
            size = os.path.getsize(path)
            os.kill(pid, SIGNAL)
        except OSError:
            found[pid] = {"error": "it has not set up stack dumps (not an nbrpc process?)"}
            continue
        waiting[pid] = (base, size)
    deadline = time.monotonic() + timeout
    last: dict[int, tuple[int, float]] = {}
    while waiting and time.monotonic() < deadline:
        for pid, (base, size) in list(waiting.items()):
            now = os.path.getsize(base + ".stacks")
            seen = last.get(pid)
            settled = seen is not None and seen[0] == now and time.monotonic() - seen[1] > 0.05
            if now > size and settled:
                with open(base + ".stacks", "rb") as f:
                    f.seek(size)
                    dump = f.read().decode(errors="replace")
                found[pid] = {"dump": dump, "labels": _read_labels(base + ".calls")}
                del waiting[pid]
            elif seen is None or seen[0] != now:
                last[pid] = (now, time.monotonic())
        time.sleep(0.01)
    for pid in waiting:
        found[pid] = {"error": f"no dump within {timeout:g} s"}
    return found


def gather(
    engines: dict[int, tuple[str, int]], run: Callable[[str, list[str]], str]
) -> dict[int, dict[str, Any]]:
    """:func:`collect` on several hosts at once. ``engines``: engine id -> (its host, its
    pid there); ``run(host, argv)`` runs ``argv`` (``-c``, this file's source, the pids:
    what the host's Python is given) there, over ssh or as a Slurm step, and returns its
    stdout. The parts by engine id (pids of two hosts may be equal), or an error naming
    the host."""
    source = Path(__file__).read_text()
    places: dict[str, dict[int, int]] = {}  # host -> pid -> engine id
    for eid, (place, pid) in engines.items():
        places.setdefault(place, {})[pid] = eid
    found: dict[int, dict[str, Any]] = {}

    def one(place: str, ids: dict[int, int]) -> None:
        try:
            out = json.loads(run(place, ["-c", source, *map(str, ids)]))
            found.update({ids[int(p)]: part for p, part in out.items()})
        except Exception as exc:  # no answer from that host: said in its rows
            found.update({eid: {"error": f"{place}: {exc}"} for eid in ids.values()})

    threads = [threading.Thread(target=one, args=item) for item in places.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


def _read_labels(path: str) -> dict[int, str]:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return _labels_of(f.read().decode(errors="replace"))
    return {}


def _labels_of(text: str) -> dict[int, str]:
    labels: dict[int, str] = {}
    for line in text.splitlines():
        ident, _, label = line.strip().partition(" ")
        if ident.isdigit() and label:
            labels[int(ident)] = label
    return labels


def parse(dump: str) -> list[dict[str, Any]]:
    """faulthandler's text as threads (frames innermost last, as a traceback prints)."""
    threads: list[dict[str, Any]] = []
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append(
                {
                    "thread": int(head.group(2), 16),
                    "name": head.group(3),
                    "current": head.group(1) == "Current thread",
                    "frames": [],
                }
            )
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1]["frames"].insert(
                0, {"file": frame.group(1), "line": int(frame.group(2)), "function": frame.group(3)}
            )
    return threads


def main(argv: list[str]) -> None:
    """``python stacks.py PID...``: :func:`collect` on this host, as JSON on stdout."""
    found = collect([int(p) for p in argv if p.isdigit()])
    json.dump({str(pid): part for pid, part in found.items()}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
