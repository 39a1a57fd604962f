"""Restart a worker without losing the rest, in real kernels, as a person types.

One kernel's cluster of two workers: state on both, then ``%rpc_restart worker2``; the
kernel and worker1 keep everything, what the old worker2 owned fails naming the restart,
and every path to the new worker2 works (the kernel, worker1, back, shared memory,
distributed autograd and the optimizer, compared with a local reference). Then a dead
worker, a process group rebuilt, ``--restart-dead``, and the faults (an unknown name, a new
process that dies as it starts).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from conftest import MEMBER_CODE, TRAIN_ON, Kernel, first_error, running_kernel

SETUP = (
    """%load_ext nbrpc
%rpc_init -n 2 --quiet
import os, time, torch, nbrpc
from nbrpc import autograd as dist_autograd
from nbrpc.optim import DistributedOptimizer

def call_back():
    return nbrpc.rpc_sync("worker0", whoami)
"""
    + MEMBER_CODE
)


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(SETUP, closing="nbrpc.shutdown(release=True)") as k:
        yield k


def test_restart_keeps_the_rest_and_every_path_to_the_new_process_works(kernel):
    k = kernel
    k.run(
        "c1 = nbrpc.remote('worker1', Counter)\nc2 = nbrpc.remote('worker2', Counter)\n"
        "c1.rpc_sync().add(5); c2.rpc_sync().add(7)\n"
        "pids = {n: nbrpc.rpc_sync(n, whoami) for n in ('worker1', 'worker2')}"
    )
    # worker1 knows the old worker2: it called it (and kept calling it after the restart,
    # with EPIPE, until workers looked a peer up again after a membership change)
    assert k.value("nbrpc.rpc_sync('worker1', call_peer, args=('worker2',)) == pids['worker2']")
    k.run("%%rpc\nremembered = 'here'")
    t0 = time.monotonic()
    out = k.run("%rpc_restart worker2")
    took = time.monotonic() - t0
    assert "worker2 restarted" in out, out
    assert "nbrpc.rank() 2; torch id 2 -> " in out, out  # the rank a script has stays 2
    assert "its RRefs and its globals (set by %%rpc cells or nbrpc.push) are gone" in out, out
    print(f"local restart, no spare: {took:.2f} s")
    # what is shown as a rank is nbrpc.rank(); torch's new id is labelled as torch's
    rows = {r["name"]: r for r in k.value("nbrpc.status()")}
    assert (rows["worker2"]["rank"], rows["worker1"]["rank"]) == (2, 1), rows
    assert rows["worker2"]["torch_id"] not in (1, 2), rows
    table = k.run("print(nbrpc.current().summary())")
    assert "name     rank  torch id" in table, table
    line = next(x.split() for x in table.splitlines() if x.split()[:1] == ["worker2"])
    assert line[1:3] == ["2", str(rows["worker2"]["torch_id"])], table

    # the kernel and worker1 keep their processes and state
    assert k.value("nbrpc.rpc_sync('worker1', whoami) == pids['worker1']")
    assert k.value("c1.rpc_sync().add(1)") == 6
    assert k.value("nbrpc.rpc_sync('worker2', whoami) != pids['worker2']")
    cells = k.run("%%rpc\nprint('remembered' in globals())")
    assert "[worker1] True" in cells, cells
    assert "[worker2] False" in cells, cells  # a fresh namespace

    # what the old worker2 owned fails, naming the restart
    for expr in ("c2.to_here()", "c2.rpc_sync().add(1)"):
        out, errors = k.execute(expr)
        assert first_error(errors).startswith("WorkerDiedError"), (expr, errors)
        assert "worker2 was restarted" in errors[0], errors[0]
    owners = k.value("sorted({r['owner'] for r in nbrpc.ownership()})")
    assert "worker2" not in owners, owners  # the view shows the old one's objects gone

    # every path to the new process
    assert k.value("nbrpc.rpc_sync('worker2', call_back) == os.getpid()")
    assert k.value("nbrpc.rpc_sync('worker1', call_peer, args=('worker2',))") == k.value(
        "nbrpc.rpc_sync('worker2', whoami)"
    )
    assert k.value("nbrpc.rpc_sync('worker2', call_peer, args=('worker1',)) == pids['worker1']")
    assert k.value("nbrpc.rpc_sync('worker2', Counter).add(2)") == 2
    k.run("big = torch.randn(16 * 2**20)")  # 64 MB: the shared-memory path
    assert k.value("torch.equal(nbrpc.rpc_sync('worker2', double, args=(big,)), big * 2)")

    # distributed autograd and the optimizer across it, against a local reference
    k.run(TRAIN_ON.format(w="worker2"))
    assert k.value("same")
    states = dict(k.value("[(r['name'], r['state']) for r in nbrpc.status()]"))
    assert set(states.values()) == {"ready"}, states


def test_a_dead_worker_is_restarted_and_a_bad_name_stops_nothing(kernel):
    k = kernel
    before = k.value("[r.pid for r in nbrpc.current().records]")
    out, errors = k.execute("%rpc_restart worker9")
    assert first_error(errors).startswith("ConfigError"), errors
    assert "worker9: worker9 is not a worker of this cluster" in errors[0]
    assert k.value("[r.pid for r in nbrpc.current().records]") == before  # nothing stopped

    pid = k.value("nbrpc.rpc_sync('worker1', whoami)")
    os.kill(pid, signal.SIGKILL)
    out, errors = k.execute("nbrpc.rpc_sync('worker1', whoami)")
    assert first_error(errors).startswith("WorkerDiedError"), errors
    out = k.run("%rpc_restart worker1")
    assert "worker1 restarted" in out, out
    assert k.value("nbrpc.rpc_sync('worker1', whoami)") != pid


def test_a_new_process_that_dies_as_it_starts_is_a_boot_error_and_a_second_try_works(kernel):
    k = kernel
    zygote = next(
        p
        for p in psutil.Process(k.value("os.getpid()")).children()
        if "nbrpc._engines.zygote" in " ".join(p.cmdline())
    )
    known = {c.pid for c in zygote.children(recursive=True)}
    stop = threading.Event()

    def kill_new_engines() -> None:  # what an out-of-memory kill at start looks like
        while not stop.is_set():
            for child in zygote.children(recursive=True):
                if child.pid not in known:
                    child.kill()
            time.sleep(0.01)

    killer = threading.Thread(target=kill_new_engines, daemon=True)
    killer.start()
    try:
        out, errors = k.execute("%rpc_restart worker2", timeout=180)
    finally:
        stop.set()
        killer.join()
    assert first_error(errors).startswith("BootError"), (out, errors)
    print("restart of a process that died at start:", errors[0])
    assert k.value("nbrpc.rpc_sync('worker1', lambda: 41 + 1)") == 42  # the rest works
    out = k.run("%rpc_restart worker2")
    assert "worker2 restarted" in out, out
    assert k.value("nbrpc.rpc_sync('worker2', lambda: 6 * 7)") == 42


#: The kernel's wait for a restart's join, made long (its first 30 s a plain sleep) so that
#: the stop button's press lands in it; the worker's own join goes on meanwhile.
SLOW_JOINS = (
    "import nbrpc._lifecycle.boot as boot_steps\n"
    "real_wait = boot_steps.wait_for_joins\n"
    "def slow_wait(*args, **kw):\n"
    "    time.sleep(30)\n"
    "    return real_wait(*args, **kw)\n"
)


def _stop_a_restart(k, name: str) -> tuple[list[str], str]:
    """``%rpc_restart name`` with the stop button pressed while the kernel waits for the
    new process's join: the errors, and what the cell wrote to stderr."""
    k.run(SLOW_JOINS + "boot_steps.wait_for_joins = slow_wait")
    try:
        ran_on, errors = k.stop_after(f"%rpc_restart {name}", 2.0)
        said = k.stderr
    finally:
        k.run("boot_steps.wait_for_joins = real_wait")
    assert ran_on < 5, ran_on
    return errors, said


def test_the_stop_button_during_a_restart_leaves_the_worker_dead_and_says_what_next(kernel):
    """The stop button while the new process starts left the worker "restarting" for good,
    a call quoted nbrpc's words as torch's, and the shutdown named a gone engine. Now it
    is dead, the cell says so and what to run, a call says why, and a second restart or a
    shutdown works."""
    k = kernel
    errors, said = _stop_a_restart(k, "worker1")
    assert first_error(errors).startswith("KeyboardInterrupt"), errors
    assert "the stop button during a restart: worker1 is dead now" in said, said
    assert "%rpc_restart worker1 starts it anew" in said, said
    states = dict(k.value("[(r['name'], r['state']) for r in nbrpc.status()]"))
    assert states["worker1"] == "dead", states
    assert states["worker2"] == "ready", states
    _, errors = k.execute("nbrpc.rpc_sync('worker1', whoami)")
    assert first_error(errors).startswith("WorkerDiedError"), errors
    assert "its restart was stopped (the stop button)" in errors[0], errors
    assert "torch said" not in errors[0], errors
    assert "%rpc_restart worker1" in errors[0], errors
    assert k.value("nbrpc.rpc_sync('worker2', lambda: 6 * 7)") == 42  # the rest works
    out = k.run("%rpc_restart worker1")  # the fix it names
    assert "worker1 restarted" in out, out
    assert k.value("nbrpc.rpc_sync('worker1', lambda: 6 * 7)") == 42

    # stopped again, then a shutdown: it asks no gone engine for its RRefs
    assert first_error(_stop_a_restart(k, "worker2")[0]).startswith("KeyboardInterrupt")
    k.run("%rpc_shutdown")
    assert "cannot release its RRefs" not in k.stderr, k.stderr
    assert "No such engine" not in k.stderr, k.stderr
    k.run("%rpc_init -n 2 --quiet")  # the next cluster is whole
    assert k.value("[nbrpc.rpc_sync(n, lambda: 1) for n in ('worker1', 'worker2')]") == [1, 1]


def test_a_process_group_is_rebuilt_and_restart_dead_replaces_a_dead_worker():
    k = Kernel()
    try:
        k.run(
            "%load_ext nbrpc\n%rpc_init -n 2 --process-group gloo --restart-dead --quiet\n"
            "import os, signal, nbrpc",
            timeout=180,
        )
        reduce = (
            "%%rpc\nimport torch, torch.distributed as dist\n"
            "x = torch.tensor([dist.get_rank() + 1.0])\ndist.all_reduce(x)\nx.item()"
        )
        assert "3.0" in k.run(reduce)
        out = k.run("%rpc_restart worker1")
        assert "process group was rebuilt" in out, out
        out = k.run(reduce)
        assert out.count("3.0") == 2, out

        pid = k.value("nbrpc.current().records[2].pid")
        os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)  # ipyparallel's heartbeats see it gone
        out = k.run("print(nbrpc.rpc_sync('worker2', os.getpid))")
        assert "nbrpc: worker2 died" in out, out
        assert "worker2 restarted" in out, out
        assert str(pid) not in out.splitlines()[-1]
        assert out.count("3.0") == 0
        assert k.run(reduce).count("3.0") == 2
        k.run("nbrpc.shutdown(release=True)", timeout=60)
    finally:
        k.close()
