"""From data to widget state, without a browser: the three views and their reprs."""

import gc
import time

import pytest
import torch
from conftest import wait_until

import nbrpc
from nbrpc import _views, autograd
from nbrpc.widgets import BackwardView, ClusterView, OwnershipView

TRACE = {
    "context_id": 7,
    "workers": [
        {"name": "worker0", "id": 0, "host": "h", "timing": {"busy_s": 0.002}},
        {"name": "worker1", "id": 1, "host": "h", "timing": None},
    ],
    "nodes": [
        {"id": "worker0/0", "worker": "worker0", "name": "SumBackward0", "kind": "root"},
        {"id": "worker0/1", "worker": "worker0", "name": "RecvRpcBackward", "kind": "recv"},
        {"id": "worker1/0", "worker": "worker1", "name": "SendRpcBackward", "kind": "send"},
        {
            "id": "worker1/1",
            "worker": "worker1",
            "name": "AccumulateGrad",
            "kind": "accumulate",
            "duration_s": 0.0005,
        },
    ],
    "edges": [
        {"src": "worker0/0", "dst": "worker0/1", "kind": "local"},
        {"src": "worker0/1", "dst": "worker1/0", "kind": "rpc"},
        {"src": "worker1/0", "dst": "worker1/1", "kind": "local"},
    ],
}


# -- pure views -----------------------------------------------------------------------------


def test_ownership_svg_draws_each_rref_in_its_owner_with_an_edge_per_holder():
    rrefs = [
        {"id": "0:1", "owner": "worker1", "holders": ["worker0", "worker2"], "type": "PS"},
        {"id": "2:0", "owner": "worker2", "holders": [], "type": "Tensor<&>"},
    ]
    svg = _views.ownership_svg(["worker0", "worker1", "worker2"], rrefs)
    assert svg.count('class="lane"') == 3
    assert 'data-rref="0:1" data-owner="worker1"' in svg
    assert 'data-rref="2:0" data-owner="worker2"' in svg
    assert svg.count('class="hold-edge"') == 2
    assert 'data-holder="worker2"' in svg
    assert "Tensor&lt;&amp;&gt;" in svg  # names are escaped
    text = _views.ownership_text(rrefs)
    assert "owner worker1" in text
    assert "(owner only)" in text


def test_ownership_svg_summarises_thousands_of_rrefs():
    rrefs = [{"id": f"0:{i}", "owner": "worker1", "holders": ["worker0"]} for i in range(5000)]
    svg = _views.ownership_svg(["worker0", "worker1"], rrefs)
    assert svg.count('class="rref"') == _views.MAX_RREFS_PER_OWNER
    assert f"+{5000 - _views.MAX_RREFS_PER_OWNER} more" in svg
    assert len(svg) < 50_000


def test_backward_svg_draws_lanes_nodes_and_highlighted_hops():
    svg = _views.backward_svg(TRACE)
    assert svg.count('class="lane"') == 2
    assert svg.count('class="node"') == 4
    assert svg.count('class="rpc-edge"') == 1
    assert svg.count('class="local-edge"') == 2
    assert 'data-src="worker0/1" data-dst="worker1/0"' in svg
    assert "2.00 ms busy" in svg
    assert "0.50 ms" in svg
    text = _views.backward_text(TRACE)
    assert "1 cross-process hops" in text
    assert "hop worker0/1 -> worker1/0" in text


def test_cluster_html_shows_each_process_and_its_state():
    rows = [
        {"name": "worker0", "state": "ready", "role": "kernel", "rank": 0, "pid": 1},
        {"name": "worker1", "state": "dead", "role": "engine 0", "rank": 1, "pid": 2},
    ]
    html = _views.cluster_html(rows, "ready")
    assert 'data-worker="worker1" data-state="dead"' in html
    assert "calls: <b>–</b>" in html  # unknown figures are shown as unknown, not zero
    assert "no cluster" in _views.cluster_html([], "closed")
    assert "booting: starting workers" in _views.cluster_html([], "booting")
    assert _views.cluster_text([], "booting") == "nbrpc: booting"


@pytest.mark.parametrize(
    ("states", "cluster", "line"),
    [
        (["ready", "ready", "ready"], "ready", "3 processes, ready"),
        (["ready", "ready", "dead"], "ready", "3 processes: 2 ready, worker2 dead"),
        (
            ["ready", "restarting", "dead"],
            "ready",
            "3 processes: 1 ready, worker1 restarting, worker2 dead",
        ),
        (["shutting down"] * 2, "shutting down", "2 processes, shutting down"),
        (
            ["ready", "stopped"],
            "shutting down",
            "2 processes, shutting down: 1 ready, worker1 stopped",
        ),
        (["ready"], "ready", "1 process, ready"),
    ],
)
def test_the_headline_says_ready_only_when_every_process_is(states, cluster, line):
    rows = [{"name": f"worker{i}", "state": state} for i, state in enumerate(states)]
    assert _views.headline(rows, cluster) == line
    assert f"cluster: {line}</div>" in _views.cluster_html(rows, cluster)
    assert _views.cluster_text(rows, cluster).splitlines()[0] == f"nbrpc cluster: {line}"
    table = [{**r, "rank": i, "pid": i, "host": "h", "role": "r"} for i, r in enumerate(rows)]
    assert _views.records_text(table, cluster, None, []).startswith(f"nbrpc RPC group: {line}")


# -- widgets on the real cluster ------------------------------------------------------------


@pytest.mark.usefixtures("cluster")
def test_cluster_view_is_live_and_has_a_text_repr():
    view = ClusterView(interval=0.2)
    try:
        assert view.live
        names = [w["name"] for w in view.data["workers"]]
        assert names == nbrpc.workers()
        assert all(f'data-worker="{n}"' in view.html for n in names)
        version = view.version
        fut = nbrpc.rpc_async("worker2", time.sleep, args=(3.0,))
        assert wait_until(
            lambda: view.data["workers"][2]["calls_in_flight"] == 1 and view.version > version
        ), "the view did not update while a call was running"
        fut.wait()
        bundle = view._repr_mimebundle_()
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        assert "application/vnd.jupyter.widget-view+json" in data
        assert "worker2" in data["text/plain"]
        assert 'class="nbrpc-cluster"' in data["text/html"]
    finally:
        view.close()
    assert not view.live


@pytest.mark.usefixtures("cluster")
def test_ownership_view_redraws_when_rrefs_come_and_go():
    view = OwnershipView(interval=0.2)
    try:
        rref = nbrpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        rid = next(
            r["id"] for r in nbrpc.ownership() if r["created_by"] == "remote(worker1, torch.add)"
        )
        assert wait_until(lambda: f'data-rref="{rid}"' in view.html)
        assert any(r["id"] == rid and r["owner"] == "worker1" for r in view.data["rrefs"])
        del rref
        gc.collect()
        assert wait_until(lambda: f'data-rref="{rid}"' not in view.html)
    finally:
        view.close()


@pytest.mark.usefixtures("cluster")
def test_backward_view_of_a_real_pass_crosses_workers():
    x = torch.ones(2, 3, requires_grad=True)
    with autograd.context() as ctx:
        y = nbrpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        z = nbrpc.rpc_sync("worker2", torch.sum, args=(y,))
        autograd.backward(ctx, [z], timed=True)
        view = BackwardView(ctx)
        assert view.data["context_id"] == ctx
    hops = [e for e in view.data["edges"] if e["kind"] == "rpc"]
    assert len(hops) == 4  # x→worker1, y→worker2, and the two results back
    assert view.html.count('class="rpc-edge"') == 4
    for name in ("worker0", "worker1", "worker2"):
        assert f'class="lane" data-worker="{name}"' in view.html
    assert "ms busy" in view.html
    assert "4 cross-process hops" in repr(view)
    view.close()


def test_a_workers_state_moves_only_along_its_transitions():
    from nbrpc._rows import WorkerRecord, WorkerState

    record = WorkerRecord("worker1", 1, 10, "h", "engine 0")
    assert record.state == "ready"  # a str: rows print and compare as text
    record.move(WorkerState.DEAD)
    record.move(WorkerState.RESTARTING)
    record.move(WorkerState.READY)
    record.move(WorkerState.STOPPED)
    with pytest.raises(nbrpc.ClusterClosedError, match="worker1 is stopped and cannot become"):
        record.move(WorkerState.READY)
    assert f"{WorkerState.DEAD}" == "dead"
