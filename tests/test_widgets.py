"""The widgets on a real cluster: live, redrawn as the data changes, with a text repr
(the views they draw are tested without workers in tests/unit/test_views.py)."""

import gc
import time

import pytest
import torch
from conftest import wait_until

import nbrpc
from nbrpc import autograd
from nbrpc.widgets import BackwardView, ClusterPanel, ClusterView, OwnershipView, show_status

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
        fut = nbrpc.rpc_async("worker2", time.sleep, args=(6.0,))  # seen while it runs
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
def test_a_new_status_view_stops_the_one_before():
    """``%rpc_status`` shows ``show_status()``: the view it showed before stops asking the
    workers, keeps its last state and closes its widget. Each one polled every process
    every second and none ever stopped (the soak, docs/soak.md: their threads outlived
    every shutdown), and each widget stayed in the kernel."""
    first = show_status()
    second = show_status()
    try:
        assert wait_until(lambda: not first._thread.is_alive(), 5)
        assert not first.live
        assert first.comm is None  # closed: ipywidgets holds it no more
        assert second.live
        assert [w["name"] for w in first.data["workers"]] == nbrpc.workers()
    finally:
        first.close()
        second.close()


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


@pytest.mark.usefixtures("cluster")
def test_the_cluster_panel_draws_the_cluster_and_runs_the_magics_actions(capsys):
    """The panel's live data and its buttons' actions, without a browser (the side bar in
    a real JupyterLab: tests/test_browser.py): every process's card, a button per worker,
    the last recording's calls; an action runs the magic's code and is said in the panel;
    an unknown worker is said, not raised; a script's nbrpc.panel() prints where the panel
    works and the cluster's table."""
    with nbrpc.record():
        nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    panel = ClusterPanel(interval=0.2)
    try:
        assert panel.live
        names = [w["name"] for w in panel.data["workers"]]
        assert names == nbrpc.workers()
        for name in names[1:]:
            assert f'data-action="restart" data-target="{name}"' in panel.html
        assert 'data-action="shutdown"' in panel.html
        assert panel.data["timeline"]["calls"]  # the recording above
        assert 'class="nbrpc-timeline' in panel.html
        said = panel.act("stacks", "worker1")
        assert "worker1" in said
        assert "worker1" in panel.output
        assert "your code; %rpc_stacks --all shows every thread" in panel.output  # idle
        assert panel.status.startswith(said)
        panel.act("stacks", "")  # every process: this one's main thread runs the test's code
        assert "-- MainThread\n" in panel.output  # a thread's stack, as %rpc_stacks prints it
        said = panel.act("restart", "worker9")
        assert "ConfigError: cannot restart worker9" in said, said
        assert "worker2" in repr(panel)
        panel._on_action(panel, {"action": "closed", "target": ""}, None)  # its front end went
        assert not panel.live
    finally:
        panel.close()
    nbrpc.panel()  # this process is a script: no kernel, no widgets
    out = capsys.readouterr().out
    assert "JupyterLab's right side bar" in out
    assert "worker2" in out
