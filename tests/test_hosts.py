"""Workers on other hosts (``--hosts``), across real network boundaries.

The hosts are network namespaces with their own address, hostname, /dev/shm, /etc/hosts,
PID namespace and sshd (tools/fakehosts.py); the kernel is a real Jupyter kernel driven
through jupyter_client, so ``%rpc_init --hosts`` runs as a user types it. Building hosts
needs root: elsewhere these tests skip and say why. The pure checks run everywhere.
"""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest
from conftest import load_fakehosts, running_kernel

import nbrpc
from nbrpc import _group, _placement
from nbrpc._engines import hosts as _hosts
from nbrpc._options import Settings

fakehosts = load_fakehosts()


# -- pure: parsing, options, settings --------------------------------------------------------


def test_hosts_are_parsed_counted_and_checked():
    assert _placement.parse_hosts("root@h1, h1,h2") == ("root@h1", "h1", "h2")
    assert _hosts.counts(("h1", "h2", "h1")) == {"h1": 2, "h2": 1}
    for bad in ("", " , ", "h1 -p 22", "h1;rm"):
        with pytest.raises(nbrpc.ConfigError, match="--hosts"):
            _placement.parse_hosts(bad)


def test_ssh_always_runs_in_batch_mode_with_a_connect_timeout():
    opts = _hosts.ssh_options(("-F", "cfg", "-p", "2222"))
    assert opts[:4] == ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={_hosts.CONNECT_TIMEOUT_S}"]
    assert opts[-4:] == ["-F", "cfg", "-p", "2222"]
    assert _hosts.scp_args(("-p", "2222"))[-2:] == ["-P", "2222"]  # scp spells the port -P


def test_host_settings_refuse_what_cannot_work():
    with pytest.raises(nbrpc.ConfigError, match="does not match"):
        Settings.make(3, hosts="198.51.100.11,198.51.100.12", listen="198.51.100.1")
    with pytest.raises(nbrpc.ConfigError, match="one name per"):
        Settings.make(hosts="h1,h2", names=["a"], listen="198.51.100.1")
    with pytest.raises(nbrpc.ConfigError, match="loopback"):
        Settings.make(hosts="h1", listen="127.0.0.1")
    with pytest.raises(nbrpc.ConfigError, match="one or the other"):
        Settings.make(hosts="h1", profile="default")
    with pytest.raises(nbrpc.ConfigError, match="goes with --hosts"):
        Settings.make(2, ssh_args="-F cfg")
    with pytest.raises(nbrpc.ConfigError, match="goes with --hosts or --slurm"):
        Settings.make(2, remote_python="/opt/venv/bin/python")
    assert Settings.make(2, slurm=True, remote_python="/opt/py").remote_python == "/opt/py"


def test_init_method_host_becomes_the_listen_address():
    """Failure 1: tcp://ADDR:PORT alone left TensorPipe on the hostname's 127.0.1.1."""
    assert _group.listen_of_init_method("tcp://127.0.0.1:0") is None
    with pytest.raises(nbrpc.ConfigError, match="wildcard"):
        _group.listen_of_init_method("tcp://0.0.0.0:29500")
    with pytest.raises(nbrpc.ConfigError, match="no network interface"):
        _group.listen_of_init_method("tcp://203.0.113.77:29500")  # not this host's


def test_the_store_listens_on_its_address_alone():
    """Failure 6: torch's TCPStore bound every interface whatever host it was given."""
    import psutil

    store = _group.StoreSpec(kind="tcp", host="127.0.0.1", port=0).open(is_master=True, timeout_s=5)
    mine = [
        c.laddr
        for c in psutil.Process().net_connections("tcp")
        if c.status == "LISTEN" and c.laddr.port == store.port
    ]
    assert [a.ip for a in mine] == ["127.0.0.1"], mine
    del store


# -- across fake hosts -------------------------------------------------------------------------

why_not = fakehosts.missing()
needs_hosts = pytest.mark.skipif(why_not is not None, reason=f"no fake hosts: {why_not}")


@pytest.fixture(scope="module")
def hosts():
    with fakehosts.FakeHosts(2) as fake:
        yield fake


@pytest.fixture(scope="module")
def kernel(hosts):
    setup = f"%load_ext nbrpc\nSSH = '-F {hosts.ssh_config}'\nimport nbrpc, os, socket, time, torch"
    with running_kernel(setup, closing="import nbrpc; nbrpc.shutdown(release=True)") as k:
        yield k


def _veth_bytes(i: int) -> int:
    with open(f"/sys/class/net/nbrpcv{i}/statistics/tx_bytes") as f:
        return int(f.read())


@needs_hosts
def test_preflight_names_the_host_and_the_fix_within_seconds(hosts, kernel):
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:  # 198.51.100.99: no such host on the bridge
        kernel.run('%rpc_init --hosts 198.51.100.99,fakeh1 --ssh-args "$SSH" --quiet')
    took = time.monotonic() - t0
    text = str(err.value)
    assert "BootError" in text, text
    assert "198.51.100.99: cannot log in over ssh" in text, text
    assert "ssh-copy-id" in text
    assert took < _hosts.CONNECT_TIMEOUT_S + 10, took  # not a 30 s store timeout

    with pytest.raises(AssertionError) as err:
        kernel.run('%rpc_init --hosts fakeh2 --ssh-args "$SSH" --remote-python /no/python')
    assert "fakeh2: /no/python does not run there" in str(err.value)
    assert "--remote-python PATH" in str(err.value)

    system = "/usr/bin/python3"
    if os.path.realpath(system) != os.path.realpath(nbrpc_python()):
        with pytest.raises(AssertionError) as err:  # Debian's Python: no torch (or another one)
            kernel.run(f'%rpc_init --hosts fakeh2 --ssh-args "$SSH" --remote-python {system}')
        assert ("fakeh2:" in str(err.value) and "pip install" in str(err.value)) or (
            "Python 3." in str(err.value)
        ), str(err.value)


def nbrpc_python() -> str:
    import sys

    return sys.executable


@needs_hosts
def test_a_host_that_cannot_reach_the_kernel_is_refused_before_any_engine(hosts, kernel):
    """fakeh2 reaches 198.51.100.1 (ssh works) but not a second address of this host."""
    extra = "198.51.100.2"
    fakehosts._run("ip", "addr", "add", f"{extra}/32", "dev", fakehosts.BRIDGE)
    fakehosts._run("ip", "-n", "nbrpc-h2", "route", "add", "prohibit", f"{extra}/32")
    try:
        with pytest.raises(AssertionError) as err:
            kernel.run(f'%rpc_init --hosts fakeh2 --listen {extra} --ssh-args "$SSH" --quiet')
        text = str(err.value)
        assert f"fakeh2 cannot reach this kernel at {extra}:" in text, text
        assert "--listen" in text
        assert hosts.processes("fakeh2") == [], "no engine was started"
    finally:
        fakehosts._run("ip", "addr", "del", f"{extra}/32", "dev", fakehosts.BRIDGE, check=False)


@needs_hosts
def test_workers_on_two_hosts_over_ssh(hosts, kernel):
    t0 = time.monotonic()
    text = kernel.run('%rpc_init --hosts fakeh1,fakeh1,fakeh2 --ssh-args "$SSH" --quiet')
    boot = time.monotonic() - t0
    print(f"boot over ssh: {boot:.2f} s", text)
    # named in list order whatever order engines registered in; each on its own host
    placed = kernel.value(
        "{w: nbrpc.rpc_sync(w, lambda: socket.gethostname()) "
        "for w in ['worker1', 'worker2', 'worker3']}"
    )
    assert placed == {"worker1": "fakeh1", "worker2": "fakeh1", "worker3": "fakeh2"}
    rows = kernel.value("[(r['name'], r['host'], r['state']) for r in nbrpc.status()]")
    assert [r[1] for r in rows[1:]] == ["fakeh1", "fakeh1", "fakeh2"]
    assert "fakeh2" in kernel.run("print(nbrpc.current().summary())")

    # the kernel's address was worked out from the route (no --listen), and every socket
    # the kernel's side listens on is bound to it (or loopback): the store included
    assert kernel.value("nbrpc._group.current_kernel_membership().spec.listen") == (
        fakehosts.KERNEL_ADDRESS
    )
    listening = kernel.value(
        "sorted({c.laddr.ip for p in [__import__('psutil').Process()] + "
        "__import__('psutil').Process().children(recursive=True) "
        "for c in p.net_connections('inet') if c.status == 'LISTEN'})"
    )
    assert set(listening) <= {fakehosts.KERNEL_ADDRESS, "127.0.0.1"}, listening
    assert fakehosts.KERNEL_ADDRESS in listening

    # the watchdog is given this host's pids only (the controller), never the engines';
    # the engines' files live in a directory of this controller's own (no stale files)
    watched, local, run = kernel.value(
        "(lambda h: (open(h.pidfile).read().split(), h.pids(), h.remote_dir))"
        "(nbrpc.current().engines.source.controller)"
    )
    assert sorted(map(int, watched)) == sorted(local)
    for pid in local:  # the controller and its heart monitor: no engine (their pids are
        # another host's, and may equal a pid of this one)
        assert "controller_process.py" in " ".join(psutil.Process(pid).cmdline()), pid
    assert hosts.ssh("fakeh1", "ls -A ~/.nbrpc").split() == [run.split("/")[-1]]

    # notebook code, remote print, a remote exception with its type
    out = kernel.run(
        "def where(x):\n"
        "    print('on', socket.gethostname())\n"
        "    return x * 2\n"
        "print(nbrpc.rpc_sync('worker3', where, args=(torch.ones(2),)))"
    )
    assert "[worker3] on fakeh2" in out
    assert "tensor([2., 2.])" in out
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        kernel.run("nbrpc.rpc_sync('worker1', lambda: 1 / 0)")

    # an RRef owned on fakeh1, used on fakeh2
    assert kernel.value(
        "nbrpc.rpc_sync('worker3', lambda r: (r.to_here() * 3).tolist(), "
        "args=(nbrpc.remote('worker1', torch.ones, args=((3,),)),))"
    ) == [3.0, 3.0, 3.0]

    # 64 MB to fakeh2 and back: the bytes cross the veth
    before = _veth_bytes(2)
    t = kernel.value(
        "(lambda x: (lambda t0: (nbrpc.rpc_sync('worker3', lambda t: t + 1, args=(x,)), "
        "time.perf_counter() - t0))(time.perf_counter()))(torch.zeros(16 << 20))[1]"
    )
    crossed = _veth_bytes(2) - before
    print(
        f"64 MB round trip between hosts: {t * 1000:.0f} ms; {crossed / 2**20:.0f} MiB on the veth"
    )
    assert crossed >= 64 * 2**20, crossed
    assert (
        kernel.value(
            "nbrpc.rpc_sync('worker3', lambda t: float(t.sum()), args=(torch.ones(16 << 20),))"
        )
        == 16 << 20
    )

    # shared memory between the two workers on fakeh1 (one /dev/shm), TensorPipe elsewhere
    peers = kernel.value("nbrpc.current().shm_peers")
    assert peers == {"worker0": [], "worker1": ["worker2"], "worker2": ["worker1"], "worker3": []}
    assert "shared memory between processes of one host (worker1, worker2)" in kernel.run(
        "print(nbrpc.current().summary())"
    )
    kernel.run(
        "def sent():\n"
        "    from nbrpc._wire import shm\n"
        "    return {w: nbrpc.rpc_sync(w, shm.exported) for w in ('worker1', 'worker2', "
        "'worker3')}\n"
        "def via_worker2(n):\n"
        "    t = nbrpc.rpc_sync('worker2', lambda t: t + 1, args=(torch.ones(n),))\n"
        "    return float(t.sum())\n"
    )
    before = kernel.value("sent()")
    assert kernel.value("nbrpc.rpc_sync('worker1', via_worker2, args=(16 << 20,))") == 2 * (
        16 << 20
    )
    after = kernel.value("sent()")
    # one segment for the call (worker1 -> worker2), one for its reply (worker2 -> worker1)
    assert after == {**before, "worker1": before["worker1"] + 1, "worker2": before["worker2"] + 1}
    # a reply to the kernel (another host) and a call from it: TensorPipe, right values
    assert kernel.value(
        "float(nbrpc.rpc_sync('worker1', lambda t: t * 2, args=(torch.ones(16 << 20),)).sum())"
    ) == 2 * (16 << 20)
    assert kernel.value("sent()") == after

    # distributed autograd across both hosts, against the same model in one process
    kernel.run(
        "import torch.nn as nn\n"
        "torch.manual_seed(0)\n"
        "a, b = nn.Linear(4, 3).double(), nn.Linear(3, 1).double()\n"
        "ra = nbrpc.remote('worker1', lambda m: m, args=(a,))\n"
        "rb = nbrpc.remote('worker3', lambda m: m, args=(b,))\n"
        "x = torch.randn(5, 4, dtype=torch.float64)\n"
        "def fwd(r, x):\n"
        "    return r.local_value()(x)\n"
        "def grads_of(r, ctx):\n"
        "    g = nbrpc.autograd.get_gradients(ctx)\n"
        "    return [g[p] for p in r.local_value().parameters()]\n"
        "with nbrpc.autograd.context() as ctx:\n"
        "    h = nbrpc.rpc_sync('worker1', fwd, args=(ra, x))\n"
        "    loss = nbrpc.rpc_sync('worker3', fwd, args=(rb, h)).sum()\n"
        "    nbrpc.autograd.backward(ctx, [loss])\n"
        "    remote = nbrpc.rpc_sync('worker1', grads_of, args=(ra, ctx))\n"
        "    remote += nbrpc.rpc_sync('worker3', grads_of, args=(rb, ctx))\n"
        "b(a(x)).sum().backward()\n"
        "local = [p.grad for p in [*a.parameters(), *b.parameters()]]\n"
    )
    assert kernel.value(
        "len(remote) == 4 and all(torch.allclose(r, l, atol=1e-12) for r, l in zip(remote, local))"
    )


@needs_hosts
def test_a_recording_and_the_stacks_reach_workers_on_other_hosts(hosts, kernel):
    kernel.run(
        "def spin(s):\n"
        "    t = time.time()\n"
        "    while time.time() - t < s:\n"
        "        pass\n"
        "    return s\n"
        "def across(x):\n"
        "    return nbrpc.rpc_sync('worker3', spin, args=(x,))\n"
        "with nbrpc.record() as rec:\n"
        "    nbrpc.rpc_sync('worker1', across, args=(0.05,))\n"
        "rows = rec.calls\n"
    )
    rows = kernel.value("[(r['caller'], r['callee'], r['function'], r['parent']) for r in rows]")
    outer, inner = rows
    assert outer[:3] == ["worker0", "worker1", "across"]
    assert inner[:3] == ["worker1", "worker3", "spin"]
    assert kernel.value("rows[1]['parent'] == rows[0]['id']")
    # one clock across hosts: the call made on fakeh1 to fakeh2 lies within its parent
    assert kernel.value(
        "rows[0]['start_s'] <= rows[1]['sent_s'] <= rows[1]['start_s'] "
        "<= rows[1]['end_s'] <= rows[0]['end_s']"
    )

    # it spins long past the read, so a slow read still finds it busy
    kernel.run("busy = nbrpc.rpc_async('worker3', spin, args=(6.0,)); time.sleep(0.5)")
    t0 = time.monotonic()
    stacks = kernel.value(
        "[(r['name'], r['host'], r['how'], r['error'], "
        "[(t['serving'], t['frames'][-1]['function']) for t in r['threads'] if t['serving']]) "
        "for r in nbrpc.stacks('worker3')]"
    )
    took = time.monotonic() - t0
    print(f"stacks of a busy worker on another host: {took:.2f} s")
    ((name, host, how, error, serving),) = stacks
    assert [name, host, how, error] == ["worker3", "fakeh2", "thread", None]
    assert [[label.split(" (")[0], where] for label, where in serving] == [
        ["spin from worker0", "spin"]
    ]
    assert took < 3.0  # 2 s, plus this test's own round trips to the kernel
    assert kernel.value("busy.wait()") == 6.0


@needs_hosts
def test_a_worker_killed_on_its_host_is_reported_dead(hosts, kernel):
    kernel.run("fut = nbrpc.rpc_async('worker3', time.sleep, args=(60,))\ntime.sleep(0.5)")
    hosts.kill("fakeh2", "nbrpc._engine")
    t0 = time.monotonic()
    text = kernel.run(
        "try:\n    fut.wait()\nexcept nbrpc.WorkerDiedError as e:\n    print('died:', e)"
    )
    took = time.monotonic() - t0
    assert "died:" in text, text
    assert "worker3" in text, text
    assert took < 10, took
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = dict(kernel.value("[(r['name'], r['state']) for r in nbrpc.status()]"))
        if states["worker3"] == "dead":
            break
        time.sleep(0.5)
    assert states == {"worker0": "ready", "worker1": "ready", "worker2": "ready", "worker3": "dead"}
    assert kernel.value("nbrpc.rpc_sync('worker1', lambda: 5)") == 5


@needs_hosts
def test_a_dead_worker_on_another_host_is_restarted_there(hosts, kernel):
    kernel.run("kept = nbrpc.rpc_sync('worker1', os.getpid)")
    t0 = time.monotonic()
    out = kernel.run("%rpc_restart worker3")
    took = time.monotonic() - t0
    assert "worker3 restarted" in out, out
    assert kernel.value("nbrpc.rpc_sync('worker3', socket.gethostname)") == "fakeh2"
    assert kernel.value("nbrpc.rpc_sync('worker1', os.getpid) == kept")  # untouched
    nested = "nbrpc.rpc_sync('worker3', nbrpc.rpc_sync, args=('worker1', abs, (-3,)))"
    assert kernel.value(nested) == 3  # the new process reaches the others, and back
    states = dict(kernel.value("[(r['name'], r['state']) for r in nbrpc.status()]"))
    assert set(states.values()) == {"ready"}, states
    print(f"restart of a worker on another host: {took:.2f} s")


@needs_hosts
def test_shutdown_leaves_nothing_on_the_hosts_and_init_works_again(hosts, kernel):
    t0 = time.monotonic()
    kernel.run("%rpc_shutdown")
    print(f"shutdown: {time.monotonic() - t0:.2f} s")
    for host in hosts.names:
        assert hosts.processes(host) == [], host
        assert hosts.ssh(host, "ls -A /dev/shm").split() == [], host
        assert hosts.ssh(host, "ls -A ~/.nbrpc 2>/dev/null || true").split() == [], host
    # again, with a gloo process group across the two hosts and a %%rpc cell on both
    kernel.run('%rpc_init --hosts fakeh1,fakeh2 --ssh-args "$SSH" --process-group gloo --quiet')
    out = kernel.run(
        "%%rpc\n"
        "import socket, torch, torch.distributed as dist\n"
        "x = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(x)\n"
        "(socket.gethostname(), x.item())"
    )
    assert "('fakeh1', 3.0)" in out, out
    assert "('fakeh2', 3.0)" in out, out


@needs_hosts
def test_a_cluster_on_hosts_grows_round_robin_or_where_named_and_shrinks(hosts, kernel):
    """%rpc_scale over ssh: the cluster of fakeh1 and fakeh2 (with its gloo group) gets a
    worker on the host with the fewest (list order first), then one where named; then
    both leave and their engines are gone from the hosts."""
    reduce = (
        "%%rpc\nimport torch, torch.distributed as dist\n"
        "x = torch.ones(1)\ndist.all_reduce(x)\nprint('world', x.item())"
    )
    kept = kernel.value("{n: nbrpc.rpc_sync(n, os.getpid) for n in ('worker1', 'worker2')}")
    t0 = time.monotonic()
    out = kernel.run("%rpc_scale 3")
    print(f"grow by one over ssh: {time.monotonic() - t0:.2f} s")
    assert "worker3 (nbrpc.rank() 3" in out, out
    out = kernel.run("%rpc_scale 4 --hosts fakeh2")
    assert "worker4 (nbrpc.rank() 4" in out, out
    where = kernel.value("{n: nbrpc.rpc_sync(n, socket.gethostname) for n in nbrpc.workers()[1:]}")
    assert where == {
        "worker1": "fakeh1",
        "worker2": "fakeh2",
        "worker3": "fakeh1",
        "worker4": "fakeh2",
    }
    assert kernel.run(reduce).count("world 4.0") == 4
    nested = "nbrpc.rpc_sync('worker4', nbrpc.rpc_sync, args=('worker3', abs, (-3,)))"
    assert kernel.value(nested) == 3  # the new workers reach each other across hosts
    engines = {h: sum("nbrpc._engine" in p for p in hosts.processes(h)) for h in hosts.names}
    assert engines == {"fakeh1": 2, "fakeh2": 2}, engines

    out = kernel.run("%rpc_scale 2")
    assert "worker3, worker4 left the cluster" in out, out
    assert kernel.run(reduce).count("world 2.0") == 2
    assert kernel.value("{n: nbrpc.rpc_sync(n, os.getpid) for n in ('worker1', 'worker2')}") == kept
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        engines = {h: sum("nbrpc._engine" in p for p in hosts.processes(h)) for h in hosts.names}
        if engines == {"fakeh1": 1, "fakeh2": 1}:
            break
        time.sleep(0.2)
    assert engines == {"fakeh1": 1, "fakeh2": 1}, engines


@needs_hosts
def test_engines_exit_when_the_controller_is_gone(hosts, kernel):
    """Failure 4: engines outlived a killed controller by minutes."""
    kernel.run('nbrpc.shutdown()\n%rpc_init --hosts fakeh2 --ssh-args "$SSH" --quiet')
    pids = kernel.value(
        "nbrpc.current().engines.source.controller.pids()"
    )  # with its heart monitor
    assert any("nbrpc._engine" in p for p in hosts.processes("fakeh2"))
    for pid in pids:
        os.kill(pid, 9)
    t0 = time.monotonic()
    while any("nbrpc._engine" in p for p in hosts.processes("fakeh2")):
        assert time.monotonic() - t0 < 20, hosts.processes("fakeh2")
        time.sleep(0.5)
    print(f"engines gone {time.monotonic() - t0:.1f} s after the controller")
    t0 = time.monotonic()
    kernel.run("nbrpc.shutdown()", timeout=60)
    assert time.monotonic() - t0 < 30
    kernel.run('%rpc_init --hosts fakeh1 --ssh-args "$SSH" --quiet')  # the kernel recovers
    assert kernel.value("nbrpc.rpc_sync('worker1', lambda: 7)") == 7
    kernel.run("%rpc_shutdown --release")
    assert hosts.processes("fakeh1") == []


def test_local_address_is_not_a_socket_of_another_host():
    """The probe a preflight opens is this host's: a wrong --listen is refused at once."""
    with pytest.raises(nbrpc.BootError, match=r"cannot listen on 203\.0\.113\.9"):
        _hosts.preflight(_hosts.HostPlan(("h1",)), "python3", "203.0.113.9")
    assert socket.gethostname()
