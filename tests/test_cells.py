"""%%rpc cells on the workers: namespaces that persist, live output, values, errors, the
stop button, push/pull, in a real IPython shell against the session's cluster."""

import signal
import threading
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbrpc


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbrpc")
    return ip


def rpc(shell, source, targets="all"):
    return shell.run_cell_magic("rpc", targets, source)


def test_state_persists_between_cells_on_each_worker(shell, cluster):
    rpc(shell, "import os\ncounter = 0")
    rpc(shell, "counter += 1")
    rpc(shell, "counter += 10", "worker2")  # one target only
    assert rpc(shell, "counter") == {"worker1": 1, "worker2": 11}
    pids = rpc(shell, "os.getpid()")
    assert pids == {r.name: r.pid for r in cluster.workers[1:]}  # it ran on the workers


def test_classes_defined_in_a_cell_pickle_by_reference_on_that_worker(shell, cluster):
    rpc(shell, "class Point:\n    def __init__(self, x):\n        self.x = x\n")
    out = rpc(shell, "import pickle\nblob = pickle.dumps(Point(3))\nb'Point' in blob, len(blob)")
    for found, size in out.values():
        assert found
        assert size < 100, "pickled by value, not by reference"
    assert rpc(shell, "pickle.loads(blob).x") == {"worker1": 3, "worker2": 3}


def test_last_expression_is_returned_and_shown_once_per_worker(shell, cluster, capsys):
    result = rpc(shell, "40 + 2")
    assert isinstance(result, dict)
    assert result == {"worker1": 42, "worker2": 42}
    result._ipython_display_()
    shown = capsys.readouterr().out
    assert shown.count("Out[worker1]: 42") == 1
    assert shown.count("Out[worker2]: 42") == 1
    assert rpc(shell, "x = 5") == {"worker1": None, "worker2": None}
    rpc(shell, "x = 5")._ipython_display_()
    assert capsys.readouterr().out == ""  # a statement shows nothing


def test_output_streams_live_and_in_order(shell, cluster, capsys):
    source = (
        "import time\n"
        "for i in range(3):\n"
        "    print('line', i, flush=True)\n"
        "time.sleep(4.0)\n"
        "print('last', flush=True)\n"
    )
    done = threading.Event()
    seen_before_end = []

    def watch():
        deadline = time.monotonic() + 15
        text = ""
        while not done.is_set() and time.monotonic() < deadline:
            text += capsys.readouterr().out
            if "[worker1] line 2" in text and "[worker2] line 2" in text:
                seen_before_end.append(text)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    rpc(shell, source)
    done.set()
    watcher.join()
    assert seen_before_end, "output arrived only when the cell ended, not live"
    rest = seen_before_end[0] + capsys.readouterr().out
    for worker in ("worker1", "worker2"):
        lines = [ln for ln in rest.splitlines() if ln.startswith(f"[{worker}]")]
        want = [f"[{worker}] line {i}" for i in range(3)]
        assert lines == [*want, f"[{worker}] last"]


def test_one_failure_keeps_its_type_names_the_worker_and_keeps_the_others(shell, cluster):
    source = "import nbrpc\nname = nbrpc.get_worker_info().name\nratio = 1 / (name == 'worker1')\n"
    with pytest.raises(ZeroDivisionError) as info:
        rpc(shell, source + "ratio")
    err = info.value
    assert err.worker == "worker2"
    assert "ratio = 1 / (name == 'worker1')" in err.remote_traceback  # the cell's own line
    assert err.results == {"worker1": 1.0}  # the worker that succeeded


def test_several_failures_raise_one_exception_group(shell, cluster):
    source = "import nbrpc\nif nbrpc.get_worker_info().name == 'worker1':\n    1 / 0\n"
    source += "else:\n    {}['missing']\n"
    with pytest.raises(nbrpc.RpcCellError) as info:
        rpc(shell, source)
    group = info.value
    assert isinstance(group, nbrpc.NbrpcError)  # an ExceptionGroup would not show in IPython 9
    assert sorted(type(e).__name__ for e in group.exceptions) == [
        "KeyError",
        "ZeroDivisionError",
    ]
    assert sorted(e.worker for e in group.exceptions) == ["worker1", "worker2"]
    caught = []
    try:
        raise group.group()
    except* ZeroDivisionError as zero:
        caught.append(zero.exceptions[0].worker)
    except* KeyError as key:
        caught.append(key.exceptions[0].worker)
    assert sorted(caught) == ["worker1", "worker2"]


def test_a_syntax_error_stops_before_any_worker_runs(shell, cluster):
    rpc(shell, "marker = 'before'")
    with pytest.raises(SyntaxError):
        rpc(shell, "marker = 'after'\nif True print(1)")
    assert rpc(shell, "marker") == {"worker1": "before", "worker2": "before"}


def test_the_stop_button_interrupts_every_target_and_the_namespaces_survive(shell, cluster):
    rpc(shell, "kept = 'still here'")
    busy = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
    # the stop button: SIGINT to the kernel process, which the OS may hand to any of its
    # threads; here deliberately not to the main thread (the harder case)
    pressed: list[float] = []

    def press() -> None:
        pressed.append(time.monotonic())
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    timer = threading.Timer(1.0, press)
    # a kernel handles SIGINT with Python's default handler; a test run started in the
    # background (`make test &`) inherits SIGINT ignored, so install it for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            rpc(shell, busy)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    took = time.monotonic() - pressed[0]  # from the press on (a timer may fire late)
    print(f"%%rpc interrupted on every worker {took:.2f} s after the stop button")
    assert took < 2.0 + 1.0, f"the interrupt took {took:.1f} s to stop the cell"
    assert nbrpc.status()[1]["calls_in_flight"] == 0  # nothing still running there
    assert rpc(shell, "kept") == {"worker1": "still here", "worker2": "still here"}


def test_push_pull_and_the_namespace_from_a_function(shell, cluster):
    nbrpc.push({"lr": 0.5, "tag": "a"})
    nbrpc.push({"tag": "b"}, workers="worker2")
    assert nbrpc.pull("tag") == {"worker1": "a", "worker2": "b"}
    assert rpc(shell, "lr * 2") == {"worker1": 1.0, "worker2": 1.0}

    def remember(x):  # the namespace, asked for by name
        nbrpc.worker_namespace().setdefault("seen", []).append(x)
        return len(nbrpc.worker_namespace()["seen"])

    assert [nbrpc.rpc_sync("worker1", remember, args=(i,)) for i in range(3)] == [1, 2, 3]
    assert nbrpc.pull("seen", workers="worker1") == {"worker1": [0, 1, 2]}
    with pytest.raises(NameError, match="not defined on this worker"):
        nbrpc.pull("never_set")


def test_bad_targets_and_empty_cells_are_clear(shell, cluster):
    with pytest.raises(nbrpc.ConfigError, match=r"wroker1.*Its workers: worker1, worker2"):
        rpc(shell, "1", "wroker1")
    with pytest.raises(nbrpc.ConfigError, match="the kernel is not a target"):
        rpc(shell, "1", "worker0")
    with pytest.raises(nbrpc.ConfigError, match="empty"):
        rpc(shell, "   \n")


def test_rpc_cell_before_init_says_what_to_do(shell, cluster):
    nbrpc.shutdown()
    try:
        with pytest.raises(nbrpc.NotInitializedError, match="%rpc_init"):
            rpc(shell, "1")
    finally:
        from conftest import ensure_cluster

        ensure_cluster()
