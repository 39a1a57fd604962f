"""Calls made inside calls, nested deeper than the RPC threads (``nbrpc._calls.deadlock``).

A 40-deep ping-pong between two workers of 16 threads each holds every thread of both in
a call waiting on the other. torch alone waits out the calls' timeouts and the workers
stay jammed; nbrpc says why with a ``ThreadsExhaustedError`` within seconds, frees every
thread, and the next call answers at once. Driven in a real Jupyter kernel, as a user
runs it.
"""

from __future__ import annotations

import time

import pytest
from conftest import running_kernel

FUNCS = """
import nbrpc

def ping(n, me, other):   # a call made inside a call, n deep
    if n == 0:
        return "done"
    return nbrpc.rpc_sync(other, ping, args=(n - 1, other, me))
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("%load_ext nbrpc\n%rpc_init -n 2", FUNCS) as k:
        yield k


def test_nested_calls_within_the_threads_answer(kernel):
    assert (
        kernel.value("nbrpc.rpc_sync('worker1', ping, args=(10, 'worker1', 'worker2'))") == "done"
    )


def test_nested_calls_that_use_up_the_threads_say_why_and_free_the_cluster(kernel):
    t0 = time.monotonic()
    _, errors = kernel.execute(
        "nbrpc.rpc_sync('worker1', ping, args=(40, 'worker1', 'worker2'), timeout=20)"
    )
    took = time.monotonic() - t0
    assert errors
    assert errors[0].startswith("ThreadsExhaustedError")
    text = kernel.shown_error()
    for words in ("RPC threads of worker1, worker2", "--threads", "async_execution"):
        assert words in text
    assert took < 15, f"the jam was noticed after {took:.1f} s (the timeout: 20 s)"
    t0 = time.monotonic()
    assert kernel.value("nbrpc.rpc_sync('worker2', min, args=(1, 2))") == 1
    assert time.monotonic() - t0 < 5, "the cluster stayed jammed after the error"
    assert (
        kernel.value("nbrpc.rpc_sync('worker1', ping, args=(10, 'worker1', 'worker2'))") == "done"
    )
