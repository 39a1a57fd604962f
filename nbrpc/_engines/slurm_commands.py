"""What the Slurm source asks Slurm, through its client commands: whether it would run
a job (``sbatch --test-only``), a job's state and reason (``squeue``), its nodes, how it
ended and where Slurm's controller is (``scontrol``), and a ``scancel`` left for the
watchdog should the kernel die.

Each is one command and its answer parsed: no state of a cluster, so that
:mod:`.slurm`, which starts, watches and stops a cluster's job, reads as what it does with
the answers. A command missing from ``PATH`` is a ``ConfigError`` that says where Slurm's
client commands come from; one that hangs, a ``BootError`` after
:data:`SLURM_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess

from nbrpc._errors import BootError, ConfigError
from nbrpc._source_options import Slurm

SLURM_TIMEOUT_S = 30.0
#: Slurm's reasons for a pending job that no wait will change (with its default
#: EnforcePartLimits=NO, a job over a partition's limits is queued, not refused)
HOPELESS = (
    "PartitionTimeLimit",
    "PartitionNodeLimit",
    "PartitionConfig",
    "PartitionDown",
    "PartitionInactive",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxWallDurationPerJobLimit",
    "QOSMaxNodePerJobLimit",
    "QOSMaxCpuPerJobLimit",
    "ReqNodeNotAvail",
    "JobHeldAdmin",
)
#: squeue states of a job that will not run (any more)
ENDED = (
    "CANCELLED",
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
)


def run_command(argv: list[str], timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm client command; a missing command is a ConfigError."""
    if shutil.which(argv[0]) is None:
        raise ConfigError(
            f"--slurm needs Slurm's {argv[0]} on PATH (the slurm-client package, or your "
            "site's Slurm module: `module load slurm`), and it is not there"
        )
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BootError(f"{shlex.join(argv)} did not answer within {timeout:.0f} s") from None


def in_allocation() -> str | None:
    """The job the kernel runs in (``SLURM_JOB_ID``), if any."""
    return os.environ.get("SLURM_JOB_ID") or None


def check(plan: Slurm, n: int) -> None:
    """Ask Slurm whether it would run the job (``sbatch --test-only``); a refusal is a
    ConfigError with Slurm's answer. Inside an allocation the step's options are checked
    when it starts."""
    if in_allocation():
        run_command(["srun", "--version"])
        return
    options = plan.sbatch_options(n)
    done = run_command(["sbatch", "--test-only", *options, "--wrap", "true"])
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().replace("sbatch: error: ", "")
        raise ConfigError(
            f"Slurm refuses the job ({shlex.join(options)}): {said}. `sinfo` lists the "
            "partitions, their nodes and time limits."
        )


def controller_address() -> str:
    """The address of Slurm's controller (``scontrol show config``'s SlurmctldHost)."""
    out = run_command(["scontrol", "show", "config"]).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().startswith("SlurmctldHost"):
            value = value.strip()
            return value.split("(", 1)[1].rstrip(")") if "(" in value else value
    raise BootError("scontrol show config names no SlurmctldHost: give --listen ADDR")


def job_state(job: str) -> tuple[str, str]:
    """A job's (state, reason) as squeue says; ("", "") once Slurm no longer lists it."""
    out = run_command(["squeue", "-h", "-j", job, "-o", "%T|%r"]).stdout.strip()
    if "|" not in out:
        return "", ""
    state, reason = out.splitlines()[0].split("|", 1)
    return state, reason


def node_addresses(job: str) -> list[str]:
    """The addresses of the nodes Slurm gave the job (their NodeAddr, resolved)."""
    fields = _fields(run_command(["scontrol", "-o", "show", "job", job]).stdout)
    listed = fields.get("NodeList", "")
    if not listed or listed == "(null)":
        return []
    names = run_command(["scontrol", "show", "hostnames", listed]).stdout.split()
    found = []
    for name in names:
        addr = _fields(run_command(["scontrol", "-o", "show", "node", name]).stdout).get("NodeAddr")
        with contextlib.suppress(OSError):
            found += sorted({str(i[4][0]) for i in socket.getaddrinfo(addr or name, None)})
    return found


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def ended_state(job: str) -> str:
    """How a job that squeue no longer lists ended (``scontrol show job``), if known."""
    fields = _fields(run_command(["scontrol", "-o", "show", "job", job]).stdout)
    state = fields.get("JobState", "")
    reason = fields.get("Reason", "")
    return f"{state} ({reason})" if reason and reason != "None" else state


def watchdog_cancel(pidfile: str, argv: list[str]) -> None:
    """Have the watchdog run ``argv`` (``scancel JOB``) should the kernel die."""
    env = {k: v for k, v in os.environ.items() if k.startswith("SLURM_") or k == "PATH"}
    with open(pidfile + ".on-death", "w") as f:
        json.dump({"argv": argv, "env": env}, f)
