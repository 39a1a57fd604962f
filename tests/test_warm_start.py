"""``%load_ext nbrpc`` warms up in the background (the controller, the zygote and
two spare engines), so that the first ``%rpc_init`` only joins them; in real kernels, as a
person types the cells. The speed target is a ratio in ``make bench`` ("first boot after
%load_ext"), not a timed test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from conftest import Kernel, user_environment, wait_for_exit, wait_until

#: how a warm process shows in ``ps``: the controller, the zygote (engines are its forks)
CONTROLLER = "nbrpc/_engines/controller_process.py"  # the controller nbrpc starts
ZYGOTE = "nbrpc._engines.zygote"
LOAD = "%load_ext nbrpc"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _warm(kernel_pid: int) -> dict[str, list[int]]:
    """The kernel's warm processes by kind: the controller and the zygote (the kernel's own
    children), engines (the zygote's forks) and the controller's forks (heart monitor)."""
    kinds: dict[str, list[int]] = {"controller": [], "zygote": [], "engine": [], "forks": []}
    for proc in _descendants(kernel_pid):
        try:
            cmdline = " ".join(proc.cmdline())
            child = proc.ppid() == kernel_pid
        except psutil.Error:
            continue
        if CONTROLLER in cmdline:
            kinds["controller" if child else "forks"].append(proc.pid)
        elif ZYGOTE in cmdline:
            kinds["zygote" if child else "engine"].append(proc.pid)
    return kinds


def _kernel_pid(k: Kernel) -> int:
    return int(k.value("__import__('os').getpid()"))


def _ready(kernel_pid: int, engines: int = 2) -> bool:
    kinds = _warm(kernel_pid)
    return (
        len(kinds["controller"]) == 1
        and len(kinds["zygote"]) == 1
        and (len(kinds["engine"]) >= engines)
    )


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def test_load_ext_warms_up_idles_and_the_first_init_only_joins():
    k = Kernel()
    try:
        k.run(LOAD)  # returns at once: the warm-up runs in a thread
        pid = _kernel_pid(k)
        assert wait_until(lambda: _ready(pid), timeout=90), _warm(pid)
        wait_until(
            lambda: k.value(
                "(lambda l: l.kept() is not None and l.kept().registered_spares() >= 2)"
                "(__import__('nbrpc._engines.local', fromlist=['x']))"
            ),
            timeout=60,
        )
        kinds = _warm(pid)
        warm_pids = [p for pids in kinds.values() for p in pids]

        # idle: no CPU worth the name (heartbeats only). make bench reports the figure;
        # this only catches a busy loop, 10x over docs/benchmarks.md's measurement
        time.sleep(1.0)
        before, t0 = _cpu_seconds(warm_pids), time.monotonic()
        time.sleep(4.0)
        share = (_cpu_seconds(warm_pids) - before) / (time.monotonic() - t0)
        assert share < 0.10, f"warm processes used {share:.1%} of a core while idle"

        k.run("import nbrpc; nbrpc.init(n=2, progress='text')")  # %rpc_init's phases, as text
        assert "controller 0.0 s (warmed up at %load_ext)" in k.stderr, k.stderr
        seconds = k.value("__import__('nbrpc').current().boot_seconds")
        assert seconds["controller"] == 0.0, seconds  # it was there before the cell
        assert seconds["torch import"] == 0.0, seconds
        workers = k.value("[r.pid for r in __import__('nbrpc').current().records[1:]]")
        assert set(workers) <= set(kinds["engine"]), (workers, kinds)  # the warm engines
        assert _warm(pid)["controller"] == kinds["controller"]  # no second controller
        assert k.value("__import__('nbrpc').rpc_sync('worker2', pow, args=(3, 4))") == 81

        k.run("%rpc_shutdown --release")
        left = wait_for_exit(warm_pids, timeout=20)
        assert not left, f"still running after --release: {left}"
    finally:
        k.close()


def test_an_init_in_the_same_cell_waits_for_the_warm_up_and_starts_nothing_twice():
    k = Kernel()
    try:
        out = k.run(f"{LOAD}\n%rpc_init -n 3")
        assert "worker3" in out, out
        pid = _kernel_pid(k)
        kinds = _warm(pid)
        assert len(kinds["controller"]) == 1, kinds
        assert len(kinds["zygote"]) == 1, kinds
        assert k.value("__import__('nbrpc').rpc_sync('worker3', abs, args=(-5,))") == 5
        k.run("import nbrpc; nbrpc.shutdown(release=True)")
    finally:
        k.close()


def test_another_interpreter_does_not_use_the_warm_one():
    """--python names another interpreter (here the same file, spelled another way): the
    warm controller and zygote cannot serve it; the boot releases them, starts its own, and
    its phases say so (no "warmed up")."""
    other = os.path.join(os.path.dirname(sys.executable), "..", "bin", "python")
    k = Kernel()
    try:
        k.run(LOAD)
        pid = _kernel_pid(k)
        assert wait_until(lambda: _ready(pid), timeout=90), _warm(pid)
        warm = _warm(pid)
        k.run(f"import nbrpc; nbrpc.init(n=1, python={other!r}, progress='text')")
        assert "warmed up" not in k.stderr, k.stderr
        assert "controller" in k.stderr, k.stderr
        assert not set(_warm(pid)["controller"]) & set(warm["controller"])
        (zygote,) = _warm(pid)["zygote"]
        assert psutil.Process(zygote).cmdline()[0] == other  # started for the one asked for
        assert k.value("nbrpc.rpc_sync('worker1', abs, args=(-2,))") == 2
        k.run("nbrpc.shutdown(release=True)")
    finally:
        k.close()


def test_a_killed_kernel_leaves_no_warm_process():
    k = Kernel()
    pid = _kernel_pid(k)
    try:
        k.run(LOAD)
        assert wait_until(lambda: _ready(pid), timeout=90), _warm(pid)
        kinds = _warm(pid)
        warm_pids = [p for pids in kinds.values() for p in pids]
    finally:
        os.kill(pid, signal.SIGKILL)  # no atexit: the watchdog stops them
        k.close()
    left = wait_for_exit(warm_pids, timeout=30)
    assert not left, f"outlived their killed kernel: {left}"


def _nothing_starts(k: Kernel, cell: str) -> None:
    k.run(cell)
    pid = _kernel_pid(k)
    time.sleep(3.0)
    kinds = _warm(pid)
    assert not any(kinds.values()), f"{cell!r} started {kinds}"
    assert "rpc_init" in k.run("%lsmagic")  # the magics are there all the same


def test_the_off_switches_start_nothing():
    k = Kernel()
    try:  # the IPython config trait, as in ipython_config.py: c.RpcMagics.prewarm = False
        _nothing_starts(k, f"%config RpcMagics.prewarm = False\n{LOAD}")
    finally:
        k.close()
    env = os.environ.get("NBRPC_PREWARM")
    os.environ["NBRPC_PREWARM"] = "0"  # the kernel inherits it
    try:
        k = Kernel()
    finally:
        if env is None:
            os.environ.pop("NBRPC_PREWARM")
        else:
            os.environ["NBRPC_PREWARM"] = env
    try:
        _nothing_starts(k, LOAD)
        assert "worker1" in k.run("%rpc_init -n 1")  # and the boot starts what it needs
        k.run("import nbrpc; nbrpc.shutdown(release=True)")
    finally:
        k.close()


def test_import_nbrpc_in_a_script_starts_nothing():
    code = (
        "import time, psutil, nbrpc\n"
        "time.sleep(2)\n"
        "print(len(psutil.Process().children(recursive=True)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_environment(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0", out.stdout
