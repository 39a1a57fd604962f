"""The split copy into shared memory, stopped: a copy the stop button ends (SIGINT raises in
the kernel's main thread, during any wait) must not leave a part being copied behind it,
nor let the next copy return before its own parts are copied."""

import random
import signal

import pytest
import torch

from nbrpc._wire import arena


class Stop(Exception):
    """What the timer's handler raises, as the stop button's SIGINT raises KeyboardInterrupt."""


def _stop(signum, frame):
    raise Stop


@pytest.fixture
def timer():
    previous = signal.signal(signal.SIGALRM, _stop)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_copy_after_a_stopped_copy_copies_every_byte(timer):
    nbytes = 4 * arena.SPLIT_BYTES  # split over this thread and the helpers
    sources = [torch.full((nbytes,), value, dtype=torch.uint8) for value in (1, 2)]
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    rng = random.Random(66)
    for attempt in range(60):
        source = sources[attempt % 2]
        with pytest.raises(Stop):
            _copy_until_stopped(dst, source, rng.uniform(0.0002, 0.006))
        signal.setitimer(signal.ITIMER_REAL, 0)
        following = sources[(attempt + 1) % 2]
        arena.copy(dst.data_ptr(), following.data_ptr(), nbytes)
        assert torch.equal(dst, following), f"attempt {attempt}: the copy after a stop is wrong"


def _copy_until_stopped(dst, source, after):
    # the timer is set here, inside pytest.raises: set before it, on a busy machine it
    # fired inside raises() itself
    signal.setitimer(signal.ITIMER_REAL, after)
    while True:  # the timer stops it, at a different point each time
        arena.copy(dst.data_ptr(), source.data_ptr(), source.numel())
