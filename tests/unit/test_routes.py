"""The call facade on a fake route (nbrpc/_calls/routes.py, facade.py): ``rpc_sync`` and
``rpc_async`` ask for a route once, send once through it and translate its failure once,
whichever route it is; a callee's error arrives untranslated; the routes are asked in
their order, and their hooks (a wait's, the calls in flight) reach every route. No worker:
the destination is a ``WorkerInfo`` and the cluster's check is let through."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from torch.distributed.rpc import WorkerInfo

import nbrpc
from nbrpc import _group, _states
from nbrpc._calls import errors, facade, routes
from nbrpc._calls.routes import Outcome
from nbrpc._errors import ConnectionLost

#: a worker no cluster of the suite has (its rank is no restarted one's)
DEST = WorkerInfo("fake-worker", 4242)


def echo(x):
    return x


class FakeRoute(routes.Route):
    """A route that records what the facade asks of it and answers ``outcome``."""

    name = "fake"

    def __init__(self, outcome: Outcome | None = None, takes: bool = True) -> None:
        self.outcome = outcome if outcome is not None else ("answer", None, None)
        self.takes = takes
        self.asked: list[tuple] = []
        self.waited: list[tuple] = []
        self.started: list[tuple] = []
        self.before_waits = 0
        self.waiting = threading.Event()  # a thread ran before_wait
        self.done: Any = None

    def take(self, dest, func, args, kwargs, main):
        self.asked.append((dest, func, args, kwargs, main))
        return ("taken", len(self.asked)) if self.takes else None

    def wait(self, taken, dest, sent, call):
        self.waited.append((taken, dest, sent, call))
        return self.outcome

    def start(self, taken, dest, sent, call, done):
        self.started.append((taken, dest, sent, call))
        self.done = done
        if self.outcome is not None:
            done(self.outcome)

    def in_flight(self) -> int:
        return 7

    def before_wait(self) -> None:
        self.before_waits += 1
        self.waiting.set()


@pytest.fixture
def fake(monkeypatch):
    """One fake route, the only one; the facade's check for a running cluster passes."""
    route = FakeRoute()
    monkeypatch.setattr(routes, "ROUTES", [route])
    monkeypatch.setattr(_group, "require_active", lambda what: None)
    return route


@pytest.fixture
def translations(monkeypatch):
    """Every call of :func:`errors.translate`, counted (and translated as it would be)."""
    seen: list[BaseException] = []
    translate = errors.translate

    def counted(exc, what, dest, timeout):
        seen.append(exc)
        return translate(exc, what, dest, timeout)

    monkeypatch.setattr(errors, "translate", counted)
    return seen


#: each way the facade sends, ``rpc_sync`` on the main thread (it waits itself) and
#: ``rpc_async`` (the route settles its future)
CALLS = {
    "rpc_sync": lambda: nbrpc.rpc_sync(DEST, echo, timeout=0),
    "rpc_async": lambda: nbrpc.rpc_async(DEST, echo, timeout=0).wait(),
}


def torchs_timeout() -> RuntimeError:
    return RuntimeError("RPC ran for more than the set timeout (5000 ms) and timed out")


def test_rpc_sync_asks_once_and_sends_once_on_the_main_thread(fake, translations):
    assert nbrpc.rpc_sync(DEST, echo, args=(1,), kwargs={"k": 2}, timeout=5) == "answer"
    assert fake.asked == [(DEST, echo, (1,), {"k": 2}, True)]  # main: it waits itself
    assert len(fake.waited) == 1
    assert not fake.started
    taken, dest, sent, call = fake.waited[0]
    assert taken == ("taken", 1)  # what its take() answered, handed back
    assert dest is DEST
    assert sent == (echo, (1,), {"k": 2})
    assert (call.dest, call.func, call.limit, call.timeout) == ("fake-worker", echo, 5.0, 5)
    assert not translations


def test_rpc_async_asks_once_and_starts_once(fake, translations):
    fut = nbrpc.rpc_async(DEST, echo, args=(1,), timeout=0)
    assert fut.wait() == "answer"
    assert fake.asked == [(DEST, echo, (1,), None, False)]
    assert len(fake.started) == 1
    assert not fake.waited
    assert not fake.started[0][3].sync  # torch's profiler names it rpc_async
    assert not translations


def test_rpc_sync_off_the_main_thread_starts_as_rpc_sync(fake):
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(nbrpc.rpc_sync(DEST, echo, timeout=0)))
    thread.start()
    thread.join(10)
    assert got == ["answer"]
    assert [main for *_, main in fake.asked] == [False]
    assert len(fake.started) == 1
    assert fake.started[0][3].sync  # torch's profiler names it rpc_sync


@pytest.mark.parametrize("kind", CALLS)
def test_a_routes_failure_is_translated_once(fake, translations, kind):
    fake.outcome = (None, None, torchs_timeout())
    with pytest.raises(nbrpc.RpcTimeoutError, match="call of echo on fake-worker timed out"):
        CALLS[kind]()
    assert translations == [fake.outcome[2]]
    assert len(fake.asked) == 1
    assert len(fake.waited) + len(fake.started) == 1


@pytest.mark.parametrize("kind", CALLS)
def test_a_lost_connection_of_any_route_is_translated_the_same_way(
    fake, translations, monkeypatch, kind
):
    """A route's own lost connection (``ConnectionLost``: a lane's ``LaneLost`` is one)
    is translated as torch's is: no route is named in the translation. (During a
    non-graceful shutdown, so no worker is marked dead.)"""
    monkeypatch.setattr(errors.known, "cancelled", True)
    fake.outcome = (None, None, ConnectionLost("the lane to fake-worker closed"))
    with pytest.raises(nbrpc.ClusterClosedError, match="shut down with graceful=False"):
        CALLS[kind]()
    assert len(translations) == 1


@pytest.mark.parametrize("kind", CALLS)
def test_another_connection_error_is_not_taken_for_a_lost_worker(fake, translations, kind):
    """A ConnectionError that is not a route's lost connection (a WorkerDiedError already
    made, a socket error of the user's) is returned as it is: no worker marked dead."""
    fake.outcome = (None, None, ConnectionResetError("a socket of the user's"))
    with pytest.raises(ConnectionResetError, match="a socket of the user's"):
        CALLS[kind]()
    assert len(translations) == 1
    assert "fake-worker" not in _states.unreachable


@pytest.mark.parametrize("kind", CALLS)
def test_the_callees_error_is_raised_as_it_is_untranslated(fake, translations, kind):
    """What the callee raised (rebuilt here by the route) is not torch's error: even one
    whose words would read as a timeout keeps its type and message."""
    fake.outcome = (None, RuntimeError("the callee's own: timed out on its disk"), None)
    with pytest.raises(RuntimeError, match="the callee's own") as raised:
        CALLS[kind]()
    assert not isinstance(raised.value, nbrpc.RpcTimeoutError)
    assert not translations


def test_the_routes_are_asked_in_their_order_until_one_takes_the_call(fake, monkeypatch):
    declines = FakeRoute(takes=False)
    last = FakeRoute(("from the last", None, None))
    monkeypatch.setattr(routes, "ROUTES", [declines, last])
    assert nbrpc.rpc_sync(DEST, echo, timeout=0) == "from the last"
    assert len(declines.asked) == 1
    assert not declines.waited
    assert len(last.asked) == 1
    assert len(last.waited) == 1


def test_a_wait_off_the_main_thread_runs_every_routes_hook_first(fake):
    """A future waited for on a thread that may be a route's own (a lane's reader runs a
    future's callbacks): each route's ``before_wait`` runs first, once."""
    fake.outcome = None  # the call's outcome comes later
    fut = nbrpc.rpc_async(DEST, echo, timeout=0)
    got: list[Any] = []
    waiting = threading.Thread(target=lambda: got.append(fut.wait()))
    waiting.start()
    assert fake.waiting.wait(10)
    fake.done(("later", None, None))
    waiting.join(10)
    assert got == ["later"]
    assert fake.before_waits == 1


def test_calls_in_flight_are_every_routes(fake, monkeypatch):
    monkeypatch.setattr(routes, "ROUTES", [fake, FakeRoute()])
    assert facade.calls_in_flight() == 14


def test_the_registered_routes_a_lane_first_and_tensorpipe_last_which_takes_every_call():
    assert [route.name for route in routes.ROUTES] == ["lane", "tensorpipe"]
    assert routes.ROUTES[-1].take(DEST, echo, (), None, main=True) is not None
