"""Output as a person expects, in a real kernel driven as a notebook drives it.

A line a worker rewrites with ``\\r`` arrives while the call runs and updates in place;
``tqdm.auto`` on a worker draws a widget bar in the calling cell; what native code writes
to a worker's file descriptors reaches the cell; torch's lines about connections nbrpc
closed itself stay out of the cell, and other C++ lines still reach it. Arrival times are
printed (the 0.2 s target is measured here, not asserted: tests must not fail on a slow
machine); the order of events is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import Kernel, running_kernel, user_environment

SETUP = """%load_ext nbrpc
%rpc_init -n 2 --quiet
import os, sys, time, threading
import nbrpc

def text_bar(steps, pause):
    for i in range(steps):
        sys.stderr.write(f"\\rstep {i + 1}/{steps} sent {time.time():.3f}")
        time.sleep(pause)
    sys.stderr.write("\\n")
    return steps

def auto_bar(steps, pause):
    from tqdm.auto import tqdm
    for _ in tqdm(range(steps), desc="fit"):
        time.sleep(pause)
    return tqdm.__name__

def native(text):
    os.write(1, f"{text} on fd 1\\n".encode())
    os.write(2, f"{text} on fd 2\\n".encode())
    print("python print")
    return 1

def native_later(text, after):
    threading.Timer(after, lambda: os.write(2, f"{text}\\n".encode())).start()
    return 1
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(SETUP, closing="nbrpc.shutdown(release=True)") as k:
        yield k


def _events(k: Kernel, code: str, timeout: float = 60) -> list[tuple[float, str, dict]]:
    """Run ``code``: every iopub message, as (seconds since the request, type, content)."""
    events: list[tuple[float, str, dict]] = []
    t0 = time.time()

    def hook(msg):
        events.append((time.time() - t0, msg["msg_type"], msg["content"]))

    k.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    errors = [c for _, kind, c in events if kind == "error"]
    assert not errors, errors
    return events


def _result_at(events) -> float:
    return next(t for t, kind, _ in events if kind == "execute_result")


def _stream_text(events, name: str | None = None) -> str:
    return "".join(
        c["text"] for _, kind, c in events if kind == "stream" and name in (None, c["name"])
    )


def _shown(events, kinds=("display_data", "update_display_data")) -> list[tuple[float, dict]]:
    """The displays among ``events`` (a line or a bar shown in place), with their times."""
    return [(t, c) for t, kind, c in events if kind in kinds]


EVENTFDS = """
def eventfds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
        except OSError:
            pass
    return n

def shout(i):
    print(f"line {i}")
    time.sleep(0.05)
    return i
"""


def test_output_coming_on_many_rpc_threads_opens_nothing_more_in_the_kernel(kernel):
    """ipykernel gives each thread that writes to the notebook's streams a zmq socket (an
    eventfd) for the thread's life, and torch's RPC threads live as long as the kernel:
    output shown on each RPC thread it came on added one per thread (the soak counted 6-8
    eventfds more after some shutdowns). The kernel shows it on one thread of its own.
    First in this module: the kernel has shown no worker's output yet."""
    kernel.run(EVENTFDS)
    before = kernel.value("eventfds()")
    for _ in range(3):  # both workers' lines at once, on many of the kernel's RPC threads
        events = _events(
            kernel,
            "futs = [nbrpc.rpc_async(w, shout, args=(i,))\n"
            "        for i in range(16) for w in ('worker1', 'worker2')]\n"
            "[f.wait() for f in futs][-1]",
        )
        assert _stream_text(events).count("] line ") == 32, _stream_text(events)
    after = kernel.value("eventfds()")
    print(f"eventfds in the kernel: {before} before, {after} after 96 calls' output")
    assert after <= before + 1, (before, after)  # the one thread's own, if it had none


def test_a_line_updated_with_cr_arrives_live_and_in_place(kernel):
    t_call = time.time()
    events = _events(kernel, "nbrpc.rpc_sync('worker1', text_bar, args=(20, 0.2))")
    done = _result_at(events)
    shows = _shown(events)
    assert shows, f"no in-place display: {[k for _, k, _ in events]}"
    ids = {c["transient"]["display_id"] for _, c in shows}
    assert len(ids) == 1, "one line, updated in place"
    texts = [c["data"]["text/plain"] for _, c in shows]
    assert all(t.startswith("[worker1] step ") for t in texts), texts
    early = [t for t, _ in shows if t < done - 0.5]
    assert len(early) >= 4, f"updates came at {[round(t, 2) for t, _ in shows]}, result {done}"
    assert texts[-1].startswith("[worker1] step 20/20"), texts[-1]
    assert "step" not in _stream_text(events), "the line must not also print as a stream"
    # latency: the worker wrote its wall clock into each state
    lags = []
    for t, c in shows:
        sent = float(c["data"]["text/plain"].rsplit("sent ", 1)[1])
        lags.append(t_call + t - sent)
    lags.sort()
    print(f"\\r updates: {len(shows)} in {done:.2f} s; lag median {lags[len(lags) // 2]:.3f} s")


def test_in_place_lines_from_remote_and_nested_calls_reach_the_calling_cell(kernel):
    code = (
        "nbrpc.remote('worker1', text_bar, args=(3, 0.15)).to_here()\n"
        "nbrpc.rpc_sync('worker1', nbrpc.rpc_sync, args=('worker2', text_bar, (3, 0.15)))"
    )
    events = _events(kernel, code)
    finals = [c["data"]["text/plain"] for _, c in _shown(events)]
    assert any(t.startswith("[worker1] step 3/3") for t in finals), finals
    assert any(t.startswith("[worker2] step 3/3") for t in finals), finals


def test_tqdm_auto_on_a_worker_draws_a_widget_bar_in_the_calling_cell(kernel):
    events = _events(kernel, "nbrpc.rpc_sync('worker2', auto_bar, args=(8, 0.2))")
    done = _result_at(events)
    result = next(c for _, kind, c in events if kind == "execute_result")
    assert result["data"]["text/plain"] == "'RemoteTqdm'"
    opened = [c["data"]["state"]["_model_name"] for _, kind, c in events if kind == "comm_open"]
    assert "IntProgressModel" in opened, opened
    values = [
        (t, c["data"]["state"]["value"])
        for t, kind, c in events
        if kind == "comm_msg" and isinstance(c["data"].get("state", {}).get("value"), int)
    ]
    live = [v for t, v in values if t < done - 0.4]
    assert live, f"bar values arrived at {values}, result at {done}"
    assert live[-1] < 8, f"bar values arrived at {values}, result at {done}"
    assert values[-1][1] == 8
    styles = [
        c["data"]["state"]["bar_style"]
        for _, kind, c in events
        if kind == "comm_msg" and "bar_style" in c["data"].get("state", {})
    ]
    assert styles[-1] == "success"
    final = _shown(events, ("update_display_data",))[-1][1]
    text = final["data"]["text/plain"]  # what nbval and nbconvert keep
    assert text.startswith("[worker2] fit: 100%"), text
    assert "8/8" in text, text
    updates = len(values)
    assert updates <= 8 / 0.1 * 0.2 + 3, "at most one update per 0.1 s per bar"
    print(f"tqdm.auto: {updates} bar updates for 8 steps of 0.2 s")


def test_bars_of_two_workers_in_a_rpc_cell_are_two_rows(kernel):
    cell = (
        "%%rpc\nimport time\nfrom tqdm.auto import trange\n"
        "for _ in trange(4, desc='cell'):\n    time.sleep(0.1)"
    )
    events = _events(kernel, cell)
    updates = _shown(events, ("update_display_data",))
    plain = [c["data"]["text/plain"] for _, c in updates if "text/plain" in c["data"]]
    finished = {text.split("]")[0] + "]" for text in plain if "4/4" in text}
    assert finished == {"[worker1]", "[worker2]"}, plain


def test_a_flood_the_kernel_shows_slowly_is_all_in_its_cell_before_the_result(kernel):
    """A call waits for its output to be shown for as long as the kernel keeps showing it,
    not a fixed time: 20,000 lines took a loaded machine's kernel 13 s, over the 10 s
    bound, and the last of them reached the next cell (the soak, docs/soak.md). Here the
    bound is made 2 s on the worker, and the kernel's stdout takes 0.25 s a flush (the
    kernel flushes once a message, ~25 of them), so that the flood outlasts it anywhere."""
    slow = (
        "class SlowFlush:\n"
        "    def __init__(self, out): self.out = out\n"
        "    def flush(self): time.sleep(0.25); self.out.flush()\n"
        "    def __getattr__(self, name): return getattr(self.out, name)\n"
        "real_stdout, sys.stdout = sys.stdout, SlowFlush(sys.stdout)"
    )
    kernel.run("%%rpc worker1\nimport nbrpc._wire.output as o\no.OUTPUT_WAIT_S = 2.0")
    flood = "def flood(n):\n    for i in range(n):\n        print('line', i)\n    return n"
    try:
        kernel.run(flood)
        kernel.run(slow)
        t0 = time.monotonic()
        out = kernel.run("nbrpc.rpc_sync('worker1', flood, args=(20000,))")
        took = time.monotonic() - t0
        kernel.run("sys.stdout = real_stdout")
        shown = [line for line in out.splitlines() if line.startswith("[worker1] line ")]
        assert len(shown) == 20000, f"{len(shown)} lines in the cell"
        assert shown[-1] == "[worker1] line 19999"
        assert out.rstrip().endswith("20000"), out[-200:]  # the result comes after them
        assert took > 2.0, f"the flood took {took:.1f} s: within the bound, nothing tested"
        assert "[worker1] line" not in kernel.run("1")  # none left for the next cell
    finally:
        kernel.run("sys.stdout = globals().get('real_stdout', sys.stdout)")
        kernel.run("%%rpc worker1\no.OUTPUT_WAIT_S = 10.0")


def test_a_flood_goes_as_few_notebook_messages(kernel):
    """A flood's lines reach the notebook in messages of many lines: they went one
    message a line (20,000 for 20,000 lines, 8.5 s here), each flush waiting for the
    kernel's IO thread; joined on the worker, they went as 15 (0.13 s)."""
    kernel.run("def flood(n):\n    for i in range(n):\n        print('line', i)\n    return n")
    events = _events(kernel, "nbrpc.rpc_sync('worker1', flood, args=(20000,))")
    streams = [c for _, kind, c in events if kind == "stream"]
    text = "".join(c["text"] for c in streams)
    assert text.count("[worker1] line ") == 20000
    print(f"{len(streams)} stream messages for 20,000 lines")
    assert len(streams) <= 200, len(streams)


def test_native_output_of_a_call_reaches_the_cell_before_its_result(kernel):
    events = _events(kernel, "nbrpc.rpc_sync('worker1', native, args=('from C',))")
    err = _stream_text(events, "stderr")
    assert "[worker1] from C on fd 1\n" in err, err
    assert "[worker1] from C on fd 2\n" in err, err
    assert "[worker1] python print\n" in _stream_text(events, "stdout")
    shown = next(t for t, kind, c in events if kind == "stream" and "on fd 2" in c["text"])
    assert shown <= _result_at(events)


def test_native_output_outside_a_call_goes_to_the_running_cell(kernel):
    kernel.run("nbrpc.rpc_sync('worker2', native_later, args=('later, from a thread', 0.5))")
    events = _events(kernel, "time.sleep(4.0)")  # the line comes 0.5 s in
    assert "[worker2] later, from a thread\n" in _stream_text(events, "stderr")


def test_shutdown_noise_stays_out_and_other_cpp_lines_still_arrive():
    k = Kernel()
    try:
        k.run("%load_ext nbrpc\n%rpc_init -n 2 --quiet\nimport os, time, nbrpc", timeout=180)
        down = _events(k, "%rpc_shutdown")
        after = _events(k, "time.sleep(1.5)")
        for events in (down, after):
            text = _stream_text(events)
            assert "tensorpipe_agent" not in text, text
            assert "EOF" not in text, text
        dropped = k.value("__import__('nbrpc._wire.native_output', fromlist=['x']).dropped()")
        assert dropped >= 2, "torch wrote its line for each worker that left, and it was kept out"

        # A peer nbrpc did not stop, nor find dead: the same kind of line, about worker7,
        # still shows, once it waited DEATH_REPORT_S (1.5 s) for nbrpc's word on worker7
        line = (
            "[W1123 12:00:00.000000000 tensorpipe_agent.cpp:723] RPC agent for worker0 "
            "encountered error when reading incoming request from worker7: EOF: end of file"
        )
        events = _events(k, f"os.write(2, {(line + chr(10)).encode()!r}); time.sleep(2.5)")
        assert line in _stream_text(events, "stderr")

        # ... and so does torch's own, for a worker killed behind nbrpc's back
        k.run("%rpc_init -n 1 --quiet")
        pid = k.value("nbrpc.current().records[1].pid")
        events = _events(k, f"os.kill({pid}, 9); time.sleep(3.0)")
        assert "from worker1" in _stream_text(events, "stderr"), events
        k.run("nbrpc.shutdown(release=True)", timeout=60)
    finally:
        k.close()


def test_in_a_script_a_worker_bar_is_a_text_line_rewritten_in_place(tmp_path):
    script = """
import time, nbrpc
def work():
    from tqdm.auto import tqdm
    for _ in tqdm(range(5), desc="script"):
        time.sleep(0.05)
    return 5
nbrpc.init(n=1, progress=False)
print("result", nbrpc.rpc_sync("worker1", work))
nbrpc.shutdown(release=True)
"""
    path = tmp_path / "bar.py"
    path.write_text(script)
    done = subprocess.run(  # bytes: text mode would turn each \r into a newline
        [sys.executable, str(path)], capture_output=True, timeout=180, env=user_environment()
    )
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 0, err[-3000:]
    assert b"result 5" in done.stdout
    assert "\r[worker1] script: 100%" in err, json.dumps(err[-2000:])
    assert "\n[worker1] script:  40%" not in err, "updates rewrite the line, not add lines"


def test_a_scripts_shutdown_and_restart_are_quiet_and_its_stderr_stays_its_own(tmp_path):
    """torch's EOF lines about workers nbrpc itself stops stay out of a script's stderr too,
    filtered only while nbrpc stops them: the script's own lines, before and after, pass."""
    script = """
import os, sys, torch, nbrpc
before = os.fstat(2).st_ino
os.write(2, b"own line before\\n")
with nbrpc.init(n=2, progress=False):
    assert nbrpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 1)).item() == 2.0
    nbrpc.restart("worker2")
    assert nbrpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 2)).item() == 3.0
os.write(2, b"own line after\\n")
print("python's stderr after", file=sys.stderr)
print("same stderr", os.fstat(2).st_ino == before)
nbrpc.shutdown(release=True)
"""
    path = tmp_path / "quiet.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=180,
        env=user_environment(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same stderr True" in done.stdout
    assert "tensorpipe_agent" not in done.stderr, done.stderr
    for line in ("own line before", "own line after", "python's stderr after"):
        assert line in done.stderr, done.stderr


def test_torchs_lines_about_a_peer_nbrpc_stopped_are_expected_requests_and_responses():
    from nbrpc._wire import native_output

    line = (
        "[W1124 12:00:00.000000000 tensorpipe_agent.cpp:{n}] RPC agent for worker0 encountered "
        "error when reading incoming {what} from {peer}: EOF: end of file (this error ...)"
    )
    native_output.expect_leaving(["worker9"], seconds=60)
    for n, what in ((723, "request"), (941, "response")):
        assert native_output.expected(line.format(n=n, what=what, peer="worker9"))
        assert not native_output.expected(line.format(n=n, what=what, peer="worker8"))
    native_output.joined(["worker9"])
    assert not native_output.expected(line.format(n=941, what="response", peer="worker9"))


def test_torchs_lines_about_a_peer_nbrpc_found_dead_wait_for_that_word_and_are_dropped():
    from nbrpc import _states
    from nbrpc._wire import native_output

    def closed(peer: str) -> str:
        return (
            "[W1127 12:00:00.000000000 tensorpipe_agent.cpp:723] RPC agent for worker1 "
            f"encountered error when reading incoming request from {peer}: EOF: end of file\n"
        )

    wait = native_output.DEATH_REPORT_S
    held = native_output.Held()
    # a crash: torch's line comes first and waits, with what follows it, for nbrpc's word
    assert native_output.sift(["before\n", closed("worker7"), "after\n"], held, 100.0) == [
        "before\n"
    ]
    assert native_output.sift(["later\n"], held, 100.0 + wait / 2) == []
    native_output.on_worker_change(_states.WorkerChange(_states.Change.DIED, ("worker7",)))
    assert native_output.sift([], held, 100.0 + wait / 2) == ["after\n", "later\n"]
    assert native_output.expected(closed("worker7"))  # the other workers' lines, shown here
    # a death nbrpc did not notice in time: torch's line is shown, late
    assert native_output.sift([closed("worker6"), "next\n"], held, 200.0) == []
    assert native_output.sift([], held, 200.0 + wait) == [closed("worker6"), "next\n"]
    assert native_output.sift([closed("worker6")], held, 300.0, flush=True) == [closed("worker6")]
    assert held.lines == []
    # a fresh worker7 (a restart, a new cluster): its connections' end is news again
    native_output.on_worker_change(_states.WorkerChange(_states.Change.REJOINED, ("worker7",)))
    assert native_output.awaits_word(closed("worker7"))


def test_a_panel_no_front_end_draws_puts_the_card_in_the_cell(kernel):
    """%rpc_panel always says where the panel works. A kernel driven as nbclient drives one
    has no front end to draw the panel (or say it did): 2 s later the cluster's card is
    put in the cell's output widget, and nothing fails."""
    out = kernel.run("%rpc_panel")
    assert "JupyterLab's right side bar" in out
    time.sleep(3)
    outputs = kernel.value("[sorted(o['data']) for o in nbrpc.widgets._open[0].fallback.outputs]")
    assert len(outputs) == 1, outputs
    assert "application/vnd.jupyter.widget-view+json" in outputs[0]
    assert kernel.value("nbrpc.widgets._open[0].rendered") is False
    # a second panel closes the first, whose card stops asking the workers (each card's
    # thread once polled them every second for the kernel's life: the soak, docs/soak.md)
    kernel.run("first = nbrpc.widgets._open[0]\n%rpc_panel")
    time.sleep(3)
    assert kernel.value("first.card.live") is False
    assert kernel.value("nbrpc.widgets._open[0].card.live") is True
    kernel.run("nbrpc.widgets._open[0].close()")
    assert kernel.value("nbrpc.widgets._open[0].card.live") is False


def test_finished_bars_past_the_newest_few_become_static_and_free_their_widgets(kernel):
    """ipywidgets keeps every widget until it is closed, 11 a bar (4, their layouts and
    styles): a day of tqdm loops on workers grew the kernel for good (460 widgets more
    after 48 bars). A finished bar
    older than the newest 32 is drawn once more as static HTML, and its widgets close."""
    count = "len(__import__('ipywidgets.widgets.widget').widgets.widget._instances)"
    loop = "    for _ in tqdm(range(2), desc=f'loop {i}'):\n        pass\n"
    kernel.run("def quick_bar(i):\n    from tqdm.auto import tqdm\n" + loop + "    return i")
    before = kernel.value(count)
    events = _events(
        kernel, "for i in range(48):\n    nbrpc.rpc_sync('worker1', quick_bar, args=(i,))"
    )
    grown = kernel.value(count) - before
    print(f"48 bars: {grown} widgets more in the kernel")
    assert grown <= 11 * 32, grown  # the newest 32 bars': 4 widgets, their layouts, styles
    statics = [
        c["data"] for _, c in _shown(events, ("update_display_data",))
        if "text/html" in c["data"] and "application/vnd.jupyter.widget-view+json" not in c["data"]
    ]  # fmt: skip
    ours = [d for d in statics if d["text/plain"].startswith("[worker1] loop ")]
    assert ours, f"no bar of these was drawn as static HTML: {statics}"
    assert all("<progress" in d["text/html"] for d in ours), ours[0]


WIDGETS = "len(__import__('ipywidgets.widgets.widget').widgets.widget._instances)"


def test_an_older_status_view_and_boot_progress_become_static_and_free_their_widgets(kernel):
    """A ``%rpc_status`` view and a boot's progress stay in ipywidgets' registry until
    closed (40 widgets a cycle of init, status, a bar and shutdown, for the kernel's life:
    the soak, docs/soak.md). Once a newer one shows, the older is drawn once more as
    static HTML (its last state) and its widgets close: the newest of each stays live."""
    kernel.run("%rpc_status")
    before = kernel.value(WIDGETS)
    statics = []
    for _ in range(3):
        events = _events(kernel, "%rpc_status")
        statics += [c["data"] for _, c in _shown(events, ("update_display_data",))]
    assert kernel.value(WIDGETS) == before  # one view's widgets in, one view's out
    assert len(statics) == 3, statics
    assert all('class="nbrpc-cluster"' in d["text/html"] for d in statics), statics[0]
    assert all("worker1" in d["text/plain"] for d in statics), statics[0]
    # a boot's progress: 27 widgets for two workers, the older boot's closed
    kernel.run("%rpc_shutdown\n%rpc_init -n 2")
    before = kernel.value(WIDGETS)
    events = _events(kernel, "%rpc_shutdown\n%rpc_init -n 2")
    assert kernel.value(WIDGETS) == before
    static = [c["data"] for _, c in _shown(events, ("update_display_data",))]
    assert any("<progress" in d["text/html"] and "worker1" in d["text/plain"] for d in static)
    assert kernel.value("nbrpc.rpc_sync('worker1', len, args=([1, 2],))") == 2


def test_timelines_past_the_newest_few_become_static_and_free_their_widgets(kernel):
    """Each ``%%rpc_timeline`` cell's view held its widget and its drawing for the kernel's
    life (the soak: 135 widgets after 20 minutes, none of them bars). The newest 8 stay
    live; an older one is drawn once more as static HTML, its SVG and tooltips kept."""
    cell = "%%rpc_timeline --name tl\nnbrpc.rpc_sync('worker1', len, args=([1],))"
    for _ in range(8):
        kernel.run(cell)
    before = kernel.value(WIDGETS)
    events = _events(kernel, cell)
    events += _events(kernel, cell)
    assert kernel.value(WIDGETS) == before  # two views in, two out
    statics = [
        c["data"] for _, c in _shown(events, ("update_display_data",))
        if "application/vnd.jupyter.widget-view+json" not in c["data"]
    ]  # fmt: skip
    assert len(statics) == 2, statics
    assert all("<svg" in d["text/html"] and "len" in d["text/plain"] for d in statics), statics
