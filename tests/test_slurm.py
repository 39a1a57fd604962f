"""Workers from a real Slurm (``%rpc_init --slurm``): Debian's slurmctld on this machine's
bridge address, a slurmd in each fake host (tools/fakeslurm.py), driven from a real
Jupyter kernel as a notebook user would. Needs root and the Slurm packages (make test
installs them as root); elsewhere every test here skips and says why."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import load_fakehosts, load_fakeslurm, running_kernel

import nbrpc
from nbrpc._options import Settings

fakehosts = load_fakehosts()
fakeslurm = load_fakeslurm()

why_not = fakeslurm.missing()
needs_slurm = pytest.mark.skipif(why_not is not None, reason=f"no fake Slurm: {why_not}")


# -- no Slurm needed ------------------------------------------------------------------------


def test_slurm_options_are_checked_before_anything_runs():
    plan = Settings.make(2, slurm=True, nodes=2, time="10", sbatch_args="--exclusive")
    assert plan.slurm == nbrpc.Slurm(nodes=2, time="10", args=("--exclusive",))
    assert plan.slurm.sbatch_options(2) == ["--ntasks=2", "--nodes=2", "--time=10", "--exclusive"]
    gpus = Settings.make(4, slurm=nbrpc.Slurm(nodes=2, gpus_per_node=2))
    assert gpus.gpus == "auto"  # a GPU per worker by its place on the node, maps for all
    assert "--gpus-per-node=2" in gpus.slurm.sbatch_options(4)
    typed = Settings.make(2, slurm=nbrpc.Slurm(partition="debug", queue_timeout=5))
    assert typed.slurm == nbrpc.Slurm(partition="debug", queue_timeout=5)
    for bad, says in (
        ({"slurm": True, "hosts": "h1,h2"}, "--hosts starts them over ssh"),
        ({"nodes": 2}, "add --slurm"),
        ({"slurm": True, "time": "soon"}, "--time 'soon'"),
        ({"slurm": True, "nodes": 0}, "--nodes must be at least 1"),
        ({"slurm": True, "queue_timeout": -1}, "--queue-timeout"),
        ({"slurm": nbrpc.Slurm(nodes=1), "partition": "x"}, "not both"),
        ({"slurm": True, "listen": "127.0.0.1"}, "cannot reach this host's loopback"),
    ):
        with pytest.raises(nbrpc.ConfigError, match=says):
            Settings.make(2, **bad)


def test_without_sbatch_on_path_the_error_says_what_is_missing(monkeypatch, tmp_path):
    from nbrpc._engines import slurm

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(nbrpc.ConfigError, match="needs Slurm's sbatch on PATH"):
        slurm.check(nbrpc.Slurm(), 2)


# -- against a real Slurm -------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    if why_not:
        pytest.skip(f"no fake Slurm: {why_not}")
    with fakehosts.FakeHosts(2) as hosts, fakeslurm.FakeSlurm(hosts) as fake:
        print(f"fake Slurm up in {fake.seconds:.1f} s")
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = fake.conf
        try:
            yield fake
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved
        assert fake.jobs() == [], "a job of the tests is left in squeue"


SETUP = """%load_ext nbrpc
import os, socket, time
import torch
import nbrpc
"""


@pytest.fixture(scope="module")
def kernel(slurm):
    with running_kernel(SETUP, closing="nbrpc.shutdown(release=True)") as k:
        yield k


@needs_slurm
def test_bad_jobs_are_refused_with_slurm_s_answer_before_anything_runs(slurm, kernel):
    for line, says in (
        ("--slurm -n 2 --partition nosuch", "invalid partition"),
        ("--slurm -n 3 --nodes 3", "node configuration is not available"),  # 2 nodes here
        ("--slurm -n 2 --time soon", "--time 'soon'"),
        ("--slurm -n 2 --hosts fakeh1,fakeh2", "--hosts starts them over ssh"),
    ):
        _, errors = kernel.execute(f"%rpc_init {line} --quiet")
        assert errors, line
        assert "ConfigError" in errors[0], errors
        assert says in errors[0].lower() or says in errors[0], errors
    assert slurm.jobs() == []
    # over the partition's time limit (5 minutes): Slurm queues it, never to run it
    t0 = time.monotonic()
    _, errors = kernel.execute("%rpc_init --slurm -n 1 --partition short --time 60 --quiet")
    assert errors, "the boot did not fail"
    assert "BootError" in errors[0], errors
    assert "Slurm will not start job" in errors[0], errors
    assert "pending for Partition" in errors[0], errors  # Slurm's reason, named
    assert "cancelled" in errors[0], errors
    assert time.monotonic() - t0 < 15
    assert slurm.jobs() == []


@needs_slurm
def test_workers_from_a_slurm_job(slurm, kernel):
    t0 = time.monotonic()
    out = kernel.run("%rpc_init --slurm -n 3 --nodes 2 --process-group gloo")
    print(f"boot from Slurm: {time.monotonic() - t0:.2f} s\n{out}")
    jobs = slurm.jobs()
    assert len(jobs) == 1
    assert f"workers from Slurm job {jobs[0]}, on fakeh1, fakeh2" in out
    # the shared-memory path between the workers of one node, TensorPipe between nodes
    assert "shared memory between processes of one host (worker1, worker2)" in out
    # the member filter admits the kernel's host and the nodes Slurm allocated, no more
    admitted = set(kernel.value("sorted(nbrpc._fence.members())"))
    assert admitted == {fakehosts.KERNEL_ADDRESS, *slurm.hosts.addresses}
    rows = kernel.value("[(r['name'], r['host'], r['state']) for r in nbrpc.status()]")
    assert [r[0] for r in rows] == ["worker0", "worker1", "worker2", "worker3"]
    assert {r[1] for r in rows[1:]} == {"fakeh1", "fakeh2"}
    assert {r[2] for r in rows} == {"ready"}
    # named in task order: SLURM_PROCID 0, 1, 2
    tasks = kernel.value(
        "[nbrpc.rpc_sync(w, lambda: int(os.environ['SLURM_PROCID'])) "
        "for w in ('worker1', 'worker2', 'worker3')]"
    )
    assert tasks == [0, 1, 2]

    # calls, an RRef used on another node, a %%rpc cell, a nested call across nodes
    assert kernel.value("nbrpc.rpc_sync('worker3', lambda x: x * 2, args=(21,))") == 42
    assert kernel.value(
        "nbrpc.rpc_sync('worker1', lambda r: (r.to_here() + 1).tolist(), "
        "args=(nbrpc.remote('worker3', torch.ones, args=((2,),)),))"
    ) == [2.0, 2.0]
    out = kernel.run(
        "%%rpc\nimport os, socket\nprint('on', socket.gethostname(), os.environ['SLURM_PROCID'])"
    )
    assert "[worker1] on" in out
    assert "[worker3] on" in out
    # a gloo process group across the nodes
    out = kernel.run(
        "%%rpc\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(2) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nprint('sum', t.tolist())"
    )
    assert out.count("sum [6.0, 6.0]") == 3, out
    # distributed autograd across the nodes, against the same computation here
    kernel.run(
        "def square(t):\n    return t * t\n"
        "x = torch.tensor([1.0, 2.0], requires_grad=True)\n"
        "with nbrpc.autograd.context() as ctx:\n"
        "    y = nbrpc.rpc_sync('worker3', square, args=(x,)).sum()\n"
        "    nbrpc.autograd.backward(ctx, [y])\n"
        "    g = nbrpc.autograd.get_gradients(ctx)[x]\n"
    )
    assert kernel.value("g.tolist()") == [2.0, 4.0]

    # a worker's breakpoint() on a node opens pdb in the calling cell
    kernel.run("def halve(x):\n    y = x / 2\n    breakpoint()\n    return y\n")
    out = kernel.run("print(nbrpc.rpc_sync('worker3', halve, args=(9,)))", answers=["p y", "c"])
    assert kernel.prompts == ["(Pdb worker3) "] * 2
    assert "\n4.5\n" in out
    assert out.rstrip().endswith("4.5")

    # the stacks of a busy worker, read on its node by a step of the job
    kernel.run(
        "def spin(s):\n    t = time.time()\n    while time.time() - t < s:\n        pass\n"
        "    return s\n"
        "busy = nbrpc.rpc_async('worker2', spin, args=(6.0,)); time.sleep(0.5)"
    )
    stacks = kernel.value(
        "[(r['how'], r['error'], [t['frames'][-1]['function'] for t in r['threads'] "
        "if t['serving']]) for r in nbrpc.stacks('worker2')]"
    )
    assert stacks == [["thread", None, ["spin"]]]
    assert kernel.value("busy.wait()") == 6.0


@needs_slurm
def test_a_killed_worker_is_dead_and_the_others_answer(slurm, kernel):
    node = kernel.value("nbrpc.rpc_sync('worker3', socket.gethostname)")
    pid = kernel.value("nbrpc.rpc_sync('worker3', os.getpid)")
    slurm.hosts.ssh(node, f"kill -9 {pid}")
    out = kernel.run(
        "try:\n    nbrpc.rpc_sync('worker3', os.getpid)\n"
        "except nbrpc.WorkerDiedError as e:\n    print('died:', e)"
    )
    assert "died:" in out
    assert "worker3" in out
    assert kernel.value("nbrpc.rpc_sync('worker1', lambda: 7)") == 7
    _, errors = kernel.execute("%rpc_restart worker3")
    assert errors, "a Slurm worker was restarted alone"
    assert "cannot be replaced alone" in errors[0], errors


@needs_slurm
def test_a_slurm_cluster_grows_by_a_further_job_which_is_cancelled_when_its_workers_leave(
    slurm, kernel
):
    """After the test before, worker3 is dead: --remove drops it (its job keeps worker1
    and worker2), a grow submits a further job, and the job ends once its worker left."""
    (first,) = slurm.jobs()
    out = kernel.run("%rpc_scale --remove worker3")
    assert "worker3 left the cluster" in out, out
    assert slurm.jobs() == [first]  # worker1 and worker2 still run in it
    t0 = time.monotonic()
    out = kernel.run("%rpc_scale 3")
    print(f"grow by a further Slurm job: {time.monotonic() - t0:.2f} s")
    assert "worker3 (nbrpc.rank() 3" in out, out
    jobs = slurm.jobs()
    assert len(jobs) == 2, jobs
    (further,) = [j for j in jobs if j != first]
    assert f"workers from Slurm jobs {first}, {further}" in out, out
    assert kernel.value("nbrpc.rpc_sync('worker3', lambda: os.environ['SLURM_JOB_ID'])") == further
    out = kernel.run(
        "%%rpc\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())"
    )
    assert out.count("sum 3.0") == 3, out
    out = kernel.run("%rpc_scale 2")
    assert "worker3 left the cluster" in out, out
    assert slurm.jobs() == [first]
    assert kernel.value("nbrpc.rpc_sync('worker2', lambda: 7)") == 7


@needs_slurm
def test_shutdown_ends_the_job_and_leaves_no_engine_on_any_node(slurm, kernel):
    """... and a release leaves no file of ipyparallel's behind (a job's cluster file was)."""
    cluster_file = kernel.value("nbrpc.current().engines.source.controller.cluster_file")
    kernel.run("%rpc_shutdown")
    assert slurm.jobs() == []
    for host in slurm.hosts.names:
        assert not [p for p in slurm.hosts.processes(host) if "nbrpc._engines" in p], host
    kernel.run("%rpc_shutdown --release")
    assert not os.path.exists(cluster_file)


@needs_slurm
def test_a_job_cancelled_from_outside_is_reported_with_slurm_s_reason(slurm, kernel):
    kernel.run("%rpc_init --slurm -n 2 --quiet")
    (job,) = slurm.jobs()
    slurm.run("scancel", job)
    out = kernel.run(
        "deadline = time.time() + 30\n"
        "while time.time() < deadline and "
        "{r['state'] for r in nbrpc.status()[1:]} != {'dead'}:\n"
        "    time.sleep(0.5)\n"
        "print('states', sorted({r['state'] for r in nbrpc.status()[1:]}))\n"
        "try:\n    nbrpc.rpc_sync('worker1', os.getpid)\n"
        "except nbrpc.WorkerDiedError as e:\n    print('died:', e)"
    )
    assert "states ['dead']" in out, out
    assert f"Slurm job {job} ended: CANCELLED" in out, out
    kernel.run("%rpc_shutdown")
    out = kernel.run("%rpc_init --slurm -n 1 --quiet\nprint(nbrpc.rpc_sync('worker1', abs, (-4,)))")
    assert out.strip().endswith("4")
    kernel.run("%rpc_shutdown")
    assert slurm.jobs() == []


@needs_slurm
def test_a_queued_job_shows_why_and_is_cancelled_at_its_queue_timeout(slurm, kernel):
    # both nodes taken: the next job waits with Slurm's reason "Resources"
    blocker = slurm.run(
        "sbatch", "--output=/dev/null", "-N2", "--exclusive", "--parsable", "--wrap", "sleep 120"
    )
    blocker_id = blocker.stdout.strip().split(";")[0]
    try:
        t0 = time.monotonic()
        _, errors = kernel.execute(
            "nbrpc.init(n=2, slurm=nbrpc.Slurm(queue_timeout=3), progress='text')"
        )
        took = time.monotonic() - t0
        assert errors, "the boot did not fail"
        assert "BootError" in errors[0], errors
        assert "waited" in errors[0], errors
        assert "(Slurm's reason: Resources)" in errors[0], errors
        assert "PENDING (Resources)" in kernel.stderr, kernel.stderr  # the progress, live
        assert took < 20, took
        assert slurm.jobs() == [blocker_id]  # ours was cancelled, nothing of it stays
        # the stop button ends the wait too, and cancels the job
        ran_on, errors = kernel.stop_after("%rpc_init --slurm -n 2 --quiet", 3.0)
        assert errors, "the stop button did not end the cell"
        assert "KeyboardInterrupt" in errors[0], errors
        assert ran_on < 10, ran_on
        deadline = time.monotonic() + 20
        while slurm.jobs() != [blocker_id] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slurm.jobs() == [blocker_id]
    finally:
        slurm.run("scancel", blocker_id)
        deadline = time.monotonic() + 20
        while slurm.jobs() and time.monotonic() < deadline:
            time.sleep(0.2)


@needs_slurm
def test_inside_an_allocation_the_workers_are_a_step_of_its_job(slurm, kernel):
    alloc = slurm.run(
        "sbatch", "--output=/dev/null", "-N2", "-n2", "--parsable", "--wrap", "sleep 300"
    )
    job = alloc.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 20
        while slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the allocation did not start"
            time.sleep(0.2)
        out = kernel.run(
            f"os.environ['SLURM_JOB_ID'] = '{job}'\n"
            "nbrpc.init(n=2, slurm=True, progress=False)\n"
            "print(nbrpc.current().summary())\n"
            "print('steps of', {nbrpc.rpc_sync(w, lambda: os.environ['SLURM_JOB_ID']) "
            "for w in ('worker1', 'worker2')})"
        )
        assert f"a step of Slurm job {job}" in out, out
        assert f"steps of {{'{job}'}}" in out, out
        assert slurm.jobs() == [job]  # no new job

        def steps() -> list[str]:
            listed = slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()
            return sorted(s for s in listed if not s.endswith(".batch"))

        assert len(steps()) == 1, steps()
        # a grow inside the allocation is a further step of it; a shrink ends that step
        out = kernel.run("print(nbrpc.scale(3))")
        assert "worker3 (nbrpc.rank() 3" in out, out
        assert len(steps()) == 2, steps()
        assert slurm.jobs() == [job]
        assert kernel.value("nbrpc.rpc_sync('worker3', lambda: os.environ['SLURM_JOB_ID'])") == job
        first = steps()[0]
        kernel.run("nbrpc.scale(2)")
        deadline = time.monotonic() + 15
        while steps() != [first] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert steps() == [first]
        kernel.run("nbrpc.shutdown()\ndel os.environ['SLURM_JOB_ID']")
        steps = slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()
        assert [s for s in steps if not s.endswith(".batch")] == [], steps
    finally:
        slurm.run("scancel", job)


@needs_slurm
def test_a_killed_kernel_has_its_job_cancelled_by_the_watchdog(slurm):
    env = {**os.environ}
    script = (
        "import nbrpc, time\n"
        "nbrpc.init(n=1, slurm=True, progress=False)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(slurm.jobs()) == 1
        proc.kill()
        deadline = time.monotonic() + 30
        while slurm.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert slurm.jobs() == []
    finally:
        proc.kill()
        proc.wait()
