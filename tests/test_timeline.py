"""nbrpc.record(): every call of the cluster as a row, on one clock; the Chrome trace; the
TimelineView; %%rpc_timeline and %rpc_stacks (nbrpc.stacks() itself: tests/test_stacks.py)."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
import torch
from conftest import COUNTER, running_kernel

import nbrpc
from nbrpc import widgets

CELL = (
    """
import time
import torch
import nbrpc

def inner(x):
    time.sleep(0.02)
    return x * 2

def outer(x):
    time.sleep(0.01)
    return nbrpc.rpc_sync("worker2", inner, (x,)) + 1

def boom():
    raise KeyError("nope")

def big(n):
    return torch.zeros(n)

def ask_kernel(x):
    return nbrpc.rpc_sync(KERNEL, inner, (x,))
"""
    + COUNTER
)


@pytest.fixture
def code(nb, cluster):
    me = nbrpc.get_worker_info().name
    return nb(CELL.replace("KERNEL", repr(me)))


def _by_function(rows, name):
    found = [r for r in rows if r["function"] == name]
    assert found, f"no call of {name} in {[r['function'] for r in rows]}"
    return found


def test_every_call_is_a_row_with_its_parent_times_bytes_path_and_outcome(cluster, code):
    me = nbrpc.get_worker_info().name
    nbrpc.rpc_sync("worker1", code.outer, (torch.ones(3),))  # warm: the first call ships code
    counter = nbrpc.remote("worker2", code.Counter)
    with nbrpc.record() as rec:
        out = nbrpc.rpc_sync("worker1", code.outer, (torch.ones(3),))
        nbrpc.rpc_sync("worker2", torch.add, (torch.ones(2), 1))
        with pytest.raises(KeyError):
            nbrpc.rpc_sync("worker1", code.boom)
        large = nbrpc.rpc_sync("worker1", code.big, (1_000_000,))
        counter.rpc_sync().add(5)
        nbrpc.rpc_sync("worker2", code.ask_kernel, (torch.ones(1),))
    nbrpc.rpc_sync("worker1", code.inner, (torch.ones(1),))  # after the block: not recorded
    assert torch.equal(out, torch.ones(3) * 2 + 1)
    assert large.numel() == 1_000_000
    rows = rec.calls
    assert len(rows) == 8, [(r["caller"], r["callee"], r["function"]) for r in rows]
    assert len({r["id"] for r in rows}) == len(rows)

    (outer,) = _by_function(rows, "outer")
    nested = [r for r in _by_function(rows, "inner") if r["parent"] == outer["id"]]
    assert len(nested) == 1
    (inner,) = nested
    assert (outer["caller"], outer["callee"], outer["parent"]) == (me, "worker1", None)
    assert (inner["caller"], inner["callee"]) == ("worker1", "worker2")
    # one clock: the nested call lies within its parent, each call after its sending
    assert outer["start_s"] <= inner["sent_s"] <= inner["start_s"] <= inner["end_s"]
    assert inner["end_s"] <= outer["end_s"]
    assert inner["end_s"] - inner["start_s"] >= 0.02
    assert outer["end_s"] - outer["start_s"] >= 0.03
    for r in rows:
        assert 0 <= r["sent_s"] <= r["start_s"] <= r["end_s"] <= rec.seconds
        assert r["bytes_in"]
        assert r["bytes_in"] > 0

    (add,) = _by_function(rows, "torch.add")
    assert add["ok"]
    assert add["path_in"] == "lane"  # a small call: tensors in the lane's pickle
    assert (add["route"], outer["route"], inner["route"]) == ("lane", "lane", "tensorpipe")
    assert add["bytes_out"] > 0
    (failed,) = _by_function(rows, "boom")
    assert not failed["ok"]
    assert failed["error"] == "KeyError"
    (zeros,) = _by_function(rows, "big")
    assert zeros["bytes_out"] >= 4_000_000
    assert zeros["path_out"] in ("arena", "segment")  # the lane's callee left it to TensorPipe
    assert zeros["route"] == "lane"
    (method,) = _by_function(rows, "Counter.add")
    assert method["callee"] == "worker2"
    (asked,) = _by_function(rows, "ask_kernel")
    from_worker = [r for r in _by_function(rows, "inner") if r["parent"] == asked["id"]]
    assert [(r["caller"], r["callee"]) for r in from_worker] == [("worker2", me)]

    text = repr(rec)
    assert "8 calls between 3 processes, 1 failed" in text
    assert "KeyError" in text


def test_the_saved_trace_has_a_track_per_process_and_an_event_and_arrow_per_row(
    cluster, code, tmp_path
):
    with nbrpc.record() as rec:
        nbrpc.rpc_sync("worker1", code.outer, (torch.ones(2),))
        nbrpc.rpc_sync("worker2", code.inner, (torch.ones(2),))
    path = rec.save(tmp_path / "calls.json")
    trace = json.loads(pathlib.Path(path).read_text())
    events = trace["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    assert set(tracks) == set(rec.processes)
    runs = {e["args"]["id"]: e for e in events if e["ph"] == "X" and e["cat"].startswith("call")}
    rows = rec.calls
    assert set(runs) == {r["id"] for r in rows}
    for r in rows:
        e = runs[r["id"]]
        assert e["name"] == r["function"]
        assert e["pid"] == tracks[r["callee"]]
        assert e["ts"] == pytest.approx(r["start_s"] * 1e6)
        assert e["dur"] == pytest.approx((r["end_s"] - r["start_s"]) * 1e6)
        assert e["args"]["parent"] == r["parent"]
        assert e["args"]["caller"] == r["caller"]
        starts = [x for x in events if x["ph"] == "s" and x["id"] == r["id"]]
        ends = [x for x in events if x["ph"] == "f" and x["id"] == r["id"]]
        assert len(starts) == len(ends) == 1
        assert starts[0]["pid"] == tracks[r["caller"]]
        assert ends[0]["pid"] == e["pid"]
        assert starts[0]["ts"] == pytest.approx(r["sent_s"] * 1e6)
        assert ends[0]["tid"] == e["tid"]


def test_the_timeline_view_draws_every_call_and_updates_while_recording(cluster, code):
    with nbrpc.record() as rec:
        view = widgets.TimelineView(rec, interval=0.1)
        assert view.live
        nbrpc.rpc_sync("worker1", code.outer, (torch.ones(2),))
        deadline = time.monotonic() + 10
        while len(view.data["calls"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(view.data["calls"]) == 2, "the view did not update while recording"
        # a row is handed out live once its reply was pickled: it has the reply's size
        assert all(c["bytes_out"] > 0 for c in view.data["calls"]), view.data["calls"]
    view.refresh()
    assert not view.live
    assert not view.data["recording"]
    ids = {str(r["id"]) for r in rec.calls}
    assert all(f'data-call="{i}"' in view.html for i in ids)
    (outer,) = _by_function(rec.calls, "outer")
    assert f'data-parent="{outer["id"]}"' in view.html
    assert "outer: " in view.html  # the tooltip (<title>) is the row
    assert "timeline (recorded): 2 calls" in repr(view)
    view.close()


def test_a_live_drain_hands_out_rows_whose_reply_was_pickled_and_holds_the_others(cluster):
    from nbrpc._wire import recording

    recording.start("drain-test")
    try:
        rows = recording.active().rows
        now = recording.clock()
        replied = {"id": 1, "end": now, "bytes_out": 10, "_reply": True}
        waiting = {"id": 2, "end": now, "bytes_out": 0}  # its reply not pickled yet
        rows += [replied, waiting]
        assert [r["id"] for r in recording.drain("drain-test")["rows"]] == [1]
        waiting["_reply"] = True
        assert [r["id"] for r in recording.drain("drain-test")["rows"]] == [2]
    finally:
        recording.stop("drain-test")


def test_recording_needs_a_cluster_and_a_stopped_recording_records_nothing(cluster, code):
    rec = nbrpc.record().start()
    rec.stop()
    nbrpc.rpc_sync("worker1", code.inner, (torch.ones(1),))
    assert rec.calls == []
    assert not rec.recording
    assert "0 calls" in repr(rec)


MAGIC_SETUP = """%load_ext nbrpc
%rpc_init -n 2 --quiet
import time, nbrpc

def work(x):
    time.sleep(0.01)
    return x + 1

def spin(seconds):
    t = time.time()
    while time.time() - t < seconds:
        pass
    return seconds
"""


def test_rpc_timeline_records_its_cell_and_rpc_stacks_prints_the_threads(tmp_path):
    trace = tmp_path / "cell.json"
    with running_kernel(MAGIC_SETUP) as k:
        shown: list[str] = []

        def hook(msg):
            if msg["msg_type"] in ("display_data", "update_display_data", "stream"):
                data = msg["content"].get("data", {})
                shown.append(data.get("text/plain", "") or msg["content"].get("text", ""))

        k.kc.execute_interactive(
            f"%%rpc_timeline --save {trace}\n"
            "a = nbrpc.rpc_sync('worker1', work, (1,))\n"
            "b = nbrpc.rpc_sync('worker2', work, (a,))\n",
            output_hook=hook,
            timeout=60,
        )
        assert shown[0].startswith("timeline (recording)"), shown  # live, as the cell runs
        final = [s for s in shown if s.startswith("timeline (recorded): 2 calls")]
        assert final, shown
        assert "work" in final[0], shown
        assert any(f"trace written to {trace}" in s for s in shown)
        assert k.value("[r['callee'] for r in rpc_timeline.calls]") == ["worker1", "worker2"]
        assert k.value("b") == 3
        assert len(json.loads(trace.read_text())["traceEvents"]) > 4

        k.run("fut = nbrpc.rpc_async('worker1', spin, (3.0,)); time.sleep(0.5)")
        out = k.run("%rpc_stacks worker1  # the busy one")
        assert "== worker1" in out
        assert "read by its stack thread" in out
        assert "serving spin from" in out, out
        assert "in spin" in out, out
        assert k.value("fut.wait()") == 3.0

        # idle now: only the threads that serve a call or run the user's code (it printed
        # every thread, 25,000-34,000 characters), the others counted; --all shows them
        out = k.run("%rpc_stacks")
        every = k.run("%rpc_stacks --all")
        print(f"%rpc_stacks of an idle cluster: {len(out)} characters; --all {len(every)}")
        assert len(out) < 5000, out
        for name in ("worker0", "worker1", "worker2"):
            assert f"== {name}" in out, out
        assert out.count("-- ") == 1, out  # the kernel's MainThread: it runs this cell
        assert "-- MainThread" in out, out
        assert "%rpc_stacks --all shows every thread" in out, out
        assert every.count("-- MainThread") == 3, every
        assert "left out" not in every, every
