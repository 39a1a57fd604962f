"""The views and the rows they draw, without a browser or a worker: plain data in,
HTML/SVG/text out (``nbrpc/_views/``), and a process's state transitions."""

import pytest

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


def test_a_rank_shown_is_nbrpcs_and_torchs_id_is_labelled_as_torchs():
    """worker2 restarted in a kernel's second cluster: nbrpc.rank() 2, torch id 7. Every
    view shows 2 as its rank and 7 only as its torch id (they showed torch's 7 as "rank")."""
    from nbrpc._gather import census
    from nbrpc._rows import WorkerRecord

    records = [
        WorkerRecord("worker0", 0, 10, "h", "kernel", order=0),
        WorkerRecord("worker1", 3, 11, "h", "engine 0", order=1),
        WorkerRecord("worker2", 7, 12, "h", "engine 1", order=2),
    ]
    rows = census.status_rows(records, {}, {})  # nbrpc.status()'s rows
    assert [(r["rank"], r["torch_id"]) for r in rows] == [(0, 0), (1, 3), (2, 7)]
    text = _views.records_text(rows, "ready", None, [])  # %rpc_init's table
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["name", "rank", "torch", "id"], text
    assert lines[4].split()[:4] == ["worker2", "2", "7", "12"], text
    html = _views.cluster_html(rows, "ready")  # %rpc_status's cards, the panel's
    assert "engine 1 · rank 2 · torch id 7</div>" in html
    assert "rank 7" not in html


def test_the_panel_fits_the_ownership_view_to_the_side_bar_and_the_notebook_keeps_its_size():
    members = ["worker0", "worker1", "worker2"]
    rrefs = [{"id": "0:1", "owner": "worker1", "holders": ["worker0"], "type": "PS"}]
    drawn = _views.ownership_svg(members, rrefs)
    width = drawn.split('width="', 1)[1].split('"', 1)[0]
    assert int(width) > 350  # wider than a side bar: the notebook's view scrolls
    assert f'viewBox="0 0 {width} ' in drawn
    fitted = _views.ownership_svg(members, rrefs, fit=True)
    assert 'class="nbrpc-ownership" xmlns="http://www.w3.org/2000/svg" width="100%" ' in fitted
    assert f'viewBox="0 0 {width} ' in fitted  # the same drawing, scaled
    assert f"max-width:{width}px;height:auto" in fitted
    assert fitted.split(">", 1)[1] == drawn.split(">", 1)[1]
    data = {"state": "ready", "workers": [], "members": members, "rrefs": rrefs}
    panel = _views.panel_html({**data, "timeline": None})
    assert fitted in panel


def _thread(name, files, serving=None):
    return {
        "thread": hash(name) & 0xFFFF,
        "name": name,
        "current": False,
        "serving": serving,
        "frames": [{"file": f, "line": 1, "function": f"f{i}"} for i, f in enumerate(files)],
    }


def test_stacks_text_shows_the_threads_that_serve_calls_or_run_the_users_code():
    """%rpc_stacks printed every thread (about 34,000 characters on an idle cluster of 2):
    by default the ones that matter, the others counted, --all for every one."""
    import threading

    threading_py = threading.__file__
    nbrpc_py = _views.stacks_text.__code__.co_filename
    idle = [
        _thread("nbrpc-lanes", [threading_py, nbrpc_py]),
        _thread("IOPub", [threading_py, "/srv/venv/lib/python3.11/site-packages/zmq/x.py"]),
        _thread("MainThread", ["/home/u/nbrpc/nbrpc/_engines/worker.py", threading_py]),
    ]
    rows = [
        {
            "name": "worker1",
            "pid": 7,
            "host": "h1",
            "how": "thread",
            "error": None,
            "threads": [
                *idle,
                _thread("Thread-3", [threading_py, "/tmp/ipykernel_9/12.py"]),  # the user's
                _thread(None, [nbrpc_py, "<rpc-cell-2>"]),
                _thread("rpc", [nbrpc_py], serving="spin from worker0"),
            ],
        },
        {
            "name": "worker2",
            "pid": 8,
            "host": "h1",
            "how": "thread",
            "error": None,
            "threads": idle,
        },
    ]
    text = _views.stacks_text(rows)
    assert "-- rpc: serving spin from worker0" in text
    assert "-- Thread-3" in text
    assert "12.py" in text
    assert "<rpc-cell-2>" in text
    for name in ("nbrpc-lanes", "IOPub", "MainThread"):
        assert f"-- {name}" not in text, text
    assert "(3 other threads of nbrpc's and the libraries' left out)" in text, text
    assert "no thread serves a call or runs your code; 3 other threads" in text, text
    assert text.endswith(
        "\nnbrpc: left out 6 threads serving no call and running none of your code; "
        "%rpc_stacks --all shows every thread (nbrpc.stacks() returns them all)"
    ), text
    every = _views.stacks_text(rows, all_threads=True)
    assert every.count("-- MainThread") == 2
    assert "left out" not in every
    one = _views.stacks_text([{**rows[0], "threads": [*rows[0]["threads"][3:], idle[0]]}])
    assert "(1 other thread of nbrpc's" in one, one
    assert "nbrpc: left out 1 thread serving" in one, one
