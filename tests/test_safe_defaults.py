"""Safe by default: a local cluster listens on loopback only; the stop button works."""

import contextlib
import ipaddress
import os
import subprocess
import sys

import psutil

import nbrpc
from nbrpc._engines import local


def _listening(pid: int) -> list[tuple[str, int]]:
    proc = psutil.Process(pid)
    found = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def test_local_cluster_listens_on_loopback_only(cluster):
    pids = [r.pid for r in cluster.workers]  # the kernel (this process) and every worker
    pids.append(local.kept().controller_pid)
    sockets = {pid: _listening(pid) for pid in pids}
    assert any(sockets.values()), "found no listening socket at all: the check is blind"
    for pid, addrs in sockets.items():
        for ip, port in addrs:
            assert ipaddress.ip_address(ip).is_loopback, (
                f"pid {pid} listens on {ip}:{port}, not on loopback"
            )


def test_workers_list_only_the_group(cluster):
    assert set(nbrpc.workers()) == {r.name for r in cluster.workers}


INTERRUPT = """
import os, signal, threading, time, nbrpc
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job inherits it ignored
nbrpc.init(n=1, progress=False)
ns = {"__name__": "__main__"}
exec("import time\\ndef slow(s):\\n    time.sleep(s)\\n    return s\\n", ns)
pressed = []
def press():
    pressed.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)
for how in ("rpc_sync", "rpc_async().wait()"):
    threading.Timer(1.0, press).start()
    try:
        if how == "rpc_sync":
            nbrpc.rpc_sync("worker1", ns["slow"], args=(20,))
        else:
            nbrpc.rpc_async("worker1", ns["slow"], args=(20,)).wait()
        print(how, "not interrupted")
    except KeyboardInterrupt:
        print(how, f"interrupted after {time.monotonic() - pressed[-1]:.1f} s (from the press)")
print("still usable:", nbrpc.rpc_sync("worker1", ns["slow"], args=(0,)))
nbrpc.shutdown(graceful=False)
"""


def test_keyboard_interrupt_returns_control_promptly():
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPT], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for how in ("rpc_sync", "rpc_async().wait()"):
        line = next(x for x in out.stdout.splitlines() if x.startswith(how + " "))
        # (an interrupt raised inside a finalizer is "ignored": stderr says where)
        assert "interrupted after" in line, (line, out.stderr[-3000:])
        assert float(line.split("after ")[1].split()[0]) < 3.0, line
    assert "still usable: 0" in out.stdout


def test_no_process_spins_a_shared_memory_reactor(cluster):
    """TensorPipe's "shm" reactor polls a core per process, idle or not (see architecture)."""
    for record in cluster.records:
        names = []
        for tid in os.listdir(f"/proc/{record.pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{record.pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        assert "TP_SHM_reactor" not in names, f"{record.name} runs TensorPipe's shm reactor"
        assert names, record


def test_each_worker_listens_on_two_ports_not_eighteen(cluster):
    """Fewer doors: torch's default channels include "mpt_uv", which listens on 16 lanes of
    its own (a worker listened on 18 ports); nbrpc asks for "cma" and "basic", which need
    none. Left: ipyparallel's engine port and TensorPipe's listener."""
    for record in cluster.workers[1:]:
        ports = [
            c.laddr.port
            for c in psutil.Process(record.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert len(ports) <= 2, f"{record.name} listens on {len(ports)} ports: {ports}"
