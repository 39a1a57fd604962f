"""``_process.interrupts_deferred``: the stop button's interrupt held while processes are
started and recorded (a controller, engines), then delivered; a press there left
processes nothing stopped."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nbrpc import _process


def _press_inside(ran: list[str]) -> None:
    with _process.interrupts_deferred():
        # raised in this thread: sent to the process, the signal may go to any thread (the
        # shared-memory copy's helpers live in this process too), and the torch tier's
        # run once finished the block with it not yet seen
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.1)  # a signal handler runs between bytecodes: it had its chance
        ran.append("to its end")


@pytest.fixture
def python_s_handler():
    """SIGINT handled as in a terminal's Python: a background job (a make test started
    with &) inherits it ignored, and the press then rightly raised nothing (the torch
    tier's 'DID NOT RAISE', twice)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_press_inside_is_delivered_once_the_block_ends(python_s_handler):
    ran: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _press_inside(ran)
    assert ran == ["to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_press_no_interrupt_and_the_handler_is_put_back():
    before = signal.getsignal(signal.SIGINT)
    with _process.interrupts_deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is before


def test_a_handler_that_ignores_the_interrupt_is_respected():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _process.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_elsewhere_than_the_main_thread_it_holds_nothing():
    seen = []

    def run() -> None:
        with _process.interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


def test_an_interrupt_in_a_callback_run_at_once_is_raised_not_dropped():
    """torch drops what a done callback raises (it logs it). A callback run at once (the
    future was done) on the thread that adds it is where the stop button's interrupt
    landed, in a flood's output sent from a cancelled call: ``_torch.on_done`` raises it
    there. One that runs later, on the thread that completes the future, is torch's."""
    import pytest
    import torch

    from nbrpc import _torch

    def stop(_fut):
        raise KeyboardInterrupt

    done = torch.futures.Future()
    done.set_result(1)
    with pytest.raises(KeyboardInterrupt):
        _torch.on_done(done, stop)
    later = torch.futures.Future()
    ran: list[int] = []
    _torch.on_done(later, lambda f: ran.append(f.value()))
    later.set_result(2)
    assert ran == [2]
