"""Shutdown, re-init in the same process, torch's own shutdown, attaching to ipyparallel."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid

import ipyparallel as ipp
import psutil
import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import ensure_cluster, run_script, wait_for_exit

import nbrpc
from nbrpc._engines import attached as attached_mod, watchdog as watchdog_mod


def test_call_before_init_says_what_to_do():
    code = (
        "import nbrpc, torch\n"
        "try:\n"
        "    nbrpc.rpc_sync('worker1', torch.add, args=(1, 2))\n"
        "except nbrpc.NotInitializedError as e:\n"
        "    print(e)\n"
        "try:\n"
        "    nbrpc.workers()\n"
        "except nbrpc.NotInitializedError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "nbrpc is not initialized, so rpc_sync has no workers" in out
    assert "%rpc_init -n 2" in out
    assert "nbrpc.init(n=2)" in out
    assert "so nbrpc.workers() has no workers" in out


def test_shutdown_then_init_again_in_the_same_process(cluster):
    old = [r.pid for r in cluster.workers[1:]]
    old_ranks = [r.rank for r in cluster.workers[1:]]
    rref = nbrpc.remote("worker1", torch.add, args=(torch.ones(1), 1))
    assert rref.to_here().item() == 2
    nbrpc.shutdown()
    assert cluster.state is nbrpc.ClusterState.CLOSED
    with pytest.raises(nbrpc.NotInitializedError):
        nbrpc.rpc_sync("worker1", torch.add, args=(1, 1))
    assert wait_for_exit(old) == [], "engines of the shut-down cluster still run"
    del rref

    again = ensure_cluster()
    assert nbrpc.workers() == ["worker0", "worker1", "worker2"]
    new_ranks = [r.rank for r in again.workers[1:]]
    assert not set(new_ranks) & set(old_ranks), "ranks must never be reused"
    assert nbrpc.rpc_sync("worker2", lambda: "hello again") == "hello again"
    counter = nbrpc.remote("worker1", lambda: [1, 2, 3])
    assert counter.to_here() == [1, 2, 3]


def test_cluster_as_context_manager_stops_its_workers_on_exit():
    """``with nbrpc.Cluster(n=1).start() as c:`` once left its workers running until exit."""
    nbrpc.shutdown()
    with nbrpc.Cluster(n=1, progress=False).start() as c:
        assert nbrpc.current() is c  # started directly, it is the current cluster
        assert nbrpc.rpc_sync("worker1", min, args=(3, 4)) == 3
        pids = [r.pid for r in c.workers[1:]]
    assert c.state is nbrpc.ClusterState.CLOSED
    assert wait_for_exit(pids) == [], "the with block's workers outlived it"
    with pytest.raises(nbrpc.NotInitializedError):
        nbrpc.current()
    with nbrpc.Cluster(n=1, progress=False) as c:  # the block starts it too
        assert c.state is nbrpc.ClusterState.READY
    t0 = time.monotonic()
    again = ensure_cluster()  # the next init is as fast as ever (it took 45 s)
    assert again.state is nbrpc.ClusterState.READY
    print(f"init after the with blocks: {time.monotonic() - t0:.1f} s")


def test_torch_shutdown_from_a_tutorial_stops_workers_not_the_kernel():
    ensure_cluster()
    rpc.shutdown()  # what seed code ends with
    with pytest.raises(nbrpc.NotInitializedError):
        nbrpc.workers()
    ensure_cluster()
    assert nbrpc.rpc_sync("worker1", min, args=(3, 4)) == 3


def test_attach_to_running_ipyparallel_cluster_leaves_it_running(monkeypatch):
    """Attaching takes every engine the cluster was started with, also those still
    registering: one engine is up, the second one is only starting when nbrpc attaches
    (ipyparallel registers engines at its heart monitor's ticks; taking "what registered
    so far" took one worker of two)."""
    nbrpc.shutdown()
    # ipyparallel's cluster as a user starts it, but with a 1 s heartbeat (its 3 s default
    # held this test at about 31 s: engines register at the heart monitor's ticks); an
    # engine takes longer than a tick to start, so the second is still on its way
    engines = ipp.Cluster(
        controller_ip="127.0.0.1", log_level=40, controller_args=["--HeartMonitor.period=1000"]
    )
    engines.start_controller_sync()
    engines.start_engines_sync(n=1)
    first = engines.connect_client_sync()
    first.wait_for_engines(1, timeout=60)
    first.close()
    engines.start_engines_sync(n=1)  # its cluster file now says 2; one has registered
    assert attached_mod.started_with(None, engines.cluster_id) == 2
    try:
        attached = nbrpc.init(cluster_id=engines.cluster_id, progress=False)
        assert attached.attached
        assert nbrpc.workers() == ["worker0", "worker1", "worker2"]
        assert nbrpc.rpc_sync("worker2", lambda x: x + 1, args=(41,)) == 42
        pids = [r.pid for r in attached.workers[1:]]
        # a scale takes an idle engine that registered there, and never starts one
        engines.start_engines_sync(n=1)
        assert list(nbrpc.scale(3).joined) == ["worker3"]
        assert nbrpc.rpc_sync("worker3", lambda: 6 * 7) == 42
        assert nbrpc.scale(2).left == ["worker3"]  # its engine runs on, used
        monkeypatch.setattr(attached_mod, "GROW_WAIT_S", 0.5)
        with pytest.raises(nbrpc.BootError, match=r"0 idle engines, not 1.*ipcluster engines"):
            nbrpc.scale(3)
        assert nbrpc.workers() == ["worker0", "worker1", "worker2"]
        nbrpc.shutdown()
        client = engines.connect_client_sync()
        client.wait_for_engines(3, timeout=30)
        assert set(pids) < set(client[:].apply_sync(__import__("os").getpid))
        # torch cannot join twice from one process: attaching again is refused clearly
        with pytest.raises(nbrpc.BootError, match=r"cannot join twice.*restart"):
            nbrpc.init(cluster_id=engines.cluster_id, progress=False)
        client.close()
    finally:
        nbrpc.shutdown()
        engines.stop_cluster_sync()
        # the files ipyparallel keeps of a cluster its user stopped (as the user would)
        watchdog_mod.remove_cluster_files(str(engines.cluster_file))
    ensure_cluster()


def test_tcp_rendezvous_on_a_free_port(tmp_path):
    """--init-method tcp://HOST:0: the store picks its port and workers are told it."""
    out = run_script(
        tmp_path / "tcp_group.py",
        "import nbrpc\n"
        "c = nbrpc.init(n=1, init_method='tcp://127.0.0.1:0', progress=False)\n"
        "from nbrpc import _group\n"
        "spec = _group.current_kernel_membership().spec\n"
        "assert spec.kind == 'tcp' and spec.port > 0, spec\n"
        "print('result', nbrpc.rpc_sync('worker1', lambda: 'over tcp'), spec.port)\n"
        "nbrpc.shutdown()\n"
        "try:\n"
        "    nbrpc.init(n=1, init_method='tcp://127.0.0.1:1', progress=False)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n",
    )
    assert "result over tcp" in out
    assert "refused:" in out
    assert "already uses a TCP store" in out


def test_listen_on_an_explicit_address(tmp_path):
    """--listen ADDR: store, TensorPipe and controller on that address; a typo is refused."""
    out = run_script(
        tmp_path / "listen.py",
        "import psutil, nbrpc\n"
        "from nbrpc import _group\n"
        "c = nbrpc.init(n=1, listen='127.0.0.1', progress=False)\n"
        "spec = _group.current_kernel_membership().spec\n"
        "assert spec.kind == 'tcp' and spec.listen == '127.0.0.1' and spec.port > 0, spec\n"
        "print('result', nbrpc.rpc_sync('worker1', lambda: 'reached'))\n"
        "me = psutil.Process()\n"
        "procs = [me] + me.children(recursive=True)\n"
        "ours = {p.pid for p in procs}\n"
        "addrs = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections('inet')\n"
        "         if c.status == 'LISTEN' and c.pid in ours}\n"
        "# torch's TCPStore binds every interface whatever host it is given (docs/security.md)\n"
        "others = {a for a in addrs if a[1] != spec.port}\n"
        "print('listening', sorted(others))\n"
        "assert others and all(ip == '127.0.0.1' for ip, _ in others), others\n"
        "nbrpc.shutdown()\n"
        "try:\n"
        "    nbrpc.init(n=1, progress=False)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n",
    )
    assert "result reached" in out
    assert "refused:" in out
    assert "needs a kernel restart" in out


def test_listen_address_checks_are_pure():
    from types import SimpleNamespace

    from nbrpc import _network

    fake = {
        "lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1")],
        "eth0": [SimpleNamespace(family=socket.AF_INET, address="10.0.0.5")],
    }
    assert _network.interface_for("10.0.0.5", fake) == "eth0"
    with pytest.raises(ValueError, match=r"It has: lo 127\.0\.0\.1, eth0 10\.0\.0\.5"):
        _network.interface_for("10.0.0.6", fake)
    assert _network.interface_toward("127.0.0.1").startswith("lo")


def test_workers_exit_when_the_kernel_is_killed(tmp_path):
    """kill -9 of the kernel: no atexit runs, yet its engines and controller go away."""
    script = tmp_path / "doomed_kernel.py"
    script.write_text(
        "import os, sys, time, torch, nbrpc\n"
        "from nbrpc._wire import lanes, shm\n"
        "c = nbrpc.init(n=2, progress=False)\n"
        "left = shm.export(torch.ones(1 << 20).untyped_storage())  # never received\n"
        "left = left[0] if isinstance(left, tuple) else left  # an arena, or a segment\n"
        "print(' '.join(str(r.pid) for r in c.workers[1:]), left, lanes.directory(),\n"
        "      c.engines.source.controller.cluster_file, flush=True)\n"
        "time.sleep(600)\n"
    )
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        *pids, segment, sockets, cluster_file = kernel.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2
        assert os.path.exists(f"/dev/shm/{segment}")
        assert os.path.isdir(sockets)  # the lanes' socket directory
        assert os.path.exists(cluster_file)  # ipyparallel's, in the profile's security dir
        security, name = os.path.split(cluster_file)
        client = os.path.join(security, f"ipcontroller-{name[8:-5]}-client.json")
        assert os.path.exists(client)  # the controller's connection file
        kernel.kill()
        kernel.wait(timeout=10)
        t0 = time.monotonic()
        assert wait_for_exit(pids, timeout=20) == [], "engines outlived their kernel"
        deadline = time.monotonic() + 10  # the watchdog sweeps them in one pass, in turn
        left_over = (f"/dev/shm/{segment}", sockets, cluster_file)
        while any(map(os.path.exists, left_over)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/dev/shm/{segment}"), "a shared-memory segment outlived it"
        assert not os.path.exists(sockets), "the lanes' socket directory outlived it"
        assert not os.path.exists(cluster_file), "ipyparallel's cluster file outlived it"
        assert not os.path.exists(client), "the controller's connection file outlived it"
        print(f"engines gone {time.monotonic() - t0:.1f} s after the kernel was killed")
    finally:
        if kernel.poll() is None:
            kernel.kill()


@pytest.mark.parametrize("after_s", [0.0, 0.3, 1.0, 2.0])
def test_a_kernel_killed_mid_boot_leaves_nothing_behind(tmp_path, after_s):
    """kill -9 while %rpc_init is still starting things: ``after_s`` after its first child
    process appeared (the watchdog, then the zygote and controller, then the engines)."""
    script = tmp_path / "dies_booting.py"
    script.write_text(
        "import nbrpc\nnbrpc.init(n=2, progress=False)\nimport time\ntime.sleep(600)\n"
    )
    token = f"NBRPC_TEST_KERNEL={uuid.uuid4().hex}"  # inherited by all it starts
    env = dict(os.environ, NBRPC_TEST_KERNEL=token.split("=")[1])
    kernel = subprocess.Popen([sys.executable, str(script)], env=env)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # everything it started, as it starts it
            with contextlib.suppress(psutil.NoSuchProcess):
                seen |= {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
            if seen and deadline - time.monotonic() > after_s:
                deadline = time.monotonic() + after_s  # the first child: kill after_s later
            time.sleep(0.02)
        kernel.kill()
        kernel.wait(timeout=10)
        assert seen, "the kernel had started nothing yet"
        time.sleep(0.5)  # a process started in the last instant shows up below too
        seen |= set(watchdog_mod.started_with(token))  # also those it started unseen
        left = wait_for_exit(list(seen), timeout=20)
        left += [p for p in watchdog_mod.started_with(token) if p not in left]
        described = []
        for pid in left:
            with contextlib.suppress(psutil.Error):
                described.append(" ".join(psutil.Process(pid).cmdline()[:4]))
        assert left == [], f"processes outlived a kernel killed mid-boot: {described}"
    finally:
        if kernel.poll() is None:
            kernel.kill()


def test_release_stops_what_a_controller_that_died_alone_forked(tmp_path):
    """A controller killed on its own leaves its forked heart monitor, no longer its child:
    release finds it by ipyparallel's cluster-id marker, as the watchdog does."""
    out = run_script(
        tmp_path / "orphan.py",
        "import os, time, psutil, nbrpc\n"
        "from nbrpc._engines import local\n"
        "nbrpc.init(n=1, progress=False)\n"
        "ours = local.kept()\n"
        "forks = [p for p in ours.controller_pids() if p != ours.controller_pid]\n"
        "assert forks, 'the controller forks its heart monitor'\n"
        "os.kill(ours.controller_pid, 9)\n"
        "time.sleep(0.5)\n"
        "def running(p):\n"
        "    try:\n"
        "        return psutil.Process(p).status() != psutil.STATUS_ZOMBIE\n"
        "    except psutil.NoSuchProcess:\n"
        "        return False\n"
        "print('orphaned', all(map(running, forks)))\n"
        "nbrpc.shutdown(release=True)\n"
        "time.sleep(0.2)\n"
        "print('left', [p for p in forks if running(p)])\n",
    )
    assert "orphaned True" in out  # its heart monitor outlived the controller
    assert "left []" in out


def test_the_watchdog_also_stops_what_the_dead_kernel_was_still_starting(tmp_path):
    """A process the kernel was starting as it died can still be between fork and exec
    at the watchdog's first look (the kernel's environment, not yet the cluster marker):
    one outlived a kernel killed mid-boot in a fresh-clone run. The watchdog looks again
    for ``SETTLE_S`` after the kernel's death."""
    marker = f"NBRPC_TEST_CLUSTER={uuid.uuid4().hex}"
    pidfile = tmp_path / "pids"
    pidfile.write_text("")
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watchdog = subprocess.Popen(
        [sys.executable, watchdog_mod.__file__, str(kernel.pid), str(pidfile), marker],
        start_new_session=True,
    )
    late = None
    try:
        time.sleep(0.5)
        kernel.kill()
        kernel.wait()
        time.sleep(watchdog_mod.POLL_S + 0.5)  # past the first look, inside the settling time
        name, value = marker.split("=")
        late = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env=dict(os.environ, **{name: value}),
        )
        assert late.wait(timeout=watchdog_mod.SETTLE_S + 10) is not None  # stopped by the watchdog
        assert watchdog.wait(timeout=20) == 0
    finally:
        for p in (kernel, watchdog, late):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


RREFS_AT_SHUTDOWN = """
import time, torch, torch.distributed.rpc as rpc, nbrpc

class Holder:                      # a worker keeps an RRef the kernel owns
    def __init__(self, rref):
        self.rref = rref

def boom(rref):                    # a failed call whose argument was an RRef
    raise ValueError("bad batch")

nbrpc.init(n=2, progress=False)
mine = rpc.RRef(torch.ones(2))
try:
    rpc.rpc_sync("worker1", boom, args=(mine,))
except ValueError:
    print("caught")
held = rpc.remote("worker2", Holder, args=(mine,))
theirs = rpc.remote("worker1", torch.ones, args=(2,))
del mine
nbrpc.shutdown()
print("shut down")
"""


def test_shutdown_after_a_failed_call_with_an_rref_waits_for_nothing(tmp_path):
    """The worker keeps its last failure for %rpc_debug, frames and the RRef argument
    included; a worker holds an RRef the kernel owns: at a graceful shutdown every process
    lets go of its RRefs at once, so torch's owner waits on nothing (it waited its whole
    bound, 5 s, and logged "Timed out waiting for pending OwnerRRefs to be deleted")."""
    path = tmp_path / "rrefs_at_shutdown.py"
    path.write_text(RREFS_AT_SHUTDOWN)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caught" in done.stdout
    assert "shut down" in done.stdout
    assert "Timed out waiting" not in done.stderr, done.stderr[-3000:]
    assert "Leaking RRef" not in done.stderr, done.stderr[-3000:]
