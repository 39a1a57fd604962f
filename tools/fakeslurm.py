"""A real Slurm on the fake hosts (:mod:`fakehosts`): slurmctld here, one slurmd per host.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (22.05), started by
hand and stopped by :meth:`FakeSlurm.down`: no service, no system file is touched. Every
file lives in one directory of this run: the configuration (``SLURM_CONF`` points the
client commands at it), a munge key made for the run and munged's socket (the daemons
and clients reach it by path, across network namespaces), state, spool and logs.

What made it work as root here:

* ``SlurmctldHost`` names this machine's hostname with the bridge address in
  parentheses: slurmctld binds where its host name says, the nodes reach it on the bridge;
* ``ip netns exec`` mounts a fresh ``/sys``, so each slurmd needs cgroup v1 hierarchies
  mounted again inside its host (a tmpfs on ``/sys/fs/cgroup``, then each hierarchy this
  machine has: ``name=systemd``, ``cpuset``, ``memory``, ``devices``, ``freezer``, ``cpu``
  and ``cpuacct`` here, ``pids``);
* ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: nothing of cgroups
  is asked of the job steps; munged started by hand (``--force`` as root).

Needs root and the packages::

    python tools/fakeslurm.py up 2      # fake hosts and a Slurm on them; prints SLURM_CONF
    python tools/fakeslurm.py down

Tests use :class:`FakeSlurm` (``up()`` then ``down()``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fakehosts

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")
CPUS_PER_NODE = 2


def missing() -> str | None:
    """Why a fake Slurm cannot run here (None: it can)."""
    why = fakehosts.missing()
    if why:
        return why
    for path in DAEMONS:
        if not os.path.exists(path):
            return (
                f"a fake Slurm needs {path} (Debian: slurmctld, slurmd, slurm-client, munge; "
                "make test installs them as root)"
            )
    return None


def cgroup_hierarchies() -> list[tuple[str, str]]:
    """This machine's cgroup v1 hierarchies: (mount point, controllers), as slurmd's
    cgroup plugin looks for them. ``ip netns exec`` mounts a fresh ``/sys`` in a host,
    without them, so each host mounts them again (the same controllers, as here)."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, where, kind, options, *_ = line.split()
            if kind == "cgroup" and where.startswith("/sys/fs/cgroup/"):
                kept = [o for o in options.split(",") if o not in ("rw", "ro", "relatime")]
                kept = [o for o in kept if not o.startswith(("nosuid", "nodev", "noexec"))]
                found.append((where, ",".join(kept)))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((fakehosts.KERNEL_ADDRESS, 0))
        return s.getsockname()[1]


class FakeSlurm:
    """slurmctld on this machine's bridge address, a slurmd on each fake host."""

    def __init__(self, hosts: fakehosts.FakeHosts) -> None:
        self.hosts = hosts
        self.dir = ""
        self.conf = ""
        self._procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What the client commands need (``SLURM_CONF``)."""
        return {"SLURM_CONF": self.conf}

    def up(self) -> FakeSlurm:
        why = missing()
        if why:
            raise RuntimeError(why)
        t0 = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="nbrpc-fakeslurm-")
        os.chmod(self.dir, 0o755)
        try:
            self._munge()
            self._configure()
            self._start_controller()
            for name in self.hosts.names:
                self._start_node(name)
            self._wait_for_nodes()
        except BaseException:
            self.down()
            raise
        self.seconds = time.monotonic() - t0
        return self

    def _munge(self) -> None:
        d = self.dir
        with open(f"{d}/munge.key", "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(f"{d}/munge.key", 0o400)
        self._procs.append(
            subprocess.Popen(
                [
                    "/usr/sbin/munged",
                    "--foreground",
                    "--force",
                    f"--key-file={d}/munge.key",
                    f"--socket={d}/munge.socket",
                    f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munged.seed",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(f"{d}/munged.err", "wb"),  # noqa: SIM115 closed with the process
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{d}/munge.socket"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start; see {d}/munged.log")
            time.sleep(0.05)

    def _configure(self) -> None:
        d = self.dir
        here = socket.gethostname()
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        nodes = [
            f"NodeName={name} NodeAddr={addr} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for name, addr in zip(self.hosts.names, self.hosts.addresses, strict=True)
        ]
        first = self.hosts.names[0]
        self.conf = f"{d}/slurm.conf"
        with open(self.conf, "w") as f:
            f.write(
                "\n".join(
                    [
                        "ClusterName=nbrpc",
                        f"SlurmctldHost={here}({fakehosts.KERNEL_ADDRESS})",
                        f"SlurmctldPort={self.ctld_port}",
                        f"SlurmdPort={self.slurmd_port}",
                        "SlurmUser=root",
                        "SlurmdUser=root",
                        "AuthType=auth/munge",
                        "CredType=cred/munge",
                        f"AuthInfo=socket={d}/munge.socket",
                        f"StateSaveLocation={d}/state",
                        f"SlurmdSpoolDir={d}/spool-%n",
                        f"SlurmctldPidFile={d}/slurmctld.pid",
                        f"SlurmdPidFile={d}/slurmd-%n.pid",
                        f"SlurmctldLogFile={d}/slurmctld.log",
                        f"SlurmdLogFile={d}/slurmd-%n.log",
                        "ProctrackType=proctrack/linuxproc",
                        "TaskPlugin=task/none",
                        "SelectType=select/cons_tres",
                        "SelectTypeParameters=CR_CPU",
                        "SchedulerType=sched/backfill",
                        "ReturnToService=2",
                        "MpiDefault=none",
                        "JobAcctGatherType=jobacct_gather/none",
                        "AccountingStorageType=accounting_storage/none",
                        "SlurmctldTimeout=30",
                        "SlurmdTimeout=30",
                        "MinJobAge=300",
                        "KillWait=2",
                        *nodes,
                        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                        f"PartitionName=short Nodes={first} MaxTime=5 State=UP",
                        "",
                    ]
                )
            )
        os.makedirs(f"{d}/state", exist_ok=True)

    def _start_controller(self) -> None:
        d = self.dir
        self._procs.append(
            subprocess.Popen(
                ["/usr/sbin/slurmctld", "-D", "-i", "-f", self.conf],
                stdin=subprocess.DEVNULL,
                stdout=open(f"{d}/slurmctld.out", "wb"),  # noqa: SIM115 closed with it
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        )

    def _start_node(self, name: str) -> None:
        d = self.dir
        mounts = " && ".join(
            [
                "mount -t tmpfs cgroup_root /sys/fs/cgroup",
                *(
                    f"mkdir -p {where} && mount -t cgroup -o {options} cgroup {where}"
                    for where, options in cgroup_hierarchies()
                ),
            ]
        )
        script = (
            f"({mounts}) > {d}/mounts-{name}.log 2>&1; "
            f"mkdir -p {d}/spool-{name}; "
            f"SLURM_CONF={self.conf} nohup /usr/sbin/slurmd -D -N {name} -f {self.conf} "
            f"> {d}/slurmd-{name}.out 2>&1 < /dev/null & echo started"
        )
        self.hosts.ssh(name, script)

    def _wait_for_nodes(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.hosts.names) and all(
                s.rstrip("*") in ("idle", "mix", "alloc") for s in states.values()
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm nodes not idle after {timeout:.0f} s: {states}; see {self.dir}"
                )
            time.sleep(0.2)

    # -- use ---------------------------------------------------------------------------

    def run(
        self, *argv: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        """A Slurm client command against this Slurm."""
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env={**os.environ, **self.env},
        )

    def root_pids(self) -> list[int]:
        """The processes this object started on this machine (munged, slurmctld); the
        slurmds run on the fake hosts, under their roots."""
        return [p.pid for p in self._procs]

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still lists (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return out.split()

    # -- down --------------------------------------------------------------------------

    def down(self) -> None:
        if self.dir and self.conf and os.path.exists(self.conf):
            with contextlib.suppress(Exception):
                self.run("scancel", "--user=root", check=False, timeout=10)
        for name in self.hosts.names:
            with contextlib.suppress(Exception):
                self.hosts.ssh(name, "pkill -9 -x slurmd; pkill -9 -f slurmstepd; true", timeout=10)
        for p in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait()
        self._procs.clear()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> FakeSlurm:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def main() -> int:
    if sys.argv[1:2] == ["up"]:
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
        hosts = fakehosts.FakeHosts(n).up()
        slurm = FakeSlurm(hosts).up()
        nodes = ", ".join(hosts.names)
        print(f"export SLURM_CONF={slurm.conf}  # nodes {nodes} up in {slurm.seconds:.1f} s")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
