"""Every thread's Python stack, read from outside the process's RPC threads.

A worker whose RPC threads are all busy cannot answer a call, and one whose thread holds
the GIL inside a long C++ operation cannot run any Python at all: asking it by RPC for
``sys._current_frames()`` waits as long as the work does. So each process of a cluster,
when it joins, gets two ways to be asked that need none of its RPC threads:

- a thread of its own (``nbrpc-stacks``) waits on a named pipe (``.ask``). A reader
  writes a token there; the thread takes the GIL, formats ``sys._current_frames()`` and
  writes the answer, named by the token, into a file mapped in memory (``.answer``). This
  is the usual way: while the program runs Python, the GIL changes hands every few
  milliseconds. The thread takes it once per answer: from then on nothing it does
  releases the GIL (no system call: the answer is a copy into the map), and the switch
  interval is raised while it works, so it is not made to hand the GIL back half way.
  Measured with 16 threads spinning in Python on 2 cores: an answer written to a file
  (open, write, rename: each a system call that lets the GIL go, then a wait behind 16
  threads to get it back) took 0.41 s at the median, and 7 of 30 came after the 0.5 s
  the thread then had, so the process was signalled while it ran Python, which is what
  the signal must not meet (below).
- a signal (:data:`SIGNAL`) for which the standard library's ``faulthandler`` is
  registered: its handler is C, runs without the GIL and writes every thread's stack to
  a file (``.stacks``). It interrupts nothing (``SA_RESTART``: system calls resume, no
  Python handler runs). It is used only when the thread did not answer within
  :data:`ASK_WAIT_S`, that is when a thread holds the GIL in C. Only then, because
  faulthandler walks the thread list without any lock: while other threads run Python
  and threads come and go (C++ threads, as torch's, may make and drop a Python thread
  state for each callback), it reads freed memory. Measured: a process whose 16 threads call
  functions and start short threads died of SIGSEGV within 200 such dumps in 5 of 5
  runs; with the GIL held in C nothing runs Python and no thread state is freed.

What each thread serves is written by the callee (:mod:`nbrpc._wire.callee`), as the call
starts and ends, into a third file mapped in memory (:data:`SLOT_BYTES` per thread, one
text line: thread id, call id, caller, function), readable at any moment.

The files live in a directory private to the user (``$TMPDIR/nbrpc-<uid>/stacks``),
named by host, pid and the process's start time (so a reused pid never finds a stale
file, and hosts that share the directory's filesystem keep apart); a
process that has not registered yet has no file and is never signalled (the signal's
default action would end it).

:func:`collect` asks pids of this host and reads the files back; run as a script
(``python stacks.py PID...``, the ssh source does that on a worker's host) it prints the
same as JSON. This file imports only the standard library at the top, for that reason
(``tests/test_stacks.py`` also loads it alone, by its path, to set a process up). What the
kernel does with other hosts' stacks and with a dump's text is in :mod:`.stack_dumps`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import mmap
import os
import re
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from typing import Any

SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
SLOT_BYTES = 256
SLOTS = 128  # threads of one process with a label (torch's RPC threads: 16 by default)
DUMP_WAIT_S = 2.0  # how long collect waits for a dump to complete
ASK_WAIT_S = 1.0  # how long the process's own thread gets before the signal is sent (at
# most half the wait: the signal's dump takes well under the other half). Measured with 16
# threads spinning in Python on 2 cores, 240 asks: the thread's answer came within 0.63 s
# at most, 0.04-0.09 s at the median
MAX_FRAMES = 100  # per thread, as faulthandler writes
ANSWER_BYTES = 1 << 18  # the answer map's first size (a dump of 17 threads: ~30 KB); it grows
ANSWER_SWITCH_S = 0.05  # the switch interval while the thread answers (Python's: 5 ms)
RECENT_S = 5.0  # a token is named in later answers this long (two readers at once)
_HEAD = struct.Struct("<QQ")  # the answer map's head: a sequence (odd while written), a length
_TOKEN = re.compile(rb"[0-9a-f]{16}")


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
_asked: list[int] = []  # this process's .ask pipe's descriptor (a forked child's: its parent's)
_installed: list[str] = []  # the files' base path, once installed in this process
_answering: list[_Answers] = []  # this process's answer map (a forked child's: its parent's)


def install() -> None:
    """Register the signal and make this process's files (idempotent; a forked child
    registers again, under its own pid)."""
    global _dump
    import faulthandler

    base = _base(os.getpid())
    if base is None or _installed == [base]:
        return
    sweep()
    if not _installed:  # a process that exits normally takes its files (a worker's
        atexit.register(sweep, True)  # os._exit does not: its kernel sweeps them)
    fd = os.open(base + ".calls", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SLOT_BYTES * SLOTS)
        _labels.map = mmap.mmap(fd, SLOT_BYTES * SLOTS)
    finally:
        os.close(fd)
    _labels.map[:] = (b" " * (SLOT_BYTES - 1) + b"\n") * SLOTS
    _labels.slots = {}
    try:
        answers = _Answers(base + ".answer", ANSWER_BYTES)
    except OSError:  # no room for it (a full /tmp): asked, it has no pipe; the signal answers
        answers = None
    for old in _answering:  # a forked child's copy of its parent's
        old.close()
    _answering[:] = [answers] if answers is not None else []
    if answers is not None:
        _listen(base, answers)
    _after_fork_once()
    dump = open(base + ".part", "w")  # noqa: SIM115 (faulthandler keeps writing to it)
    faulthandler.register(SIGNAL, file=dump, all_threads=True, chain=False)
    os.rename(base + ".part", base + ".stacks")  # signalled only once this name exists
    if _dump is not None:  # a forked child's copy of its parent's file
        _dump.close()
    _dump = dump
    _installed[:] = [base]


class _Answers:
    """The answer map: a file of ``size`` bytes, allocated (a write into a map of a
    sparse file on a full filesystem is SIGBUS, the process's end; an allocation that
    fails is an error here), mapped shared; it grows by doubling."""

    def __init__(self, path: str, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError, BufferError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def write(self, body: bytes) -> None:
        """``body`` into the map, under a sequence that is odd while it is written (a
        reader that sees an odd or a changed sequence reads again)."""
        if _HEAD.size + len(body) > len(self.map):
            size = len(self.map)
            while _HEAD.size + len(body) > size:
                size *= 2
            os.posix_fallocate(self.fd, 0, size)  # (the one system call: a rare answer)
            self.map.resize(size)
        sequence = _HEAD.unpack_from(self.map)[0]
        _HEAD.pack_into(self.map, 0, sequence | 1, 0)
        self.map[_HEAD.size : _HEAD.size + len(body)] = body
        _HEAD.pack_into(self.map, 0, (sequence | 1) + 1, len(body))


class _Switch:
    """The switch interval the ``nbrpc-stacks`` thread raised, while it is raised: a
    child forked meanwhile gets it back."""

    before: float | None = None
    registered = False


def _after_fork_once() -> None:
    if not _Switch.registered:
        os.register_at_fork(after_in_child=_switch_back_in_child)
        _Switch.registered = True


def _switch_back_in_child() -> None:
    if _Switch.before is not None:
        sys.setswitchinterval(_Switch.before)
        _Switch.before = None


def _listen(base: str, answers: _Answers) -> None:
    """Make the ``.ask`` pipe and start the thread that answers it into ``answers``."""
    for fd in _asked:  # a forked child's copy of its parent's pipe: not its to read
        with contextlib.suppress(OSError):
            os.close(fd)
    _asked.clear()
    path = base + ".ask"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # read and write: no EOF while it lives
    _asked.append(fd)
    threading.Thread(target=_answer, args=(fd, answers), name="nbrpc-stacks", daemon=True).start()


def _answer(fd: int, answers: _Answers) -> None:
    """The ``nbrpc-stacks`` thread: each token read from the pipe gets the stacks of
    every other thread, written into ``answers`` under the tokens of the last
    :data:`RECENT_S` (a reader that asked just before another still finds its own)."""
    pending = b""
    recent: collections.deque[tuple[float, bytes]] = collections.deque(maxlen=32)
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return  # closed (a forked child closed its parent's copy)
        pending = (pending + chunk)[-4096:]
        *lines, pending = pending.split(b"\n")
        tokens = [t for t in lines if _TOKEN.fullmatch(t)]  # other bytes: ignored
        if not tokens:
            continue
        interval = _Switch.before = sys.getswitchinterval()
        sys.setswitchinterval(max(interval, ANSWER_SWITCH_S))
        try:
            text = format_threads()
            now = time.monotonic()
            recent.extend((now, token) for token in tokens)
            named = b" ".join(token for at, token in recent if now - at < RECENT_S)
            answers.write(named + b"\n" + text.encode(errors="replace"))
        except Exception:  # (no room to grow): this ask gets no answer, the next may
            pass
        finally:
            sys.setswitchinterval(interval)
            _Switch.before = None


def format_threads() -> str:
    """This process's threads (but the ``nbrpc-stacks`` thread: nbrpc's, not the
    program's), in faulthandler's format (:func:`.stack_dumps.parse` reads both), each
    with its name where :mod:`threading` knows it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    frames[threading.get_ident()] = sys._getframe(1)  # this thread: from its caller on
    lines = []
    for ident, frame in frames.items():
        if names.get(ident) == "nbrpc-stacks":
            continue
        name = names.get(ident)
        named = f" [{name}]" if name else ""
        lines.append(f"Thread {ident:#018x}{named} (most recent call first):")
        depth = 0
        f: Any = frame
        while f is not None:
            if depth == MAX_FRAMES:
                lines.append("  ...")
                break
            line = f.f_lineno if f.f_lineno is not None else "???"
            lines.append(f'  File "{f.f_code.co_filename}", line {line} in {f.f_code.co_name}')
            f = f.f_back
            depth += 1
        lines.append("")
    return "\n".join(lines)


def sweep(own: bool = False) -> None:
    """Remove the files of this host's processes that are gone (at each install, and
    after engines are stopped: one that is killed leaves its files); ``own``: this
    process's too (at its exit)."""
    host = socket.gethostname() + "."
    me = f"{os.getpid()}-{_started(os.getpid())}"
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory()):
            if not entry.startswith(host):
                continue
            pid, _, rest = entry[len(host) :].partition("-")
            if not pid.isdigit():
                continue
            gone = _started(int(pid)) != rest.split(".", 1)[0]
            if gone or (own and entry[len(host) :].split(".", 1)[0] == me):
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


def collect(pids: list[int], timeout: float = DUMP_WAIT_S) -> dict[int, dict[str, Any]]:
    """Ask each pid of this host for its stacks and read them back: by pid,
    ``{"dump": text, "labels": {thread id: label}, "how": "thread" | "signal"}``, or
    ``{"error": why}``. Its own thread answers first; a process whose thread has not
    answered within :data:`ASK_WAIT_S` (a thread holds the GIL in C) is signalled."""
    found: dict[int, dict[str, Any]] = {}
    asked: dict[int, tuple[str, str]] = {}  # pid -> (base, the token asked with)
    signalled: dict[int, tuple[str, int]] = {}  # pid -> (base, the dump's size before)
    for pid in pids:
        base = _base(pid)
        if base is None:
            found[pid] = {"error": "no such process"}
        elif not os.path.exists(base + ".stacks"):
            found[pid] = {"error": "it has not set up stack dumps (not an nbrpc process?)"}
        else:
            token = _ask(base)
            if token is not None:
                asked[pid] = (base, token)
            elif not _signal(pid, base, signalled):
                found[pid] = {"error": "it has not set up stack dumps (not an nbrpc process?)"}
    started = time.monotonic()
    deadline = started + timeout
    last: dict[int, tuple[int, float]] = {}
    while (asked or signalled) and time.monotonic() < deadline:
        for pid, (base, token) in list(asked.items()):
            text = _read_answer(base, token)
            if text is not None:
                found[pid] = _found(text, base, "thread")
                del asked[pid]
            elif time.monotonic() - started > min(ASK_WAIT_S, timeout / 2):
                del asked[pid]  # its thread waits for the GIL: faulthandler needs none
                if not _signal(pid, base, signalled):
                    found[pid] = {"error": "it ended while asked"}
        for pid, (base, size) in list(signalled.items()):
            now = os.path.getsize(base + ".stacks")
            seen = last.get(pid)
            settled = seen is not None and seen[0] == now and time.monotonic() - seen[1] > 0.05
            if now > size and settled:
                with open(base + ".stacks", "rb") as f:
                    f.seek(size)
                    dump = f.read().decode(errors="replace")
                found[pid] = _found(dump, base, "signal")
                del signalled[pid]
            elif seen is None or seen[0] != now:
                last[pid] = (now, time.monotonic())
        time.sleep(0.005)
    for pid in [*asked, *signalled]:
        found[pid] = {"error": f"no dump within {timeout:g} s"}
    return found


def _found(dump: str, base: str, how: str) -> dict[str, Any]:
    return {"dump": dump, "labels": _read_labels(base + ".calls"), "how": how}


def _ask(base: str) -> str | None:
    """Write a fresh token to the process's ``.ask`` pipe and return it (None: no pipe,
    or no thread reads it)."""
    try:
        fd = os.open(base + ".ask", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENOENT: an older process; ENXIO: nothing reads it
        return None
    token = os.urandom(8).hex()
    try:
        os.write(fd, token.encode() + b"\n")
    except OSError:
        return None
    finally:
        os.close(fd)
    return token


def _read_answer(base: str, token: str) -> str | None:
    """The stacks in the process's answer map, once they name ``token`` (None: not yet,
    or being written). Read with ``pread``, unbuffered: the second look at the sequence
    must see the file, not a buffer filled by the first."""
    try:
        fd = os.open(base + ".answer", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        sequence, length = _HEAD.unpack(os.pread(fd, _HEAD.size, 0))
        if sequence % 2:
            return None
        body = os.pread(fd, length, _HEAD.size)
        again = _HEAD.unpack(os.pread(fd, _HEAD.size, 0))[0]
    except (OSError, struct.error, OverflowError):
        return None
    finally:
        os.close(fd)
    if again != sequence or len(body) != length:
        return None
    named, _, text = body.partition(b"\n")
    return text.decode(errors="replace") if token.encode() in named.split() else None


def _signal(pid: int, base: str, signalled: dict[int, tuple[str, int]]) -> bool:
    """Send :data:`SIGNAL` (faulthandler writes to ``.stacks``); False: it is gone."""
    try:
        size = os.path.getsize(base + ".stacks")
        os.kill(pid, SIGNAL)
    except OSError:
        return False
    signalled[pid] = (base, size)
    return True


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


def main(argv: list[str]) -> None:
    """``python stacks.py PID...``: :func:`collect` on this host, as JSON on stdout."""
    found = collect([int(p) for p in argv if p.isdigit()])
    json.dump({str(pid): part for pid, part in found.items()}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
