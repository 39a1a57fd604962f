"""What native code writes to file descriptors 1 and 2: a worker's, forwarded to the cell;
the kernel's, without the lines nbrpc's own shutdown causes.

Python's ``print`` on a worker is forwarded by :mod:`.output`. C and C++ (torch's warnings,
NCCL, CUDA, extensions) write to the file descriptors instead, which on an engine stay on
its log (``zygote.EngineOutStream``: a crash's last words are read back from there). So a
worker does not move them: :class:`LogTail` reads what is appended to that log, every
:data:`TAIL_EVERY_S` and once more as each call ends, and forwards it. It goes with the
running call when exactly one runs (in order with its ``print`` output, before its result),
else to the cell running in the kernel; with no cell running it stays in the log only.
ipyparallel's own log lines are left out; both descriptors go to one log, so both arrive as
the worker's stderr.

torch writes a warning in every process when a peer's connection closes::

    [W1123 ...tensorpipe_agent.cpp:723] RPC agent for worker0 encountered error when
    reading incoming request from worker1: EOF: end of file (this error originated at ...)

(and "reading incoming response", line 941, when a call to that peer was in flight;
"sending outgoing request #N to worker1: EPIPE: broken pipe" for a message sent after).

When nbrpc itself made that peer leave (a shutdown, a restart), the line says nothing
the user did not ask for; a cell showed one per worker, in red, at every ``%rpc_shutdown``.
:func:`expect_leaving` names such peers for :data:`LEAVING_GRACE_S`; while they are named,
:func:`expected` drops exactly these lines (:data:`CLOSED_BY_PEER`), in the kernel's own
stderr (:func:`quiet_kernel_stderr`, a pipe between file descriptor 2 and what it was), in
a script's while nbrpc makes workers leave (:func:`quiet_stderr_while_leaving`, the same
pipe for that time only) and in what workers forward.

A peer that drops its connection when nbrpc did not ask it to (its process crashed) is
still reported, once: when a call to it fails, the cell shows ``WorkerDiedError`` with the
process's last words, and ``%rpc_status`` shows it dead; torch's lines about that peer's
closed connections, the kernel's own and the other workers', then say nothing more and
are dropped in the kernel (:func:`on_worker_change`). torch writes them as it reads the
connection's end, a moment before the call that lost it is failed, so in the kernel such
a line waits up to :data:`DEATH_REPORT_S` for nbrpc's word on that peer (the lines after
it wait behind it); a death nbrpc has not noticed by then keeps torch's line.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _process, _states, _timers, _torch

from . import output

#: How often a worker looks for new native output in its log.
TAIL_EVERY_S = 0.1
_READ = 1 << 16  # bytes one read of the log asks for
#: How long after nbrpc asked a peer to leave its connection's end is expected.
LEAVING_GRACE_S = 15.0
#: How long a script's shutdown waits for its filter to pass on the last lines.
LEAVING_PUMP_S = 2.0
#: How long a script's shutdown waits for torch's line about each peer that left.
LEAVING_LINES_S = 0.5
#: How long the kernel holds torch's line about a peer's closed connection, waiting for
#: nbrpc to find that peer dead (then the line is dropped: the death was reported). 0.5 s
#: was too short on a loaded machine: a worker's line about a crashed peer reached the
#: cell in 5 of 10 crashes while the test suite ran beside (tests/test_as_a_user_runs_it).
DEATH_REPORT_S = 1.5
#: torch's line for a peer's connection that closed (group 1: the peer's name): as it
#: reads, or as it sends to it (torch's RRef messages are sent again for seconds after a
#: crash: 26 such lines reached a crash test's cells on a loaded machine, 2026-11-30)
CLOSED_BY_PEER = re.compile(
    r"^\[[EW]\d{4} [^\]]*tensorpipe_agent\.cpp:\d+\] RPC agent for \S+ encountered error "
    r"when (?:reading incoming (?:request|response) from|sending outgoing request #\d+ to) "
    r"(\S+): (EOF: end of file|ECONNRESET: connection reset by peer|EPIPE: broken pipe"
    r"|.*pipe closed)"
)
#: torch's error when it drops a reference to an RRef whose owner left the group (group 1:
#: the owner's rank), followed by a C++ stack (:data:`CPP_STACK`)
DELETING_GONE_RREF = re.compile(
    r"^\[E\d{4} [^\]]*rref_impl\.cpp:\d+\] Error occurred when deletingUserRRef\(.*"
    r"could not find destination id (\d+)"
)
CPP_STACK = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>)")
#: ipyparallel's log lines in an engine's log ("2026-11-22 22:14:28.813 [IPEngine.0] ...").
IPYPARALLEL_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[")


@dataclass
class _Leaving:
    """Peers nbrpc asked to leave, and until when their connections' end is expected."""

    until: dict[str, float] = field(default_factory=dict)
    #: ranks of processes nbrpc replaced or removed: references to what they owned are
    #: dropped with an error line torch cannot help writing (ranks are never reused)
    gone: set[int] = field(default_factory=set)
    dropped: int = 0  # lines dropped so far (tests and docs read it)
    #: peers whose closed connection was reported (and dropped) since they were named
    closed: set[str] = field(default_factory=set)
    #: peers nbrpc found dead (and said so): their closed connections are no news
    dead: set[str] = field(default_factory=set)


_leaving = _Leaving()


def expect_leaving(names: list[str], seconds: float = LEAVING_GRACE_S) -> None:
    """nbrpc is making ``names`` leave: the closing of their connections is expected."""
    until = time.monotonic() + seconds
    for name in names:
        _leaving.until[name] = until
        _leaving.closed.discard(name)


def expect_gone(ranks: list[int]) -> None:
    """The processes of ``ranks`` left for good (a restart, a death nbrpc cleaned up
    after): torch's error as it drops references to their RRefs is expected."""
    _leaving.gone.update(ranks)


def joined(names: list[str]) -> None:
    """``names`` joined a new cluster: a closing connection of theirs is news again."""
    for name in names:
        _leaving.until.pop(name, None)
        _leaving.dead.discard(name)


def died(names: list[str]) -> None:
    """nbrpc found ``names`` dead and says so (a call's ``WorkerDiedError``, the status):
    torch's lines about their closed connections add nothing."""
    _leaving.dead.update(names)


def on_worker_change(change: _states.WorkerChange) -> None:
    """A listener of :mod:`nbrpc._states` (registered by the lifecycle): workers nbrpc
    makes leave (a shutdown, a restart) close their connections as expected, and so did
    workers it found dead; the ranks of processes that left for good drop references with
    an expected error; workers that joined, or joined again, are news again."""
    if change.kind in (_states.Change.LEAVING, _states.Change.RESTARTING):
        expect_leaving(list(change.names))
    elif change.kind is _states.Change.DIED:
        died(list(change.names))
    elif change.kind is _states.Change.LEFT:
        expect_gone(list(change.ranks))
    elif change.kind in (_states.Change.JOINED, _states.Change.REJOINED):
        joined(list(change.names))


def expected(line: str) -> bool:
    """Whether ``line`` is torch's report of a connection that nbrpc closed on purpose, or
    of a reference dropped to an RRef of a process nbrpc replaced."""
    gone = DELETING_GONE_RREF.match(line)
    if gone is not None and int(gone.group(1)) in _leaving.gone:
        _leaving.dropped += 1
        return True
    match = CLOSED_BY_PEER.match(line)
    if match is None or not _explained(match.group(1)):
        return False
    _leaving.dropped += 1
    _leaving.closed.add(match.group(1))
    return True


def awaits_word(line: str) -> bool:
    """Whether ``line`` is torch's report of a closed connection that nbrpc has said
    nothing about yet: the peer may be found dead in a moment (:data:`DEATH_REPORT_S`)."""
    match = CLOSED_BY_PEER.match(line)
    return match is not None and not _explained(match.group(1))


def _explained(peer: str) -> bool:
    """nbrpc made ``peer`` leave a moment ago, or found it dead."""
    return peer in _leaving.dead or time.monotonic() <= _leaving.until.get(peer, 0.0)


@dataclass
class Held:
    """Lines held back from the first one that :func:`awaits_word`, and since when."""

    lines: list[str] = field(default_factory=list)
    since: float | None = None


def sift(lines: list[str], held: Held, now: float, flush: bool = False) -> list[str]:
    """What of ``held``'s lines and then ``lines`` may be shown at ``now``, without the
    expected ones (:func:`_kept`): all of it up to the first line that awaits nbrpc's word
    on its peer for less than :data:`DEATH_REPORT_S`, which ``held`` keeps with the lines
    after it (``flush``: none is kept)."""
    lines = held.lines + lines
    for index, line in enumerate(lines):
        if flush or not awaits_word(line):
            continue
        held.since = now if held.since is None else held.since
        if now - held.since < DEATH_REPORT_S:
            held.lines = lines[index:]
            return _kept(lines[:index])
    held.lines, held.since = [], None
    return _kept(lines)


def dropped() -> int:
    """How many expected lines were kept out of the cell in this process."""
    return _leaving.dropped


# -- the kernel's own stderr ---------------------------------------------------------------


@dataclass
class _Quieted:
    pump: threading.Thread | None = None
    saved: int = -1


_quieted = _Quieted()


def quiet_kernel_stderr() -> None:
    """In a Jupyter kernel, once: file descriptor 2 becomes a pipe whose lines reach what
    it was before (ipykernel's own pipe to the cell) unless :func:`expected`.

    Only in a kernel: ipykernel already reads fd 2 through a pipe of its own there, and
    a script's stderr stays untouched (its last lines at exit must not wait on a thread).
    The pipe's write end does not block: should this process's pump ever stop, native
    lines are dropped rather than hanging the thread that writes them.
    """
    if _quieted.pump is not None or not _process.in_notebook():
        return
    _quieted.saved, _, _quieted.pump = _filter_fd2()


def _filter_fd2() -> tuple[int, int, threading.Thread]:
    """File descriptor 2 becomes a pipe, whose lines a pump thread passes on to what fd 2
    was (a copy of it, returned with the pipe's read end) unless :func:`expected`. The
    write end does not block: should the pump stop, lines are dropped, nobody hangs."""
    saved = os.dup(2)
    try:
        read_end, write_end = os.pipe()
    except OSError:
        os.close(saved)
        raise
    os.set_blocking(write_end, False)
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, saved), name="nbrpc-stderr", daemon=True)
    pump.start()
    return saved, read_end, pump


@contextlib.contextmanager
def quiet_stderr_while_leaving(names: list[str]) -> Iterator[None]:
    """In a script, for the time nbrpc itself makes workers ``names`` leave (a shutdown, a
    restart): file descriptor 2 passes through :func:`expected`, as a kernel's always does,
    and is given back afterwards, so a script's stderr is its own the rest of the time.

    torch notices a closed connection on its own thread, about 40 ms before a shutdown
    ends here: the block's end waits for each peer's line (at most
    :data:`LEAVING_LINES_S`, a peer the kernel never had a connection with writes none).
    In a kernel the pipe of :func:`quiet_kernel_stderr` is there already.
    """
    if _quieted.pump is not None:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved, read_end, pump = _filter_fd2()
    except OSError:  # out of descriptors: the lines show, nothing else changes
        yield
        return
    try:
        yield
    finally:
        deadline = time.monotonic() + LEAVING_LINES_S
        while not set(names) <= _leaving.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end goes: the pump drains it and ends
        pump.join(LEAVING_PUMP_S)
        if not pump.is_alive():
            os.close(read_end)
            os.close(saved)


def _pump(read_end: int, to: int) -> None:
    pending, held = b"", Held()
    while True:
        try:
            ready, _, _ = select.select([read_end], [], [], TAIL_EVERY_S)
            data = os.read(read_end, 65536) if ready else b""
        except OSError:
            return
        if ready and not data:  # the write end is closed: nothing more will come
            _write(to, "".join(sift([], held, time.monotonic(), flush=True)).encode() + pending)
            return
        pending += data
        # complete lines; a partial line once it has sat for a period (a C progress line)
        cut = pending.rfind(b"\n") + 1 if ready else len(pending)
        chunk, pending = pending[:cut], pending[cut:]
        lines = output.lines_of(chunk.decode(errors="replace"))
        _write(to, "".join(sift(lines, held, time.monotonic())).encode())


@dataclass
class _Block:
    dropping: bool = False  # the C++ stack under a dropped error line follows it


_block = _Block()


def _kept(lines: list[str]) -> list[str]:
    """``lines`` without the expected ones (and the C++ stack under a dropped error)."""
    kept = []
    for line in lines:
        if expected(line):
            _block.dropping = True
        elif _block.dropping and CPP_STACK.match(line):
            pass
        else:
            _block.dropping = False
            kept.append(line)
    return kept


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            time.sleep(0.01)
        except OSError:
            return


# -- a worker's native output --------------------------------------------------------------


class LogTail:
    """On a worker: what native code appends to its log (file descriptor 2, when that is a
    file), forwarded by ``send(text)`` as complete lines, ipyparallel's log lines left out.
    """

    def __init__(self, path: str, send: Any) -> None:
        # unbuffered, kept open (the log may be unlinked): a poll that finds nothing new,
        # after each call, is one read() at the end of the file
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115
        self._buffer = bytearray(_READ)
        self._file.seek(0, os.SEEK_END)
        self._send = send
        self._pending = b""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbrpc-log-tail", daemon=True)
        self._thread.start()

    @classmethod
    def of_this_process(cls, send: Any) -> LogTail | None:
        """A tail of this process's log, or None where fd 2 is not a regular file."""
        with contextlib.suppress(OSError):
            path = os.readlink("/proc/self/fd/2")
            if os.path.isfile(path):
                return cls(path, send)
        return None

    def _run(self) -> None:
        while not self._stopped.wait(TAIL_EVERY_S):
            self.poll()

    def poll(self, flush: bool = False) -> None:
        """Forward what was appended since the last poll (``flush``: a partial line too)."""
        with self._lock:
            try:
                data = b""
                while True:  # into a buffer kept: nothing allocated when nothing came
                    got = self._file.readinto(self._buffer)
                    if not got:
                        break
                    data += self._buffer[:got]
                    if got < _READ:
                        break
            except (OSError, ValueError):
                return
            if not data and not (flush and self._pending):
                return
            text = self._pending + data
            cut = len(text) if flush else text.rfind(b"\n") + 1
            self._pending = text[cut:]
            lines = output.lines_of(text[:cut].decode(errors="replace"))
        keep = [line for line in _kept(lines) if not IPYPARALLEL_LOG.match(line)]
        if keep:
            with contextlib.suppress(Exception):  # the kernel is gone: the log keeps it
                self._send("".join(keep))

    def stop(self) -> None:
        self._stopped.set()
        self._file.close()


@dataclass
class _Tail:
    tail: LogTail | None = None


_tail = _Tail()


def start_tail() -> None:
    """On a worker, once it forwards output: forward its native output too."""
    if _tail.tail is None:
        _tail.tail = LogTail.of_this_process(forward)


def stop_tail() -> None:
    """On a worker that leaves the group: nothing can be forwarded any more."""
    tail, _tail.tail = _tail.tail, None
    if tail is not None:
        tail.stop()


def before_call_ends(printed: Any) -> None:
    """A call is ending on this worker: native output it wrote goes with it, before its
    result, when it is the only call running."""
    tail = _tail.tail
    if tail is not None and printed is not None and output.only_call(printed):
        tail.poll()


def forward(text: str) -> None:
    """On a worker: native output goes with the one call running, else to the kernel."""
    call = output.call_here()  # this thread (the tail's) serves none
    if call is not None:
        call.write("stderr", text)
        return
    kernel = output.kernel_name()
    if kernel is not None:
        _torch.rpc_async(kernel, show, args=(output.worker_name(), text), timeout=10)


def show(worker: str, text: str) -> None:
    """Runs in the kernel: a worker's native output, shown in the cell that is running
    (none running: it stays in the worker's log), without the lines nbrpc caused; from a
    line about a closed connection nbrpc has not explained yet, a moment later."""
    held = Held()
    _show(worker, sift(output.lines_of(text), held, time.monotonic()))
    if held.lines:
        _timers.after(DEATH_REPORT_S, _show_held, worker, held)


def _show_held(worker: str, held: Held) -> None:
    _show(worker, sift([], held, time.monotonic(), flush=True))


def _show(worker: str, lines: list[str]) -> None:
    if lines and _process.cell_running():
        output.show_output(worker, [("stderr", "".join(lines))])
