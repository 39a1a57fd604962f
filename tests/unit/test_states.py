"""The one owner of a worker's state (``nbrpc._states``): its transitions, what calls to a
worker find, and what its listeners are told (no workers needed)."""

from __future__ import annotations

import pytest

from nbrpc import _states
from nbrpc._errors import ClusterClosedError
from nbrpc._rows import WorkerRecord, WorkerState
from nbrpc._states import Change, WorkerChange

#: the owner is the process's one: no shared cluster may run beside these tests
pytestmark = pytest.mark.usefixtures("no_cluster")


@pytest.fixture
def told():
    """Two workers of a pretend cluster, adopted; the changes a listener was told since."""
    heard: list[WorkerChange] = []
    _states.listen(heard.append)
    _states.listen(heard.append)  # registered once however often it is asked
    kernel = WorkerRecord("test-kernel", 0, 100, "h", "kernel")
    workers = [
        WorkerRecord(n, r, 100 + r, "h", f"engine {r}", order=i)
        for i, (n, r) in enumerate(_WORKERS, 1)
    ]
    _states.adopt(_states.Roster([kernel, *workers]))
    yield heard
    _states.unlisten(heard.append)
    _states.adopt(_states.Roster())  # the owner forgets them: nothing of theirs fails later calls
    assert not _states.unreachable


_WORKERS = [("test-w1", 9001), ("test-w2", 9002)]


def test_a_new_cluster_is_told_as_joined_and_its_workers_are_ready(told):
    assert told == [WorkerChange(Change.JOINED, ("test-w1", "test-w2"))]
    assert _states.state_of("test-w1") is WorkerState.READY
    assert _states.state_of("nobody") is None
    assert "test-w1" not in _states.unreachable


def test_a_worker_found_dead_fails_calls_with_the_first_reason_and_is_told_once(told):
    _states.mark_dead("test-w1", "EOF")
    _states.mark_dead("test-w1", "later")  # a second failed call: nothing new
    assert _states.state_of("test-w1") is WorkerState.DEAD
    assert _states.unreachable["test-w1"] == "EOF"
    assert told[1:] == [WorkerChange(Change.DIED, ("test-w1",), detail="EOF")]
    with pytest.raises(TypeError):
        _states.unreachable["test-w2"] = "x"  # type: ignore[index]  # read-only


def test_a_name_the_cluster_does_not_have_still_fails_its_calls():
    """On a worker (no cluster of its own) a call that lost its peer marks it too."""
    _states.mark_dead("test-elsewhere", "ECONNRESET")
    try:
        assert _states.unreachable["test-elsewhere"] == "ECONNRESET"
        assert _states.state_of("test-elsewhere") is None
    finally:
        _states.adopt(_states.Roster())


def test_a_restart_is_told_in_its_steps_and_ready_again_at_the_end(told):
    _states.mark_dead("test-w2", "EOF")
    _states.restarting(["test-w1", "test-w2"], "being restarted")
    assert _states.state_of("test-w1") is WorkerState.RESTARTING
    assert _states.unreachable == {"test-w1": "being restarted", "test-w2": "EOF"}
    _states.mark_dead("test-w1", "EOF")  # a call to the old process fails meanwhile
    assert _states.state_of("test-w1") is WorkerState.RESTARTING
    _states.left(["test-w1", "test-w2"], [9001, 9002])
    fresh = [WorkerRecord(n, r + 10, 200 + r, "h", "engine 7") for n, r in _WORKERS]
    _states.rejoined(fresh)
    assert _states.state_of("test-w1") is WorkerState.READY
    assert "test-w1" not in _states.unreachable
    assert [(c.kind, c.names) for c in told[1:]] == [
        (Change.DIED, ("test-w2",)),
        (Change.RESTARTING, ("test-w1", "test-w2")),
        (Change.LEFT, ("test-w1", "test-w2")),
        (Change.REJOINED, ("test-w1", "test-w2")),
    ]
    assert told[3].ranks == (9001, 9002)
    assert told[3].replaced


def test_a_failed_restart_leaves_the_worker_dead_saying_why(told):
    _states.restarting(["test-w1"], "being restarted")
    _states.failed(["test-w1"], "its restart failed: no engine")
    assert _states.state_of("test-w1") is WorkerState.DEAD
    assert _states.unreachable["test-w1"] == "its restart failed: no engine"
    assert told[-1] == WorkerChange(
        Change.DIED, ("test-w1",), detail="its restart failed: no engine"
    )


def test_a_shutdown_tells_leaving_left_and_stopped(told):
    _states.mark_dead("test-w2")
    _states.leaving(["test-w1", "test-w2"])
    _states.left(["test-w2"], [9002])
    _states.stopped(["test-w1"])
    assert _states.state_of("test-w1") is WorkerState.STOPPED
    assert [(c.kind, c.names, c.replaced) for c in told[2:]] == [
        (Change.LEAVING, ("test-w1", "test-w2"), False),
        (Change.LEFT, ("test-w2",), False),
        (Change.STOPPED, ("test-w1",), False),
    ]


def test_a_transition_the_table_lacks_is_refused(told):
    _states.stopped(["test-w1"])
    with pytest.raises(ClusterClosedError, match="test-w1 is stopped and cannot become"):
        _states.restarting(["test-w1"], "being restarted")


def test_a_live_view_redraws_at_once_on_a_change_and_stops_listening_when_closed():
    import threading

    from nbrpc.widgets import ClusterView

    asked = threading.Event()
    view = ClusterView(interval=60.0)  # no cluster: it shows none, and would wait a minute
    try:
        view.refresh = lambda: asked.set() or False  # type: ignore[method-assign]
        _states.leaving(["test-w9"])
        assert asked.wait(5), "the view did not ask for its data when a worker changed"
    finally:
        view.close()
    assert not view.live
    asked.clear()
    _states.leaving(["test-w9"])
    assert not asked.wait(0.2)


def test_a_scale_s_leavers_are_left_and_their_names_free_until_one_comes_back(told):
    _states.mark_dead("test-w2", "EOF")
    _states.departed_at_scale(["test-w1", "test-w2"], [9001, 9002], "12:00:01")
    assert told[-1] == WorkerChange(
        Change.LEFT, ("test-w1", "test-w2"), (9001, 9002), at="12:00:01"
    )
    assert _states.state_of("test-w1") is None  # no longer a worker of the cluster
    assert _states.departed == {"test-w1": "12:00:01", "test-w2": "12:00:01"}
    assert "test-w2" not in _states.unreachable  # unknown now, not dead
    _states.grew([WorkerRecord("test-w1", 9005, 105, "h", "engine 5", order=1)])
    assert told[-1] == WorkerChange(Change.JOINED, ("test-w1",))
    assert _states.state_of("test-w1") is WorkerState.READY
    assert _states.orders() == {"test-w1": 1}
    assert _states.departed == {"test-w2": "12:00:01"}


def test_one_change_of_the_workers_at_a_time(told):
    from nbrpc._errors import ConfigError

    with (
        _states.changing("a scale to 4 workers"),
        pytest.raises(ConfigError, match="a scale to 4 workers is running"),
        _states.changing("a restart of test-w1"),
    ):
        pass
    with _states.changing("a restart of test-w1"):  # the first one ended
        pass


def test_a_workers_state_moves_only_along_the_owner_s_transitions(told):
    assert _states.state_of("test-w1") == "ready"  # a str: rows print and compare as text
    _states.mark_dead("test-w1", "EOF")
    _states.restarting(["test-w1"], "being restarted")
    _states.rejoined([WorkerRecord("test-w1", 9011, 111, "h", "engine 11")])
    _states.stopped(["test-w1"])
    assert _states.state_of("test-w1") is WorkerState.STOPPED
    with pytest.raises(ClusterClosedError, match="test-w1 is stopped and cannot become ready"):
        _states.rejoined([WorkerRecord("test-w1", 9012, 112, "h", "engine 12")])
    assert f"{WorkerState.DEAD}" == "dead"


def test_the_roster_is_the_one_list_a_boot_a_grow_a_restart_and_a_leave_write():
    """One cluster's processes in one place: the engine of a worker still joining, its
    record once it joined, in rank order; a failed join forgets its engine."""
    roster = _states.Roster()
    _states.asked_to_join(roster, "test-w1", 7)
    _states.asked_to_join(roster, "test-w2", 8)
    assert roster.engines() == {"test-w1": 7, "test-w2": 8}
    kernel = WorkerRecord("test-kernel", 0, 100, "h", "kernel")
    _states.booted(
        roster, [kernel, WorkerRecord("test-w2", 2, 102, "h", "engine 8", engine_id=8, order=1)]
    )
    _states.not_joined(roster, ["test-w1"])
    assert roster.engines() == {"test-w2": 8}
    assert not roster.joining
    _states.adopt(roster)
    try:
        _states.asked_to_join(roster, "test-w3", 9)
        _states.grew([WorkerRecord("test-w3", 3, 103, "h", "engine 9", engine_id=9, order=2)])
        assert [r.name for r in roster.records] == ["test-kernel", "test-w2", "test-w3"]
        _states.restarting(["test-w2"], "being restarted")
        _states.asked_to_join(roster, "test-w2", 10)  # its fresh process's engine, at once
        assert roster.engines()["test-w2"] == 10
        assert roster.ready() == ["test-w3"]
        _states.rejoined([WorkerRecord("test-w2", 4, 104, "h", "engine 10", engine_id=10)])
        record = roster.find("test-w2")
        assert record is not None
        assert (record.pid, record.engine_id, record.order) == (104, 10, 1)
        assert roster.ready() == ["test-w2", "test-w3"]
        assert not roster.joining
        _states.departed_at_scale(["test-w2"], [4], "12:00:02")
        assert [r.name for r in roster.workers()] == ["test-w3"]
        assert record.state is WorkerState.LEFT
    finally:
        _states.adopt(_states.Roster())
