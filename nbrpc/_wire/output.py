"""What a call prints on a worker shows in the calling cell, as it is printed.

On workers, ``sys.stdout`` and ``sys.stderr`` are wrapped once (:func:`forward_output_to`);
while a thread runs an RPC call its writes are sent, line by line, to the notebook kernel
(an ``rpc_async`` to :func:`show_output`), prefixed with the worker's name. Before the call
returns, the pending lines are awaited, so output arrives before the result does.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from nbrpc import _torch


@dataclass
class _Forwarding:
    """Where this worker's call output goes: the kernel's name, and this worker's."""

    to: str | None = None
    me: str | None = None


_forward = _Forwarding()
_call = threading.local()  # .output: the _CallOutput of the RPC call running on this thread
OUTPUT_WAIT_S = 10.0


def show_output(worker: str, chunks: list[tuple[str, str]]) -> None:
    """Runs in the kernel: print a worker's output, each line marked with its name."""
    for stream, text in chunks:
        out = sys.stderr if stream == "stderr" else sys.stdout
        out.write("".join(f"[{worker}] {line}" for line in text.splitlines(keepends=True)))
        out.flush()


class _CallOutput:
    """Output written by one RPC call on a worker, sent to the kernel in order.

    At most one message is in flight: the kernel runs RPCs on a thread pool, so two
    messages in flight could print out of order. Lines written meanwhile wait and go
    together in the next message.
    """

    def __init__(self) -> None:
        self.buffers = {"stdout": "", "stderr": ""}
        self._pending: list[tuple[str, str]] = []
        self._in_flight = False
        self._lock = threading.RLock()
        # made at the first message: most calls print nothing (an Event costs ~4 us a call)
        self._idle: threading.Event | None = None

    def write(self, stream: str, text: str) -> None:
        buf = self.buffers[stream] + text
        cut = buf.rfind("\n") + 1
        self.buffers[stream] = buf[cut:]
        if cut:
            self._queue(stream, buf[:cut])

    def _queue(self, stream: str, text: str) -> None:
        with self._lock:
            self._pending.append((stream, text))
            if not self._in_flight:
                self._send_pending()

    def _send_pending(self) -> None:  # holds self._lock
        chunks, self._pending = self._pending, []
        self._in_flight = True
        if self._idle is None:
            self._idle = threading.Event()
        self._idle.clear()
        try:
            fut = _torch.rpc_async(
                _forward.to, show_output, args=(_forward.me, chunks), timeout=OUTPUT_WAIT_S
            )
        except Exception as exc:  # the kernel is gone: keep the text on the worker
            self._in_flight = False
            self._idle.set()
            text = "".join(t for _, t in chunks)
            if sys.__stderr__ is not None:
                sys.__stderr__.write(f"{text}(nbrpc: could not forward output: {exc})\n")
            return
        fut.add_done_callback(self._sent)

    def _sent(self, _fut: Any) -> None:
        with self._lock:
            self._in_flight = False
            if self._pending:
                self._send_pending()
            elif self._idle is not None:
                self._idle.set()

    def drain(self) -> None:
        """Wait (bounded) until every complete line written so far has been printed."""
        if self._idle is not None:
            self._idle.wait(OUTPUT_WAIT_S)

    def close(self) -> None:
        """Send what is left and wait (bounded) until the kernel has printed it all."""
        for stream, rest in self.buffers.items():
            if rest:
                self._queue(stream, rest + "\n")
        if self._idle is not None:
            self._idle.wait(OUTPUT_WAIT_S)


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


def forward_output_to(kernel: str, me: str) -> None:
    """On a worker: send output printed during RPC calls to ``kernel``, marked ``me``."""
    _forward.to, _forward.me = kernel, me
    if not isinstance(sys.stdout, _ForwardingStream):
        sys.stdout = _ForwardingStream(sys.stdout, "stdout")
    if not isinstance(sys.stderr, _ForwardingStream):
        sys.stderr = _ForwardingStream(sys.stderr, "stderr")


def kernel_name() -> str | None:
    """On a worker: the name of the process its output (and debugger) goes to."""
    return _forward.to


def begin_call() -> tuple[Any, Any]:
    """A call starts on this thread: ``(its output, the output it interrupts)``; its
    output is ``None`` where nothing is forwarded (the kernel's own calls)."""
    output = _CallOutput() if _forward.to is not None else None
    previous = getattr(_call, "output", None)
    _call.output = output
    return output, previous


def end_call(output: Any, previous: Any) -> None:
    """The call of :func:`begin_call` ends: what it printed reaches the kernel first."""
    _call.output = previous
    if output is not None:
        output.close()


def calling() -> bool:
    """Whether this thread runs an RPC call whose output goes to the kernel."""
    return getattr(_call, "output", None) is not None


def drain_output() -> None:
    """Wait (bounded) until the output this call printed so far is shown in the kernel."""
    output = getattr(_call, "output", None)
    if output is not None:
        output.drain()
