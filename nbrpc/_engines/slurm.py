"""Engines from Slurm (``--slurm``): one job of N engine tasks, or a step of the kernel's job.

ipyparallel launches, watches and stops them: outside an allocation with its
``SlurmEngineSetLauncher`` (an ``sbatch`` script whose ``srun`` starts one engine per
task), inside one (``SLURM_JOB_ID`` set: a notebook server started by sbatch, Open
OnDemand) with its ``MPIEngineSetLauncher`` running ``srun`` as a step of that job. The
controller is the kernel's, on ``--listen`` (default: this host's address on the route to
Slurm's controller); engines read its connection file from the ipyparallel profile
directory, which the nodes must share with this host, as ipyparallel's Slurm launchers
assume (docs/slurm.md).

What nbrpc adds around them:

* before anything starts, ``sbatch --test-only`` with the job's options: an unknown
  partition, a bad time, more nodes than the partition has are a ``ConfigError`` naming
  Slurm's answer;
* while the job waits, its state and Slurm's reason (``squeue``) in the boot's progress,
  kept current; ``--queue-timeout`` (or the stop button) cancels it and fails the boot
  naming the reason;
* workers named in task order (``SLURM_PROCID``), each row naming its node;
* the job (or step) cancelled at shutdown, and by the watchdog if the kernel dies;
* a worker lost because the job ended (``scancel``, its time limit) says so: Slurm's
  state and reason are its last words.

Each question to Slurm (``sbatch --test-only``, ``squeue``, ``scontrol``, ``scancel``) is
one function of :mod:`.slurm_commands`, which runs the command and reads its answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher

from nbrpc import _fence, _options, _process
from nbrpc._errors import BootError, ConfigError, counted
from nbrpc._source_options import Slurm
from nbrpc._wire import stack_dumps

from . import worker
from .controller import ENGINE_ARGS, Controller, ControllerSource, tail
from .slurm_commands import (
    ENDED,
    HOPELESS,
    SLURM_TIMEOUT_S,
    check,
    controller_address,
    ended_state,
    in_allocation,
    job_state,
    node_addresses,
    run_command,
    watchdog_cancel,
)

log = logging.getLogger("nbrpc")

QUEUE_POLL_S = 0.5
#: once the job runs, its engines have this long to register
START_AFTER_RUNNING_S = 90.0
#: seconds lost() waits for a job that is COMPLETING to say how it ended
ENDING_WAIT_S = 5.0


class _Step(MPIEngineSetLauncher):
    """ipyparallel's launcher of ``mpiexec -n N engine``, with ``srun`` as the mpiexec: a
    step of the job the kernel runs in. Its engines are not an MPI world (no ``--mpi``:
    ipyparallel would ask mpi4py for their ids); they are ordered by ``SLURM_PROCID``."""

    @property
    def program(self) -> list[str]:
        return list(self.engine_cmd)


class _Job(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher, writing its script to nbrpc's directory."""


class SlurmController(Controller):
    """A controller on ``listen`` and one Slurm job (or step) of engines."""

    def __init__(self, listen: str, plan: Slurm, python: str) -> None:
        self.listen = listen
        self.plan = plan
        self.python = python
        self.workdir = tempfile.mkdtemp(prefix="nbrpc-slurm-")
        self.job = in_allocation()
        self.step = self.job is not None  # a step of the kernel's own job
        super().__init__(listen, self.workdir, _Step if self.step else _Job)
        self._launcher: Any = None
        self._task_of: dict[int, tuple[int, str]] = {}  # engine id -> (task, node)
        #: every job (or step) of engines, the first one's first: [job, launcher, its ids]
        #: (a scale adds more; a job whose engines all left is cancelled)
        self._batches: list[list[Any]] = []
        self._retired: set[int] = set()  # engine ids a shrink stopped
        self._ended = ""  # how the job ended, once Slurm says it for good (lost())
        self._start_controller()

    # -- engines ---------------------------------------------------------------------

    def spawn(self, n: int) -> None:
        if self.step:  # the allocation's nodes are known: let them in first
            self.admit(node_addresses(self.job or ""))
        engine = [self.python, "-m", "nbrpc._engines.zygote", "--engine"]
        options = self.plan.sbatch_options(n)
        try:
            if self.step:  # the job's partition and time are the job's own
                shape = [o for o in options[1:] if o.startswith(("--nodes=", "--gpus-per-node="))]
                set_id = self._ipp.start_engines_sync(
                    n,
                    mpi_cmd=["srun"],
                    mpi_args=[
                        f"--jobid={self.job}",
                        "--overlap",
                        "--kill-on-bad-exit=0",
                        *shape,
                        *self.plan.args,
                    ],
                    engine_cmd=engine,
                    engine_args=list(ENGINE_ARGS),
                )
            else:
                script = "\n".join(
                    [
                        "#!/bin/sh",
                        "#SBATCH --job-name=nbrpc-{cluster_id}",
                        "#SBATCH --output={output_file}",
                        "#SBATCH --export=ALL",
                        *(f"#SBATCH {_braces(o)}" for o in options),
                        "srun --kill-on-bad-exit=0 {program_and_args}",
                        "",
                    ]
                )
                set_id = self._ipp.start_engines_sync(
                    n,
                    batch_template=script,
                    batch_file_name=os.path.join(self.workdir, "engines.sbatch"),
                    engine_cmd=engine,
                    engine_args=list(ENGINE_ARGS),
                )
        except BootError:
            raise
        except Exception as exc:
            raise BootError(f"could not start engines with Slurm: {exc}") from exc
        self._launcher = self._ipp.engines[set_id]
        if self.step:
            self._watch()  # srun is a process of this host: the watchdog stops it too
        else:
            self.job = str(self._launcher.job_id)
        self._batches.append([self.job, self._launcher, set()])
        if not self.step:
            jobs = [str(job) for job, _, _ in self._batches]
            watchdog_cancel(self.pidfile, ["scancel", *jobs])

    def pids(self) -> list[int]:
        """The controller's processes, and ``srun`` when the engines are a step."""
        if not self.step:
            return super().pids()
        sruns = [getattr(launcher, "pid", None) for _, launcher, _ in self._batches]
        return super().pids() + [p for p in sruns if p]

    def take(self, n: int, timeout: float, registered: Callable[..., None]) -> list[int]:
        """Engine ids in task order, once every engine registered; the job's wait in the
        queue is reported with ``registered(0, note)`` and bounded by the job's own
        ``queue_timeout``, its engines' registration by :data:`START_AFTER_RUNNING_S` from
        the job's start (``timeout`` is not Slurm's to use: a queue has no bound)."""
        queue_timeout = self.plan.queue_timeout
        client = self.client()
        t0 = time.monotonic()
        running_since: float | None = None
        polled = 0.0
        known = set(self._task_of) | self._retired  # engines of earlier jobs (a scale)
        while True:
            ids = sorted(i for i in client.ids if i not in known)
            if len(ids) >= n:
                break
            if time.monotonic() - polled >= QUEUE_POLL_S and not self.step:
                polled = time.monotonic()
                state, reason = job_state(self.job or "")
                waited = time.monotonic() - t0
                if state == "PENDING":
                    why = f" ({reason})" if reason and reason != "None" else ""
                    registered(len(ids), f"Slurm job {self.job}: PENDING{why}")
                    if reason.split(",")[0] in HOPELESS:
                        self.cancel()
                        asked = shlex.join(self.plan.sbatch_options(n))
                        raise BootError(
                            f"Slurm will not start job {self.job} ({asked}): it is pending "
                            f"for {reason}, which waiting does not change. The job was "
                            "cancelled; `sinfo` lists the partitions and their limits."
                        )
                    if queue_timeout is not None and waited > queue_timeout:
                        self.cancel()
                        raise BootError(
                            f"Slurm job {self.job} waited {waited:.0f} s in the queue "
                            f"(Slurm's reason: {reason}) and was cancelled (--queue-timeout "
                            f"{queue_timeout:g}). `squeue` and `sinfo` show what the "
                            "partition is busy with."
                        )
                elif state in ("", *ENDED):
                    how = ended_state(self.job or "") if not state else f"{state} ({reason})"
                    if not how:  # squeue did not answer this time: ask again
                        continue
                    raise BootError(
                        f"Slurm job {self.job} ended before its engines registered: {how}. "
                        f"Its output ({self._output_file()}):\n{tail(self.job_output())}"
                    )
                else:
                    if running_since is None:  # its nodes are known now: let them in
                        running_since = time.monotonic()
                        self.admit(node_addresses(self.job or ""))
                    registered(len(ids), f"Slurm job {self.job}: {state}")
            elif self.step:
                running_since = running_since or t0
                if self._launcher is not None and self._launcher.state == "after":
                    raise BootError(
                        f"srun (a step of job {self.job}) ended before the engines "
                        f"registered. Its output:\n{tail(self._launcher.get_output())}"
                    )
                registered(len(ids))
            if (
                running_since is not None
                and time.monotonic() - running_since > START_AFTER_RUNNING_S
            ):
                raise BootError(
                    f"only {len(ids)} of {counted(n, 'engine')} of Slurm job {self.job} "
                    "registered with "
                    f"the controller at {self.listen} within {START_AFTER_RUNNING_S:.0f} s of "
                    "the job's start. The nodes connect back to this host: check that they "
                    f"reach {self.listen}, and the job's output: {self._output_file()}"
                )
            time.sleep(0.05)
        tasks = client[ids].apply_async(worker.slurm_task).get(timeout=30)
        order = sorted(zip(tasks, ids, strict=True))
        taken = [eid for _, eid in order[:n]]
        self._task_of.update({eid: task for task, eid in order})
        self._batches[-1][2].update(taken)
        return taken

    def grow(self, n: int, timeout: float, registered: Callable[..., None]) -> list[int]:
        """``n`` engines of a further job (or a further step of the kernel's allocation),
        waited for as at the start; a job that fails to bring them is cancelled."""
        first = self.job, self._launcher
        self.spawn(n)
        batch = self._batches[-1]
        try:
            return self.take(n, timeout, registered)
        except BaseException:
            self._cancel_batch(batch)
            raise
        finally:
            self.job, self._launcher = first

    def shrink(self, engine_ids: list[int]) -> None:
        """Stop engines whose workers left; a job (or step) none of whose engines is left
        is cancelled."""
        self.ask_to_exit(engine_ids)
        self._retired.update(engine_ids)
        for batch in list(self._batches):
            if batch[2] and batch[2] <= self._retired:
                self._cancel_batch(batch)
        if self._batches and self._launcher is not self._batches[0][1]:
            self.job, self._launcher = self._batches[0][0], self._batches[0][1]

    def job_of(self, engine_id: int) -> str:
        """The job (or, for a step, the allocation's job) engine ``engine_id`` runs in."""
        return next((str(j) for j, _, ids in self._batches if engine_id in ids), self.job or "")

    def admit(self, addresses: list[str]) -> None:
        """Let the job's nodes through the member filter of the kernel and its controller
        (when the cluster listens beyond loopback), before their engines register: they
        are known only once Slurm allocated them."""
        members = _fence.members()
        if members is None or not addresses:
            return
        _fence.admit(members | set(addresses))
        for pid in self.controller_pids():
            with contextlib.suppress(OSError):
                _fence.fence_process(pid)

    def node_of(self, engine_id: int) -> str:
        return self._task_of.get(engine_id, (0, ""))[1]

    def _output_file(self) -> str:
        out = getattr(self._launcher, "output_file", "")
        return out.replace("%j", self.job or "") if out else "(none)"

    def job_output(self) -> str:
        with contextlib.suppress(OSError):
            return pathlib.Path(self._output_file()).read_text(errors="replace")
        return ""

    def lost(self) -> str:
        """Why the engines are gone, when the job (or step) ended: Slurm's state, the final
        one. A job that ends is ``COMPLETING`` while its nodes let go of it (about a
        second): that is waited out, up to :data:`ENDING_WAIT_S`, once; the answer is kept."""
        if self.step or not self.job:
            return ""
        if self._ended:
            return self._ended
        state, reason = job_state(self.job)
        deadline = time.monotonic() + ENDING_WAIT_S
        while state == "COMPLETING" and time.monotonic() < deadline:
            time.sleep(0.2)
            state, reason = job_state(self.job)
        if state in ("RUNNING", "PENDING", "CONFIGURING"):
            return ""
        how = f"{state} ({reason})" if state else ended_state(self.job)
        said = f"Slurm job {self.job} ended: {how}"
        if state != "COMPLETING":
            self._ended = said
        return said

    def dump_stacks(self, engine_ids: list[int], pids: list[int], timeout: float) -> dict:
        """Run :mod:`nbrpc._wire.stacks` on each node, as a step of the job (``srun
        --overlap``): no ssh into the nodes needed. Its parts by engine id."""

        def run(where: str, argv: list[str]) -> str:
            job, _, node = where.partition("@")
            step = ["srun", f"--jobid={job}", "--overlap", "-n1", "-N1", f"-w{node}"]
            done = run_command([*step, "--quiet", self.python, *argv], timeout + SLURM_TIMEOUT_S)
            return done.stdout

        on = {eid: f"{self.job_of(eid)}@{self.node_of(eid)}" for eid in engine_ids}
        return stack_dumps.gather(
            {eid: (on[eid], pid) for eid, pid in zip(engine_ids, pids, strict=True)}, run
        )

    # -- stop ------------------------------------------------------------------------

    def cancel(self) -> None:
        """Cancel every job (or step) of engines, and wait until Slurm no longer runs it."""
        for batch in list(self._batches) or [[self.job, self._launcher, set()]]:
            self._cancel_batch(batch)

    def _cancel_batch(self, batch: list[Any]) -> None:
        """Cancel one job (or step) of engines; it is no longer this controller's."""
        if batch in self._batches:
            self._batches.remove(batch)
        job, launcher, _ = batch
        if self.step:
            if launcher is not None and launcher.state == "running":
                with contextlib.suppress(Exception):
                    launcher.signal(15)  # srun passes it to the tasks and ends the step
                    deadline = time.monotonic() + 10
                    while launcher.state == "running" and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if launcher.state == "running":
                        launcher.signal(9)
            return
        if not job:
            return
        with contextlib.suppress(BootError, ConfigError):
            run_command(["scancel", job])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and job_state(job)[0] not in ("", *ENDED):
                time.sleep(0.2)

    def retire(self, engine_ids: list[int], pids: list[int]) -> None:
        """Stop the engines (ask ipyparallel), then cancel the job: nothing of ours stays
        in ``squeue``, no engine on any node (``pids`` are the nodes': Slurm stops them)."""
        self.ask_to_exit(engine_ids)
        self.cancel()

    def release(self) -> None:
        super().release()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _braces(text: str) -> str:
    """``text`` as a literal in ipyparallel's template (which formats ``{...}``)."""
    return text.replace("{", "{{").replace("}", "}}")


class SlurmSource(ControllerSource[SlurmController]):
    """Engines from Slurm (``--slurm``): one job, or a step of the kernel's job (a scale
    adds a further job or step)."""

    cannot_scale = ""

    cannot_replace = (
        "a worker from Slurm cannot be replaced alone: its engine is a task of the job's "
        "step. %rpc_shutdown then %rpc_init --slurm starts a new job."
    )

    @classmethod
    def wants(cls, settings: _options.Settings) -> bool:
        return settings.options_of(Slurm) is not None

    @classmethod
    def resolve(cls, settings: _options.Settings) -> _options.Settings:
        """Slurm checks the job first; ``--listen`` defaults to this host's address on the
        route towards Slurm's controller."""
        plan = settings.options_of(Slurm)
        assert plan is not None, "wants() took it for these settings"
        check(plan, settings.n or 1)
        if settings.listen:
            return settings
        return replace(settings, listen=worker.address_toward(controller_address()))

    def start(self) -> None:
        s, plan = self.settings, self._plan()
        assert s.listen, "resolve() works out --listen"
        with _process.interrupts_deferred():  # kept, so that a stop's cleanup finds it
            self.controller = SlurmController(s.listen, plan, s.remote_python or s.python)

    def _plan(self) -> Slurm:
        plan = self.settings.options_of(Slurm)
        assert plan is not None, "wants() took it for these settings"
        return plan

    def last_output(self, pid: int) -> str:
        return self.controller.lost() if self.controller is not None else ""

    def summary_note(self) -> str:
        ours = self.controller
        if ours is None or not ours.job:
            return ""
        jobs = [str(job) for job, _, _ in ours._batches] or [ours.job]
        nodes = sorted({node for _, node in ours._task_of.values() if node})
        what = (
            f"{'steps' if len(jobs) > 1 else 'a step'} of Slurm job {ours.job} (the kernel's)"
            if ours.step
            else f"Slurm job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)}"
        )
        return f"workers from {what}, on {', '.join(nodes) or 'its nodes'}"

    def grow(
        self, n: int, hosts: tuple[str, ...], timeout: float, registered: Callable[..., None]
    ) -> list[int]:
        """A further job with the same options (or a further step of the allocation)."""
        return self._ours().grow(n, timeout, registered)

    def shrink(self, engine_ids: list[int], pids: list[int]) -> None:
        self._ours().shrink(engine_ids)
