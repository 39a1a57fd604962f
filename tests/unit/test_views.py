"""The views and the rows they draw, without a browser or a worker: plain data in,
HTML/SVG/text out (``nbrpc/_views/``), and a process's state transitions."""

import pytest

import nbrpc
from nbrpc import _views

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
    assert "on 2 processes, 1 cross-process hop\n" in text, text  # (it said "1 ... hops")
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
