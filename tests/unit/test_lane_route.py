"""The lanes' side of the lane route (nbrpc/_wire/lanes/caller.py and lane.py, and
nbrpc/_calls/lane_route.py above it): what :func:`lanes.route` answers, and why, for each
reason a call takes no lane; a lane's :class:`Reply` for each kind of answer. One process:
this one listens on a lane in a temporary directory and calls itself (no worker). In the
whole suite this process is also the kernel of the shared cluster, whose lanes are this
process's too: the cluster is shut down first (the next test that needs one starts one,
``conftest.ensure_cluster``)."""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import wait_until

from nbrpc import _process
from nbrpc._calls import spelling
from nbrpc._wire import lanes
from nbrpc._wire.lanes.callee import take


def add(a, b):
    return a + b


def grad_tensor():
    return torch.ones(2, requires_grad=True)  # a lane does not carry it: kept for take()


def on_device():
    return torch.empty(2, device="meta")  # a tensor on a device, as a CUDA one is


@rpc.functions.async_execution
def later(x):
    return torch.futures.Future()


def wait(one_slice, limit):
    """The main thread's wait, without prompts: slices until an answer or ``limit``."""
    while not one_slice():
        pass
    return True


@pytest.fixture(autouse=True)
def no_lanes(no_cluster):
    """No cluster, so no lanes of its own, in this process."""
    assert lanes.directory() is None


@pytest.fixture
def me():
    """This process listening for lanes under its name, and a WorkerInfo-like
    destination for itself (a short directory: a socket's path holds 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="lanes-", dir="/tmp") as directory:
        assert lanes.open_here(directory, threads=2)
        yield SimpleNamespace(id=0, name=_process.name())
        lanes.close()


def test_with_lanes_off_no_call_takes_one():
    route = lanes.route(SimpleNamespace(id=0, name=_process.name()), add, (1, 2), None, main=True)
    assert route.lane is None
    assert route.why is lanes.Why.OFF
    assert "--no-fast-calls" in route.why.value  # the reason, in words


def test_a_small_call_takes_the_main_lane_reserved_and_its_reply_is_the_value(me):
    route = lanes.route(me, add, (1, 2), None, main=True)
    assert route.why is None
    assert route.lane is not None
    assert route.payload
    busy = lanes.route(me, add, (1, 2), None, main=True)
    assert busy.lane is None
    assert busy.why is lanes.Why.BUSY
    reply = route.lane.ask(route.payload, 5.0, wait)
    assert reply.lost is None
    assert reply.answered
    assert reply.through_torch(me, ("sent",)) is None
    assert reply.got == 3
    assert not route.lane.busy  # given back: the next call takes it
    assert lanes.route(me, add, (3, 4), None, main=True).lane is route.lane


def test_a_reply_the_lane_cannot_carry_is_fetched_through_torch(me):
    route = lanes.route(me, grad_tensor, (), None, main=True)
    reply = route.lane.ask(route.payload, 5.0, wait)
    assert not reply.answered
    func, args, kwargs = reply.through_torch(me, ("sent",))
    assert func is take
    assert kwargs is None
    kept = take(*args)  # what TensorPipe's call of take() returns on the callee
    assert kept.requires_grad
    assert torch.equal(kept.detach(), torch.ones(2))


def test_a_shared_lane_hands_its_reply_to_the_callback(me):
    route = lanes.route(me, add, (torch.ones(2), 1), None, main=False)
    got, done = [], threading.Event()
    route.lane.post(route.payload, lambda reply: (got.append(reply), done.set()))
    assert done.wait(5)
    assert torch.equal(got[0].got, torch.full((2,), 2.0))


def test_paused_lanes_and_a_lost_lane(me):
    lanes.pause(True)
    assert lanes.route(me, add, (1, 2), None, main=True).why is lanes.Why.PAUSED
    lanes.pause(False)
    route = lanes.route(me, add, (1, 2), None, main=False)
    route.lane.close()  # as when the peer's process ends
    got = []
    route.lane.post(route.payload, got.append)
    assert isinstance(got[0].lost, lanes.LaneLost)
    assert "closed" in str(got[0].lost)


@pytest.mark.parametrize(
    ("call", "args", "why"),
    [
        (add, (torch.ones(2, requires_grad=True), 1), lanes.Why.NOT_LANE),
        (add, (torch.ones(1 << 15), 1), lanes.Why.NOT_LANE),  # 128 KB: not a lane's
        (add, (lambda: None, threading.Lock()), lanes.Why.NOT_LANE),  # does not pickle
        (later, (1,), lanes.Why.ASYNC_EXECUTION),
        # a device's tensor (CUDA's on a GPU cluster; "meta" is one on any machine)
        (add, (torch.empty(2, device="meta"), 1), lanes.Why.ON_DEVICE),
        (add, ({"x": [torch.ones(1), torch.empty(1, device="meta")]}, 1), lanes.Why.ON_DEVICE),
    ],
)
def test_what_a_call_carries_can_rule_a_lane_out(me, call, args, why):
    route = lanes.route(me, call, args, None, main=True)
    assert route.lane is None
    assert route.why is why


def test_a_peer_with_no_listener_has_no_lane(me):
    nobody = SimpleNamespace(id=7, name="nobody")
    assert lanes.route(nobody, add, (1, 2), None, main=True).why is lanes.Why.NO_LANE
    assert lanes.route(nobody, add, (1, 2), None, main=False).why is lanes.Why.NO_LANE


def test_a_reply_on_a_device_is_fetched_and_the_function_takes_torch_from_then_on(me):
    """On a GPU cluster: a call that holds no CUDA tensor takes a lane; a reply that holds
    one is kept and fetched through TensorPipe (device maps applied there), and the
    function's later calls to that worker skip the lane round."""
    route = lanes.route(me, on_device, (), None, main=True)
    assert route.lane is not None  # its arguments hold no device's tensor
    reply = route.lane.ask(route.payload, 5.0, wait)
    assert reply.kind == lanes.ON_DEVICE
    func, args, _ = reply.through_torch(me, (on_device, (), None))  # (and remembers it)
    assert func is take
    kept = take(*args)
    assert kept.device.type == "meta"
    again = lanes.route(me, on_device, (), None, main=True)
    assert again.lane is None
    assert again.why is lanes.Why.ANSWERS_ON_DEVICE
    assert lanes.route(me, add, (1, 2), None, main=True).lane is not None  # others: lanes
    elsewhere = SimpleNamespace(id=5, name="elsewhere")  # the same function, another worker
    assert lanes.route(elsewhere, on_device, (), None, main=True).why is lanes.Why.NO_LANE


def test_the_functions_remembered_as_answering_on_a_device_are_bounded(me):
    from nbrpc._wire.lanes import lane as lane_module

    made = [lambda i=i: i for i in range(lane_module.ON_DEVICE_KEPT + 3)]
    for func in made:
        lanes.answered_on_device(me, func)
    assert lanes.route(me, made[0], (), None, main=True).lane is not None  # forgotten first
    assert lanes.route(me, made[-1], (), None, main=True).why is lanes.Why.ANSWERS_ON_DEVICE
    lanes.close()
    lanes_dir = tempfile.mkdtemp(prefix="lanes-", dir="/tmp")
    assert lanes.open_here(lanes_dir, threads=2)
    try:  # a closed cluster's memory goes with its lanes
        assert lanes.route(me, made[-1], (), None, main=True).lane is not None
    finally:
        lanes.close()
        os.rmdir(lanes_dir)


def test_a_fetch_torch_refuses_to_start_fails_the_call_instead_of_leaving_it_waiting(me):
    """A shared lane's reply that TensorPipe must fetch, on the lane's reader thread: when
    torch refuses to start that fetch (here: this process is in no group, or in one
    without this name, as after the suite's shared cluster; on a cluster, a worker that
    died meanwhile), the call's future fails with torch's error."""
    from nbrpc._calls import errors, facade, lane_route

    out = torch.futures.Future()
    call = errors.Sent(me.name, grad_tensor, 0.0, None)
    route = lanes.route(me, grad_tensor, (), None, main=False)
    sent = (grad_tensor, (), None)
    done = facade.settles(out, call)
    route.lane.post(route.payload, lambda reply: lane_route.settle(reply, me, sent, call, done))
    deadline = time.monotonic() + 5
    while not out.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.done(), "the call's future still waits after torch refused the fetch"
    with pytest.raises(Exception, match=r"not been initialized|Cannot get WorkerInfo"):
        out.wait()
    assert not route.lane.closed  # the lane's reader lives on for the next call


def many_bytes(n):
    return bytes(n)


def test_a_call_or_reply_over_a_frames_limit_is_left_to_torch(me, monkeypatch):
    """A lane's frame holds 1 GiB (a reader drops a longer one as not a peer's): a call
    that pickles to more takes TensorPipe, and a reply that does is kept for TensorPipe's
    fetch; the lane stays. (The limit is made 1000 bytes here.)"""
    from nbrpc._wire.lanes import callee, caller

    monkeypatch.setattr(caller, "MAX_PAYLOAD", 1000)
    assert lanes.route(me, add, (b"x" * 2000, b""), None, main=True).why is lanes.Why.NOT_LANE
    monkeypatch.setattr(callee, "MAX_PAYLOAD", 1000)
    route = lanes.route(me, many_bytes, (5000,), None, main=True)
    reply = route.lane.ask(route.payload, 5.0, wait)
    func, args, _ = reply.through_torch(me, ("sent",))
    assert func is take
    assert take(*args) == bytes(5000)
    again = lanes.route(me, many_bytes, (10,), None, main=True)
    assert again.lane is route.lane
    assert again.lane.ask(again.payload, 5.0, wait).got == bytes(10)


def posted(me, func, args):
    """``func(*args)`` called on this process's shared lane, as ``rpc_async`` calls it:
    nbrpc's future for it, and the lane."""
    from nbrpc._calls import errors, facade, lane_route

    out = facade.Future()
    call = errors.Sent(me.name, func, 0.0, None)
    route = lanes.route(me, func, args, None, main=False)
    assert route.lane is not None
    sent, done = (func, args, None), facade.settles(out, call)
    route.lane.post(route.payload, lambda reply: lane_route.settle(reply, me, sent, call, done))
    return out, route.lane


GATE = threading.Event()


def gated():
    """A call that ends when the test opens ``GATE``: its future's callbacks, added
    before, then run on the lane's reader, not on the test's thread."""
    assert GATE.wait(30)
    return "opened"


def nap(seconds):
    time.sleep(seconds)
    return seconds


@pytest.mark.parametrize(
    "waits",
    [lambda fut: fut.wait(), lambda fut: spelling.wait_all([fut])[0]],
    ids=["Future.wait", "torch.futures.wait_all"],
)
def test_a_callback_on_a_lanes_reader_may_wait_for_another_call_on_that_lane(
    me, waits, monkeypatch
):
    """``first.then(lambda f: second.wait())``: the callback runs on the shared lane's
    reader, and ``second``'s reply comes on that lane; the wait hands the reading to
    another thread (without, the callback waited for itself: a timeout, or forever).
    So does torch's spelling, ``torch.futures.wait_all``, routed. (The watcher of slow
    callbacks, which would hand it over too, looks away here.)"""
    from nbrpc._wire.lanes import lane as lane_module

    monkeypatch.setattr(lane_module, "SLOW_CALLBACK_S", 3600.0)
    GATE.clear()
    start = functools.partial(posted, me)
    (first, lane), (second, same) = start(gated, ()), start(nap, (0.5,))
    assert same is lane
    both = first.then(lambda f: (f.value(), waits(second)))
    GATE.set()
    deadline = time.monotonic() + 10
    while not both.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert both.done(), "the callback still waits for a reply only its own thread reads"
    assert both.value() == ("opened", 0.5)
    third, again = start(nap, (0.0,))  # the lane goes on, read by the new thread
    assert again is lane
    assert third.wait() == 0.0
    assert not lane.closed


def test_a_slow_callback_on_a_lanes_reader_holds_no_other_reply_up(me):
    """``first.then(slow)``: torch runs the callback on one of its RPC threads, and other
    replies come meanwhile. On a lane it runs on the reader: after SLOW_CALLBACK_S
    another thread reads the lane, so ``second``'s reply is not held for the 2 s of
    ``slow`` (without: second.wait() took them all)."""
    from nbrpc._wire.lanes import lane as lane_module

    GATE.clear()
    start = functools.partial(posted, me)
    first, lane = start(gated, ())
    slow = first.then(lambda f: nap(2.0))
    GATE.set()
    assert wait_until(first.done, timeout=5)  # its callback runs now, for 2 s
    t0 = time.monotonic()
    second, same = start(nap, (0.05,))
    assert same is lane
    assert second.wait() == 0.05
    took = time.monotonic() - t0
    assert took < 1.0, f"the reply waited {took:.2f} s behind a callback"
    assert not slow.done()  # the callback still runs, on the thread that began it
    assert slow.wait() == 2.0
    third, again = start(nap, (0.0,))  # the lane goes on, one reader at a time
    assert again is lane
    assert third.wait() == 0.0
    assert not lane.closed

    def readers():
        return [t for t in threading.enumerate() if t.name == f"nbrpc-lane-{lane.dest}"]

    assert wait_until(lambda: readers() == [lane.reader]), readers()  # the old one ended
    assert lane_module.SLOW_CALLBACK_S < 1.0


def test_an_rpc_async_to_a_peer_with_a_device_map_takes_torch_and_an_rpc_sync_a_lane(me):
    """On a GPU cluster torch runs each rpc_async on CUDA streams of its own (issue 63's
    risk 5): four 50 ms GPU calls at once took 0.21 s on a lane, 0.06 s through
    TensorPipe, on an H200. A synchronous call still takes its lane."""
    lanes.place_by({me.name: {"cuda:0": "cuda:0"}})
    try:
        assert lanes.route(me, add, (1, 2), None, main=False).why is lanes.Why.ASYNC_ON_GPU
        sync = lanes.route(me, add, (1, 2), None, main=True)
        assert sync.lane is not None
        sync.lane.busy = False  # (reserved for a call this test does not make)
    finally:
        lanes.place_by({})
    assert lanes.route(me, add, (1, 2), None, main=False).lane is not None
