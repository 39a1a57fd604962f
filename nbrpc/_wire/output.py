"""What a call prints on a worker shows in the calling cell, as it is printed.

On workers, ``sys.stdout`` and ``sys.stderr`` are wrapped once (:func:`forward_output_to`);
while a thread runs an RPC call its writes are sent, line by line, to the notebook kernel
(an ``rpc_async`` to :func:`show_output`), prefixed with the worker's name. Before the call
returns, the pending lines are awaited, so output arrives before the result does.

A line that updates itself with ``\r`` and no newline (tqdm's text bar, Keras-style
progress) is not held back until its newline: its latest state is sent every
:data:`PARTIAL_EVERY_S` while it changes. The kernel shows it in place
(:class:`_OpenLines`): in a notebook, one display per worker and stream, updated; in a
terminal, the line rewritten after ``\r``.
"""

from __future__ import annotations

import _thread
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _process, _timers, _torch

from . import bar_rows


@dataclass
class _Forwarding:
    """Where this worker's call output goes: the kernel's name, and this worker's."""

    to: str | None = None
    me: str | None = None


_forward = _Forwarding()
_call = threading.local()  # .output: the _CallOutput of the RPC call running on this thread
#: how long a call's end waits for the kernel to show one more message of its output
OUTPUT_WAIT_S = 10.0
#: how long the kernel may take to show one message
SEND_TIMEOUT_S = 10.0
#: why a cancelled call's output not sent yet is dropped (its last line says so)
CUT = "the call was cancelled (the stop button) before they were sent"
#: what one message carries at most (whole writes: one longer write goes alone), so that
#: the kernel shows each within a fraction of :data:`OUTPUT_WAIT_S` and a call's end sees
#: its output move (a flood once went as one message of 20,000 lines)
MESSAGE_CHARS = 16384
#: How often a line updated in place (``\r``, no newline yet) is sent while it changes:
#: it reaches the cell within this plus one message (the issue asked for 0.2 s).
PARTIAL_EVERY_S = 0.1


def lines_of(text: str) -> list[str]:
    """``text`` cut after each newline only (``str.splitlines`` also cuts at ``\r``, which
    here updates a line rather than ending it); the last piece may lack its newline."""
    pieces = text.split("\n")
    lines = [piece + "\n" for piece in pieces[:-1]]
    return [*lines, pieces[-1]] if pieces[-1] else lines


def visible(line: str) -> str:
    """What a terminal shows of ``line``: the text after its last ``\r`` (a trailing
    ``\r`` returns to the start of a line it does not clear)."""
    parts = line.rstrip("\n").split("\r")
    while len(parts) > 1 and not parts[-1]:
        parts.pop()
    return parts[-1]


@dataclass
class _OpenLines:
    """In the kernel: the lines workers update in place, by (worker, stream), until their
    newline. In a notebook each is a display updated in place (interleaved lines of other
    workers cannot break it); elsewhere the line is rewritten after ``\r``."""

    shown: dict[tuple[str, str], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def show(self, worker: str, stream: str, text: str) -> None:
        """Plain lines go in one write per run of them, and the stream is flushed once:
        ipykernel sends one message per flush, and a flush from this thread waits for its
        IO thread."""
        out = sys.stderr if stream == "stderr" else sys.stdout
        key = (worker, stream)
        plain: list[str] = []
        with self.lock:
            for line in lines_of(text):
                done = line.endswith("\n")
                handle = self.shown.get(key)
                if handle is None and (done or "\r" not in line):
                    plain.append(
                        f"[{worker}] {visible(line)}\n" if "\r" in line else f"[{worker}] {line}"
                    )
                    continue
                if plain:
                    out.write("".join(plain))
                    plain.clear()
                self._update(key, handle, out, f"[{worker}] {visible(line)}", done)
            if plain:
                out.write("".join(plain))
        out.flush()

    def _update(self, key: tuple[str, str], handle: Any, out: Any, text: str, done: bool) -> None:
        if not _process.in_notebook():  # a terminal: rewrite the line
            out.write(f"\r{text}" + ("\n" if done else ""))
            if done:
                self.shown.pop(key, None)
            else:
                self.shown[key] = True
            return
        from IPython.display import display

        bundle = {"text/plain": text}
        if handle is None:
            self.shown[key] = display(bundle, raw=True, display_id=True)
        else:
            handle.update(bundle, raw=True)
        if done:
            del self.shown[key]


_open_lines = _OpenLines()


def show_output(worker: str, chunks: list[tuple[str, Any]]) -> None:
    """Runs in the kernel: print a worker's output, each line marked with its name; a
    line updated in place (``\r``) is shown in place; a ``"bar"`` chunk is a tqdm bar's
    state (:func:`show_bar`). Returns once shown.

    It is written on one thread, the timer service's, not on the RPC thread that brought
    it: ipykernel gives each thread that writes to the notebook's streams a zmq socket of
    its own (an eventfd) for as long as the thread lives, and torch's RPC threads live as
    long as the kernel. Written where they came, the soak counted 6-8 eventfds more after
    some shutdowns, one per RPC thread that had shown output for the first time."""
    _timers.on_service_thread(_show_chunks, worker, chunks)


def _show_chunks(worker: str, chunks: list[tuple[str, Any]]) -> None:
    for stream, text in chunks:
        if stream == "bar":
            show_bar(worker, text)
        else:
            _open_lines.show(worker, stream, text)


class _CallOutput:
    """Output written by one RPC call on a worker, sent to the kernel in order.

    At most one message is in flight: the kernel runs RPCs on a thread pool, so two
    messages in flight could print out of order. Lines written meanwhile wait and go
    together in the next message.
    """

    def __init__(self) -> None:
        self.buffers = {"stdout": "", "stderr": ""}
        self._pending: list[tuple[str, Any]] = []
        self._in_flight = False
        self._lock = _thread.RLock()  # the C lock itself (threading.RLock: a Python call)
        self._wrote = False  # nothing to send or wait for at close (most calls)
        # made at the first message: most calls print nothing (an Event costs ~4 us a call)
        self._idle: threading.Event | None = None
        self._delivered = 0  # messages the kernel has printed
        self._partial: _timers.Timer | None = None  # sends a line updated in place
        self._sent_partial = {"stdout": "", "stderr": ""}

    def write(self, stream: str, text: str) -> None:
        self._wrote = True
        with self._lock:
            buf = self.buffers[stream] + text
            cut = buf.rfind("\n") + 1
            self.buffers[stream] = buf[cut:]
            if cut:
                self._sent_partial[stream] = ""
                self._queue(stream, buf[:cut])
            if "\r" in self.buffers[stream] and self._partial is None:
                self._partial = _timers.after(PARTIAL_EVERY_S, self._send_partial)

    def write_bar(self, state: dict[str, Any]) -> None:
        """A tqdm bar's state (:mod:`.bars`), in order with the call's text."""
        self._wrote = True
        with self._lock:
            self._queue("bar", state)

    def _send_partial(self) -> None:
        """Send the latest state of each line updated in place (from the timer)."""
        with self._lock:
            self._partial = None
            for stream, buf in self.buffers.items():
                if "\r" not in buf:
                    continue
                at = buf.rstrip("\r").rfind("\r")
                latest = buf[at:] if at >= 0 else buf
                self.buffers[stream] = latest  # what its newline completes later
                if latest != self._sent_partial[stream]:
                    self._sent_partial[stream] = latest
                    self._queue(stream, latest)

    def _queue(self, stream: str, text: Any) -> None:
        """Text joins the last pending text of its stream, up to :data:`MESSAGE_CHARS`: a
        flood's lines went one chunk each, the kernel flushed its stream once per chunk,
        waiting for ipykernel's IO thread each time (20,000 notebook messages, 7 s, for
        20,000 lines), and a call's end gave up waiting for them on a loaded machine."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if (
                last is not None
                and last[0] == stream
                and isinstance(text, str)
                and isinstance(last[1], str)
                and len(last[1]) + len(text) <= MESSAGE_CHARS
            ):
                self._pending[-1] = (stream, last[1] + text)
            else:
                self._pending.append((stream, text))
            if not self._in_flight:
                self._send_pending()

    def _send_pending(self) -> None:  # holds self._lock
        size, cut = 0, len(self._pending)
        for i, (_, text) in enumerate(self._pending):
            size += len(text) if isinstance(text, str) else 0
            if size > MESSAGE_CHARS:  # this chunk goes next time (or alone, if the first)
                cut = max(i, 1)
                break
        chunks, self._pending = self._pending[:cut], self._pending[cut:]
        self._in_flight = True
        if self._idle is None:
            self._idle = threading.Event()
        self._idle.clear()
        fut = None
        try:
            fut = _torch.rpc_async(
                _forward.to, show_output, args=(_forward.me, chunks), timeout=SEND_TIMEOUT_S
            )
            _torch.on_done(fut, self._sent)
        except Exception as exc:  # the kernel is gone: keep the text on the worker
            self._in_flight = False
            self._idle.set()
            text = "".join(t for s, t in chunks if s != "bar")
            if sys.__stderr__ is not None:
                sys.__stderr__.write(f"{text}(nbrpc: could not forward output: {exc})\n")
        except BaseException:  # the stop button's interrupt (nbrpc._wire.cancelling) landed
            if fut is None:  # here, before the message left: its lines are pending again,
                self._pending[:0] = chunks  # and the cancelled call's close counts them
            self._in_flight = False  # the next line must not wait for a send that may not
            self._idle.set()  # have left
            raise

    def _sent(self, _fut: Any) -> None:
        with self._lock:
            self._in_flight = False
            self._delivered += 1
            if self._pending:
                self._send_pending()
            elif self._idle is not None:
                self._idle.set()

    def cancel(self) -> None:
        """The call returned, and a cancel came while its end waits for this output (on
        another thread): what was not sent yet is dropped, as a cancelled call's close
        drops it, and the wait ends once the message in flight and the note arrive."""
        if not self._wrote:
            return
        with self._lock:
            self._drop()

    def _drop(self) -> None:  # holds self._lock
        lines = sum(t.count("\n") for s, t in self._pending if s != "bar")
        lines += sum(1 for rest in self.buffers.values() if rest)
        self._pending = [(s, t) for s, t in self._pending if s == "bar"][-1:]
        self.buffers = {"stdout": "", "stderr": ""}
        if lines:
            self._queue("stderr", f"nbrpc: {lines} more lines not shown: {CUT}\n")

    def drain(self) -> None:
        """Wait (bounded) until every complete line written so far has been printed."""
        self._wait_idle()

    def _wait_idle(self) -> None:
        """Wait until every message sent has been printed in the kernel, for as long as
        messages get through: up to :data:`OUTPUT_WAIT_S` for each (a kernel that prints
        nothing more is not waited on longer). A fixed bound once let a flood that took
        the kernel longer to show (20,000 lines on a loaded machine: 13 s) return its
        result first, its last lines reaching the next cell (the soak, docs/soak.md)."""
        if self._idle is None:
            return
        seen = self._delivered
        while not self._idle.wait(OUTPUT_WAIT_S) and self._delivered != seen:
            seen = self._delivered

    def close(self, cancelled: bool = False) -> None:
        """Send what is left and wait (bounded) until the kernel has printed it all.

        ``cancelled`` (the stop button ended the call): what is not sent yet is dropped,
        with one line that says how much, and nothing is waited for. A flood's lines
        queued here went on reaching the kernel for seconds after the stop, into the next
        cells (the soak, docs/soak.md)."""
        if not self._wrote:
            return
        with self._lock:
            if self._partial is not None:
                self._partial.cancel()
                self._partial = None
            if cancelled:
                self._drop()
                return
            for stream, rest in self.buffers.items():
                if rest:
                    self._queue(stream, rest + "\n")
        self._wait_idle()


class _ForwardingStream:
    """Wraps a worker's stdout/stderr: writes from inside an RPC call go to the kernel."""

    def __init__(self, wrapped: Any, stream: str) -> None:
        self._wrapped = wrapped
        self._stream = stream

    def write(self, text: str) -> int:
        output = getattr(_call, "output", None)
        if output is None:
            return self._wrapped.write(text)
        output.write(self._stream, text)
        return len(text)

    def flush(self) -> None:
        self._wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


# -- bars (tqdm on a worker, nbrpc._wire.bars), drawn in the kernel ------------------------


def show_bars(worker: str, states: list[dict[str, Any]]) -> None:
    """Runs in the kernel: bars of ``worker`` changed (see the module doc); drawn on the
    timer service's thread, as :func:`show_output` shows lines."""
    _timers.on_service_thread(_show_bars, worker, states)


def _show_bars(worker: str, states: list[dict[str, Any]]) -> None:
    for state in states:
        show_bar(worker, state)


def show_bar(worker: str, state: dict[str, Any]) -> None:
    """One bar's new state, drawn in the cell (a widget in a notebook; text elsewhere)."""
    if not _process.in_notebook():
        end = "\n" if state["closed"] else ""
        _open_lines.show(worker, "stderr", f"\r{state['text']}{end}")
        return
    bar_rows.draw(worker, state)


def forward_output_to(kernel: str, me: str) -> None:
    """On a worker: send output printed during RPC calls to ``kernel``, marked ``me``."""
    _forward.to, _forward.me = kernel, me
    if not isinstance(sys.stdout, _ForwardingStream):
        sys.stdout = _ForwardingStream(sys.stdout, "stdout")
    if not isinstance(sys.stderr, _ForwardingStream):
        sys.stderr = _ForwardingStream(sys.stderr, "stderr")


_standard: list[Any] = []  # this process's sys.stderr once it was set up


def remember_stderr() -> None:
    """This process's sys.stderr as nbrpc set it up (a cell's, or forwarded to one)."""
    _standard[:] = [sys.stderr]


def stderr_replaced() -> bool:
    """Whether code running here replaced sys.stderr since (a test capturing it)."""
    return bool(_standard) and sys.stderr is not _standard[0]


def kernel_name() -> str | None:
    """On a worker: the name of the process its output (and debugger) goes to."""
    return _forward.to


#: the outputs of the calls running on this worker now (native output goes with the one
#: call running, see .native_output)
_running: set[_CallOutput] = set()


def only_call(call: _CallOutput) -> bool:
    """Whether ``call`` is the only call running on this worker."""
    return len(_running) == 1 and call in _running


def call_here() -> _CallOutput | None:
    """The call that output written now on this worker goes with: the one this thread
    serves, else the only call running here (None: none runs, or several do and which one
    wrote it cannot be told)."""
    current = getattr(_call, "output", None)
    if current is not None:
        return current
    calls = list(_running)
    return calls[0] if len(calls) == 1 else None


def worker_name() -> str | None:
    """On a worker: its own name, as its output is tagged."""
    return _forward.me


def begin_call() -> tuple[Any, Any]:
    """A call starts on this thread: ``(its output, the output it interrupts)``; its
    output is ``None`` where nothing is forwarded (the kernel's own calls)."""
    output = _CallOutput() if _forward.to is not None else None
    previous = getattr(_call, "output", None)
    _call.output = output
    if output is not None:
        _running.add(output)
    return output, previous


def end_call(output: Any, previous: Any, cancelled: bool = False) -> None:
    """The call of :func:`begin_call` ends: what it printed reaches the kernel first
    (``cancelled``: what it printed and was not sent yet is dropped, see ``close``)."""
    _call.output = previous
    if output is not None:
        _running.discard(output)
        output.close(cancelled)


def calling() -> bool:
    """Whether this thread runs an RPC call whose output goes to the kernel."""
    return getattr(_call, "output", None) is not None


def drain_output() -> None:
    """Wait (bounded) until the output this call printed so far is shown in the kernel."""
    output = getattr(_call, "output", None)
    if output is not None:
        output.drain()
