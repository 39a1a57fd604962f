"""Stops a kernel's engines and controller when the kernel dies without stopping them.

A kernel killed by the OS (out of memory, ``kill -9``, a CI timeout) runs no ``atexit``
hook, and ipyparallel's controller and engines (warm spares included) would run on,
holding memory and ports. The controller (:mod:`.controller`) starts this watchdog once,
as ``python .../nbrpc/_engines/watchdog.py KERNEL_PID PIDFILE MARKER CLUSTER_FILE``
before it starts
anything else, in its own session, and rewrites
PIDFILE (one pid a line, replaced atomically) whenever it starts or stops a process. It
runs as a file rather than with ``-m``: ``-m`` would import the ``nbrpc`` package and with
it torch (225 MB and 1.8 s measured, against 11 MB and 0.02 s). So this module imports
nothing but the standard library.

Once a second it checks the kernel. When the kernel is gone it terminates the listed
processes and those whose environment holds MARKER (the controller's ``IPP_CLUSTER_ID``)
(then kills what is left after a grace period) and removes the kernel's leftover
shared-memory segments (:mod:`nbrpc._wire.shm`), its group store's directory and its own,
and ipyparallel's cluster file of the controller (``CLUSTER_FILE``, in the profile's
``security`` directory) with the controller's connection files beside it: one of each was
left by every killed kernel, and JupyterLab's ipyparallel
extension reads them all, 13 ms each, on the server's one thread: 869 such files held
every message between a notebook and its kernel for 11 s, measured).
It also runs the command a source left in ``PIDFILE.on-death`` (``scancel`` of the
cluster's Slurm job). It exits by itself when PIDFILE is removed: the launcher does that
when it releases everything.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
import time

POLL_S = 1.0
#: The name prefix of the private directories controllers keep the pid file in: the
#: watchdog removes the directory with it (a kernel killed left one behind each time).
WORKDIR_PREFIX = "nbrpc-"
GRACE_S = 3.0
#: After the kernel's death, processes with the cluster's marker are looked for again
#: for this long. A process the kernel was starting as it died may still be between fork
#: and exec at the first look, with the kernel's environment and not yet the marker
#: (seen once in a fresh-clone run: a controller outlived a kernel killed mid-boot).
SETTLE_S = 3.0


def process_alive(pid: int) -> bool:
    """A process on this host that exists and is not a zombie.

    Reads ``/proc`` rather than reaping with ``waitpid``: the engines are children of the
    kernel, and reaping them would steal their exit status from ipyparallel.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def reap(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if process_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(process_alive(p) for p in pids):
            time.sleep(0.1)


def sweep_segments(prefix: str) -> int:
    """Remove ``/dev/shm/PREFIX-*``: fast-path segments whose message never arrived, and
    the directory of the cluster's lane sockets (``_wire.lanes``)."""
    removed = 0
    for path in glob.glob(os.path.join("/dev/shm", f"{glob.escape(prefix)}-*")):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


def segment_prefix(kernel_pid: int) -> str:
    """The name prefix of what one kernel's clusters leave in files: the fast path's
    shared-memory segments, and the kernel's group store directory (``_group``)."""
    return f"nbrpc-{kernel_pid}"


def sweep_directories(prefix: str) -> int:
    """Remove ``$TMPDIR/PREFIX-*`` directories: a dead kernel's group store."""
    removed = 0
    pattern = os.path.join(tempfile.gettempdir(), f"{glob.escape(prefix)}-*")
    for path in glob.glob(pattern):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


_held: list[int] = []  # descriptors of the store directories this process holds


def hold_store(directory: str) -> None:
    """Mark ``directory`` (this kernel's group store) in use for this process's lifetime:
    a shared ``flock`` on it, which :func:`sweep_dead_kernels_stores` of any process on
    this host sees, whatever pids it can see (a container sharing ``$TMPDIR``)."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held.append(fd)


def _in_use(directory: str) -> bool:
    import fcntl

    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True  # not a directory of ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def sweep_dead_kernels_stores() -> int:
    """Remove ``$TMPDIR/nbrpc-PID-*`` group store directories of kernels that are gone.

    A kernel keeps its store for its lifetime (torch fixes its group) and removes it at
    exit; one killed after ``nbrpc.shutdown()``, when no watchdog runs, left it behind
    (a few kB each). The next kernel to join removes those: this user's only, where no
    process of this PID namespace has the pid and no process holds the directory
    (:func:`hold_store`). Shared-memory names are left alone: on a host of ``--hosts``
    they carry the pid of a kernel on another host.
    """
    removed = 0
    uid = os.getuid()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "nbrpc-*-*")):
        pid = os.path.basename(path).split("-")[1]
        try:
            if os.lstat(path).st_uid != uid or not (pid.isascii() and pid.isdigit()):
                continue
        except OSError:
            continue
        if process_alive(int(pid)) or _in_use(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not os.path.exists(path)
    return removed


def read_pids(pidfile: str) -> list[int] | None:
    """The pids listed in ``pidfile``; ``None`` when it is gone (nothing left to watch)."""
    try:
        with open(pidfile) as f:
            return [int(line) for line in f.read().split() if line.strip().isdigit()]
    except FileNotFoundError:
        return None
    except OSError:
        return []


def write_pids(pidfile: str, pids: list[int]) -> None:
    """Replace ``pidfile`` atomically, so the watchdog never reads half a list."""
    tmp = f"{pidfile}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{pid}\n" for pid in pids))
    os.replace(tmp, pidfile)


def started_with(marker: str) -> list[int]:
    """Pids of this host's processes whose environment holds the entry ``marker``.

    ipyparallel gives the controller its cluster id as ``IPP_CLUSTER_ID=ID`` in its
    environment (its heart monitor, a fork, inherits it): a kernel killed between that
    start and the launcher's next write of the pidfile still has them found.
    """
    entry = marker.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def remove_cluster_files(cluster_file: str) -> None:
    """Remove ipyparallel's ``cluster-ID.json``, the controller's connection files beside
    it (``ipcontroller-ID-client.json``, ``-engine.json``) and its files in the profile's
    ``log`` folder (the controller's and engines' logs, ``enginesID.json``; one per
    process, never removed, they were 5,000 on one machine): at the death of the kernel
    here, and at a release (:meth:`.controller.Controller.release`), which stops the
    processes itself and so leaves ipyparallel's files as they were."""
    import glob

    name = os.path.basename(cluster_file)
    if not (name.startswith("cluster-") and name.endswith(".json")):
        return
    cluster_id = name[len("cluster-") : -len(".json")]
    security = os.path.dirname(cluster_file)
    logs = os.path.join(os.path.dirname(security), "log")
    for path in (
        cluster_file,
        os.path.join(security, f"ipcontroller-{cluster_id}-client.json"),
        os.path.join(security, f"ipcontroller-{cluster_id}-engine.json"),
        os.path.join(logs, f"engines{cluster_id}.json"),
        *glob.glob(os.path.join(glob.escape(logs), f"ipcontroller-{cluster_id}-*.log")),
        *glob.glob(os.path.join(glob.escape(logs), f"ipengine-{cluster_id}-*.log")),
    ):
        with contextlib.suppress(OSError):
            os.unlink(path)


def run_on_death(pidfile: str) -> None:
    """Run the command left in ``PIDFILE.on-death`` (a Slurm job's ``scancel``), if any."""
    import json
    import subprocess

    path = pidfile + ".on-death"
    try:
        with open(path) as f:
            order = json.load(f)
        subprocess.run(
            order["argv"],
            env={**os.environ, **order.get("env", {})},
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except (OSError, ValueError, KeyError, subprocess.SubprocessError):
        return
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def main(argv: list[str]) -> int:
    kernel, pidfile = int(argv[1]), argv[2]
    marker = argv[3] if len(argv) > 3 else None
    cluster_file = argv[4] if len(argv) > 4 else None
    pids: list[int] = []
    while process_alive(kernel):
        listed = read_pids(pidfile)
        if listed is None:
            return 0
        pids = listed
        time.sleep(POLL_S)
    pids = read_pids(pidfile) or pids
    if marker:
        pids += [p for p in started_with(marker) if p not in pids]
    reap(pids)
    settled = time.monotonic() + SETTLE_S
    while marker and time.monotonic() < settled:  # only marked processes: never a reused pid
        time.sleep(0.2)
        reap(started_with(marker))
    sweep_segments(segment_prefix(kernel))
    sweep_directories(segment_prefix(kernel))
    run_on_death(pidfile)
    with contextlib.suppress(OSError):
        os.unlink(pidfile)
    if cluster_file:
        remove_cluster_files(cluster_file)
    workdir = os.path.dirname(os.path.abspath(pidfile))
    if os.path.basename(workdir).startswith(WORKDIR_PREFIX):  # the controller's own, private
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
