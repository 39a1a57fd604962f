"""What a person sees: notebook 06 in a real JupyterLab, driven by a real headless Chromium.

A JupyterLab server starts on loopback with a token; Debian's Chromium (never a downloaded
browser) opens a copy of ``notebooks/06_seeing_the_cluster.ipynb`` and runs it cell group
by cell group. The DOM must show every worker in the cluster view, every RRef in the
ownership view (and lose the released one while the page stays open), cross-worker edges
in the backward view, and each worker's tqdm bar as a widget. Screenshots go to
``test-artifacts/browser/`` (git-ignored).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import wait_for_exit

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"no {CHROMIUM}: install Debian's chromium (`make test` does it: apt-get install "
    "chromium)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} in {timeout} s")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab on 127.0.0.1 with a token, serving a copy of notebook 06."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "06_seeing_the_cluster.ipynb", work / "views.ipynb")
    config = work / "config"
    (config / "labconfig").mkdir(parents=True)
    # No "would you like news?" toast over the screenshots (and no request for it).
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    # Every cell rendered: with JupyterLab's default windowing, cells scrolled out of view
    # are skipped by the renderer and their outputs' innerText reads as empty.
    tracker = work / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    log = open(work / "lab.log", "w")  # noqa: SIM115 - closed in the finalizer below
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={work}",
            "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={work / 'settings'}",
            # CI runs as root; the server is on loopback behind a random token either way
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", proc)
        yield {"base": base, "token": token, "work": work}
    finally:
        try:
            family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        proc.terminate()  # the server stops its kernels; their clusters stop with them
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        for pid in wait_for_exit(family, timeout=30):  # only what this fixture started
            psutil.Process(pid).kill()
        log.close()


#: JavaScript helpers run in the page; ``window.jupyterapp`` exists because the server
#: runs with ``--LabApp.expose_app_in_browser``.
KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && w.content.widgets.length > 0;
}"""
RUN_UP_TO = """async (needle) => {
  const app = window.jupyterapp;
  const nb = app.shell.currentWidget.content;
  const at = nb.widgets.findIndex(c => c.model.sharedModel.getSource().includes(needle));
  if (at < 0) throw new Error('no cell contains ' + needle);
  nb.activeCellIndex = at;
  await app.commands.execute('notebook:run-all-above');
  return at;
}"""
RUN_CELL = """async (needle) => {
  const app = window.jupyterapp;
  const nb = app.shell.currentWidget.content;
  const at = nb.widgets.findIndex(c => c.model.sharedModel.getSource().includes(needle));
  nb.activeCellIndex = at;
  await app.commands.execute('notebook:run-cell');
  return at;
}"""
START_CELL = """(needle) => {
  const app = window.jupyterapp;
  const nb = app.shell.currentWidget.content;
  const at = nb.widgets.findIndex(
    c => c.model.type === 'code' && c.model.sharedModel.getSource().includes(needle));
  nb.activeCellIndex = at;
  app.commands.execute('notebook:run-cell');  // not awaited: the cell waits for input
  return at;
}"""
PRINTED = """(prefix) => {
  for (const out of document.querySelectorAll('.jp-OutputArea-output')) {
    for (const line of out.innerText.split('\\n')) {
      if (line.startsWith(prefix)) return line.slice(prefix.length);
    }
  }
  return '';
}"""
HAS_RREF = "(id) => !!document.querySelector(`.nbrpc-ownership g.rref[data-rref='${id}']`)"
ERRORS = """() => Array.from(document.querySelectorAll(
  '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
  .map(e => e.innerText).filter(t => /Error|Traceback/.test(t))"""


def _fail_with_page(page, what: str) -> None:
    page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
    errors = page.evaluate(ERRORS)
    pytest.fail(f"{what}; errors in the page: {errors or 'none'}; see {ARTIFACTS}/failure.png")


def _wait(page, condition: str, what: str, timeout_s: float = 120, arg=None) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, arg=arg, timeout=timeout_s * 1000, polling=250)
    except PlaywrightTimeout:
        _fail_with_page(page, f"timed out after {timeout_s} s waiting for {what}")


#: both workers' bars of the tutorial's "epoch 1" cell, drawn as widgets and completed
BARS_DONE = """() => {
  const rows = Array.from(document.querySelectorAll('.widget-hbox'))
    .filter(r => /\\[worker[12]\\]\\s*epoch 1/.test(r.innerText));
  return rows.filter(r => r.querySelector('.progress-bar-success')).length >= 2;
}"""
STDIN_ASKS = """([prompt, n]) => {
  const box = document.querySelector('.jp-Stdin-input');
  return !!box && box.value === '' && box.closest('.jp-Stdin').innerText.includes(prompt)
    && document.body.innerText.split(prompt).length - 1 >= n;
}"""


def _type_pdb(page, prompt: str, n: int, command: str, expect: str | None = None) -> None:
    """Type ``command`` into the input box of the ``n``-th ``prompt``, as a person would."""
    _wait(page, STDIN_ASKS, f"input box {n} asking {prompt}", timeout_s=30, arg=[prompt, n])
    box = page.locator(".jp-Stdin-input").first
    box.fill(command)
    box.press("Enter")
    if expect is not None:
        _wait(
            page,
            "(text) => document.body.innerText.split('\\n').some(l => l.trim() === text)",
            f"pdb to print {expect!r} for {command!r}",
            timeout_s=30,
            arg=expect,
        )


def _view(page, content: str):
    """A view's root element: it stays in the DOM while a live view redraws its content
    (a screenshot of the content itself can lose it half-way)."""
    return page.locator(".nbrpc-view", has=page.locator(content)).first


@contextlib.contextmanager
def _opened(lab, notebook: str, width: int, height: int):
    """Debian's Chromium with ``notebook`` open in the lab and its kernel idle: the page."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            # a workspace of its own: JupyterLab would restore the last test's open notebook
            space = notebook.removesuffix(".ipynb")
            page.goto(f"{lab['base']}/lab/workspaces/{space}/tree/{notebook}?token={lab['token']}")
            _wait(page, KERNEL_IDLE, "JupyterLab to open the notebook with an idle kernel")
            yield page
        finally:
            browser.close()


def test_views_render_and_update_in_jupyterlab(lab):
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with _opened(lab, "views.ipynb", 1400, 1100) as page:
        timings["lab open, kernel idle"] = time.monotonic() - t0

        # Everything up to the release: boot, status, workload, views, backward pass.
        t1 = time.monotonic()
        page.evaluate(RUN_UP_TO, "del scratch")
        _wait(
            page,
            "() => document.querySelectorAll('.nbrpc-backward path.rpc-edge').length > 0",
            "the backward view",
            timeout_s=180,
        )
        timings["cluster boot + workload + views"] = time.monotonic() - t1

        workers = page.eval_on_selector_all(
            ".nbrpc-cluster .nbrpc-worker", "els => els.map(e => e.dataset.worker)"
        )
        assert sorted(workers) == ["worker0", "worker1", "worker2"]
        states = page.eval_on_selector_all(
            ".nbrpc-cluster .nbrpc-worker", "els => els.map(e => e.dataset.state)"
        )
        assert set(states) == {"ready"}

        ids = page.evaluate(PRINTED, "RRef ids:").split()
        assert len(ids) == 3, ids
        for rid in ids:
            _wait(
                page,
                HAS_RREF,
                f"RRef {rid} in the ownership view",
                timeout_s=15,
                arg=rid,
            )
        lanes = page.eval_on_selector_all(
            ".nbrpc-ownership g.lane", "els => els.map(e => e.dataset.worker)"
        )
        assert lanes == ["worker0", "worker1", "worker2"]
        holders = page.eval_on_selector_all(
            ".nbrpc-ownership path.hold-edge", "els => els.map(e => e.dataset.holder)"
        )
        assert "worker2" in holders  # worker2 holds the parameter server
        _view(page, ".nbrpc-cluster").screenshot(path=str(ARTIFACTS / "cluster.png"))
        _view(page, ".nbrpc-ownership").screenshot(path=str(ARTIFACTS / "ownership.png"))

        backward_lanes = page.eval_on_selector_all(
            ".nbrpc-backward g.lane", "els => els.map(e => e.dataset.worker)"
        )
        assert sorted(backward_lanes) == ["worker0", "worker1", "worker2"]
        hops = page.eval_on_selector_all(
            ".nbrpc-backward path.rpc-edge",
            "els => els.map(e => [e.dataset.src.split('/')[0], e.dataset.dst.split('/')[0]])",
        )
        assert len(hops) == 3
        assert all(src != dst for src, dst in hops)  # every hop crosses processes
        _view(page, ".nbrpc-backward").screenshot(path=str(ARTIFACTS / "backward.png"))

        # The timeline of two training steps: a bar per recorded call, the row as its
        # tooltip, one lane per process; then the stacks of a busy worker.
        _wait(
            page,
            "() => document.body.innerText.includes('serving train_for from')",
            "the timeline and the stacks cells",
            timeout_s=60,
        )
        count = int(page.evaluate(PRINTED, "timeline calls: "))
        drawn = page.eval_on_selector_all(
            ".nbrpc-timeline g.nbrpc-call",
            "els => els.map(e => [e.dataset.callee, e.querySelector('title').textContent])",
        )
        assert len(drawn) == count > 0
        assert any(
            callee == "worker1" and tip.startswith("ParameterServer.forward: worker0 -> worker1")
            for callee, tip in drawn
        ), drawn
        lanes = page.eval_on_selector_all(
            ".nbrpc-timeline g.nbrpc-lane", "els => els.map(e => e.dataset.process)"
        )
        assert lanes[:3] == ["worker0", "worker1", "worker2"]
        page.locator(".nbrpc-timeline g.nbrpc-call rect").first.hover()
        _view(page, ".nbrpc-timeline").screenshot(path=str(ARTIFACTS / "timeline.png"))

        # Release one RRef: the open ownership view must redraw without it.
        version = page.eval_on_selector(
            ".nbrpc-ownership", "e => Number(e.closest('.nbrpc-view').dataset.version)"
        )
        t2 = time.monotonic()
        page.evaluate(RUN_CELL, "del scratch")
        _wait(page, "() => document.body.innerText.includes('released:')", "the release")
        gone = page.evaluate(PRINTED, "released:").strip()
        assert gone in ids
        _wait(
            page,
            f"(id) => !({HAS_RREF})(id)",
            f"RRef {gone} to leave the ownership view",
            timeout_s=15,
            arg=gone,
        )
        timings["release seen in the page"] = time.monotonic() - t2
        now = page.eval_on_selector(
            ".nbrpc-ownership", "e => Number(e.closest('.nbrpc-view').dataset.version)"
        )
        assert now > version
        for rid in set(ids) - {gone}:
            assert page.query_selector(f".nbrpc-ownership g.rref[data-rref='{rid}']")
        page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
        assert not page.evaluate(ERRORS)

        # A worker's breakpoint() asks for commands in the cell's input box.
        t3 = time.monotonic()
        page.evaluate(START_CELL, "def scaled")
        _type_pdb(page, "(Pdb worker1)", 1, "p scale", expect="4")
        page.screenshot(path=str(ARTIFACTS / "pdb.png"), full_page=True)
        _type_pdb(page, "(Pdb worker1)", 2, "c")
        _wait(
            page,
            "() => document.body.innerText.includes('scaled: tensor([4., 4., 4.])')",
            "the call to return after c",
        )
        page.evaluate(RUN_CELL, "def normalise")
        _wait(page, "() => document.body.innerText.includes('raised on worker2')", "the error")
        page.evaluate(START_CELL, "%rpc_debug")
        _type_pdb(page, "(Pdb worker2)", 1, "p total", expect="0")
        _type_pdb(page, "(Pdb worker2)", 2, "c")
        _wait(page, "() => !document.querySelector('.jp-Stdin-input')", "pdb to close")
        timings["pdb in the page"] = time.monotonic() - t3

        # A worker's tqdm.auto bar is a live widget labelled with the worker.
        t4 = time.monotonic()
        page.evaluate(RUN_CELL, "epoch 1")
        _wait(page, BARS_DONE, "a completed progress bar from each worker", timeout_s=60)
        _wait(
            page,
            "() => document.body.innerText.includes('[worker2] a line from C on this worker')",
            "a worker's fd-level line",
            timeout_s=15,
        )
        timings["worker progress bars"] = time.monotonic() - t4
        page.locator(".widget-hbox", has_text="[worker1]").first.screenshot(
            path=str(ARTIFACTS / "worker_bar.png")
        )

        page.evaluate(RUN_CELL, "%rpc_shutdown")
        _wait(
            page,
            "() => document.body.innerText.includes('shut down')",
            "%rpc_shutdown",
            timeout_s=60,
        )
    timings["whole browser test"] = time.monotonic() - t0
    (ARTIFACTS / "timings.json").write_text(json.dumps(timings, indent=1))
    print("browser test timings (s):", {k: round(v, 1) for k, v in timings.items()})


PANEL_CELLS = [
    "import os\nimport nbrpc\n%load_ext nbrpc",
    "%rpc_init -n 2",
    "%rpc_panel",
    "nbrpc.rpc_async('worker1', os._exit, args=(1,))  # the worker dies",
    "%rpc_shutdown",
]
#: whether the panel's card of a worker (in the side bar, not in a cell) is in ``state``
#: with a pid other than ``notPid``
WORKER_IS = """([name, state, notPid]) => {
  const card = document.querySelector(
    `.jupyterlab-sidecar .nbrpc-worker[data-worker="${name}"]`);
  return !!card && card.dataset.state === state && card.dataset.pid !== notPid;
}"""


#: the panel's ownership view and its side bar, as the page lays them out
SIDE_BAR_OWNERSHIP = """() => {
  const side = document.querySelector('.jupyterlab-sidecar');
  const box = (e) => { const r = e.getBoundingClientRect();
    return {width: r.width, height: r.height, right: r.right}; };
  return [box(side.querySelector('.nbrpc-ownership')), box(side)];
}"""


def _panel_notebook(path: Path) -> None:
    cells = [
        {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
        for src in PANEL_CELLS
    ]
    notebook = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(notebook))


def test_the_cluster_panel_follows_the_cluster_beside_the_notebook(lab):
    """%rpc_panel opens the cluster beside the notebook (JupyterLab's right side bar):
    the panel lists the three processes, and no card is added to the cell (the panel said
    it rendered); a worker killed with os._exit turns dead in it; its restart button asks,
    then restarts it (a new pid, ready); after %rpc_shutdown it says there is no cluster."""
    _panel_notebook(lab["work"] / "panel.ipynb")
    timings: dict[str, float] = {}
    with _opened(lab, "panel.ipynb", 1500, 1000) as page:
        page.evaluate(RUN_UP_TO, "os._exit")  # the cells above it, %rpc_panel the last
        _wait(
            page,
            "() => document.querySelectorAll('.jupyterlab-sidecar .nbrpc-worker').length == 3",
            "the panel to list the kernel and both workers",
            timeout_s=120,
        )
        names = page.eval_on_selector_all(
            ".jupyterlab-sidecar .nbrpc-worker", "els => els.map(e => e.dataset.worker)"
        )
        assert names == ["worker0", "worker1", "worker2"]
        assert "JupyterLab's right side bar" in page.evaluate(PRINTED, "nbrpc: the cluster")
        time.sleep(3)  # past the 2 s the kernel waits for the panel to say it rendered
        assert not page.query_selector(".jp-Cell .nbrpc-cluster"), "a card in the cell too"
        pid = page.get_attribute(
            ".jupyterlab-sidecar .nbrpc-worker[data-worker='worker1']", "data-pid"
        )

        t0 = time.monotonic()
        page.evaluate(RUN_CELL, "os._exit")
        _wait(page, WORKER_IS, "worker1 to turn dead in the panel", 30, ["worker1", "dead", ""])
        timings["dead worker shown dead in the panel"] = time.monotonic() - t0

        t1 = time.monotonic()
        page.click(".jupyterlab-sidecar button[data-action='restart'][data-target='worker1']")
        assert "restart worker1?" in page.inner_text(".nbrpc-panel-status")
        page.click(".jupyterlab-sidecar .nbrpc-confirm-yes")
        _wait(page, WORKER_IS, "worker1 ready with a new pid", 90, ["worker1", "ready", pid])
        _wait(
            page,
            "() => document.querySelector('.nbrpc-panel-status').innerText"
            ".includes('worker1 restarted')",
            "the panel to say what the restart did",
            timeout_s=30,
        )
        timings["restart from the panel"] = time.monotonic() - t1
        # its card: the rank a script has, kept; torch's new id, labelled as torch's
        card = page.inner_text(".jupyterlab-sidecar .nbrpc-worker[data-worker='worker1']")
        shown = re.search(r"rank (\d+) · torch id (\d+)", card)
        assert shown, card
        assert (shown[1], int(shown[2]) > 2) == ("1", True), card  # ids 0-2: the first three
        # the ownership view is as wide as the side bar at most: scaled, not cut off
        svg, side = page.evaluate(SIDE_BAR_OWNERSHIP)
        assert 0 < svg["width"] <= side["width"], (svg, side)
        assert svg["right"] <= side["right"], (svg, side)
        assert svg["height"] > 0, svg
        page.locator(".jupyterlab-sidecar").first.screenshot(path=str(ARTIFACTS / "panel.png"))

        page.evaluate(RUN_CELL, "%rpc_shutdown")
        _wait(
            page,
            "() => !!document.querySelector("
            "'.jupyterlab-sidecar .nbrpc-cluster[data-state=\"closed\"]')",
            "the panel to say there is no cluster",
            timeout_s=60,
        )
        assert "no cluster" in page.inner_text(".jupyterlab-sidecar .nbrpc-cluster")
        assert not page.evaluate(ERRORS)
    print("panel test timings (s):", {k: round(v, 1) for k, v in timings.items()})
