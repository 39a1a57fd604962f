"""The lanes' route seam (nbrpc/_wire/lanes/caller.py): what :func:`lanes.route` answers,
and why, for each reason a call takes no lane; a lane's :class:`Reply` for each kind of
answer. One process: this one listens on a lane in a temporary directory and calls itself
(no worker). In the whole suite this process is also the kernel of the shared cluster,
whose lanes are this process's too: the cluster is shut down first (the next test that
needs one starts one, ``conftest.ensure_cluster``)."""

from __future__ import annotations

import contextlib
import tempfile
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.rpc as rpc

import nbrpc
from nbrpc import _process
from nbrpc._wire import lanes
from nbrpc._wire.lanes.callee import take


def add(a, b):
    return a + b


def grad_tensor():
    return torch.ones(2, requires_grad=True)  # a lane does not carry it: kept for take()


@rpc.functions.async_execution
def later(x):
    return torch.futures.Future()


def wait(one_slice, limit):
    """The main thread's wait, without prompts: slices until an answer or ``limit``."""
    while not one_slice():
        pass
    return True


@pytest.fixture(autouse=True)
def no_cluster():
    """No cluster, so no lanes of its own, in this process."""
    with contextlib.suppress(nbrpc.NotInitializedError):
        nbrpc.current()
        nbrpc.shutdown()
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
    assert reply.through_torch(("sent",)) is None
    assert reply.got == 3
    assert not route.lane.busy  # given back: the next call takes it
    assert lanes.route(me, add, (3, 4), None, main=True).lane is route.lane


def test_a_reply_the_lane_cannot_carry_is_fetched_through_torch(me):
    route = lanes.route(me, grad_tensor, (), None, main=True)
    reply = route.lane.ask(route.payload, 5.0, wait)
    func, args, kwargs = reply.through_torch(("sent",))
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
