"""Lanes on and off: the kernel's socket directory, each process's listener, the close.

The kernel makes the directory (mode 0700) once per local cluster and opens its own
listener; every worker opens one in it under its own name (:func:`set_up`); a restart's
new workers join the same directory. :func:`close` ends them all in a process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket

from nbrpc import _process
from nbrpc._wire import same_user, shm_setup, side_door

from .callee import listen, run
from .pool import Pool
from .state import here, shut, socket_path


def make_directory(prefix: str) -> str | None:
    """The kernel's directory for the cluster's sockets (mode 0700), or None if none can
    be made (lanes stay off)."""
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"{prefix}-lanes")
    try:
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, 0o700)
    except OSError:
        return None
    if len(socket_path(path, "x" * 40)) > 100:  # sun_path holds 108 bytes
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path


def open_here(directory: str, threads: int, made: bool = False) -> bool:
    """Listen for lanes in ``directory`` under this process's name; False if it cannot
    (then calls to it go through TensorPipe)."""
    close()
    path = socket_path(directory, _process.name())
    if len(path) > 100 or not os.path.isdir(directory):
        return False
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)  # a restarted worker's predecessor's
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(64)
    except OSError:
        listener.close()
        return False
    here.directory, here.listener = directory, listener
    side_door.open_here(directory, _process.name())  # questions a busy process answers
    here.made_directory = made
    here.pool = Pool(threads, run)  # runs pooled calls: torch's num_worker_threads
    listen(listener)
    return True


def set_up(prefix: str, workers: list[str], threads: int) -> bool:
    """On the kernel, for a local cluster: lanes between every process of the group
    (``workers``: those that joined now; the kernel's lanes are opened once per cluster,
    and a restart's new workers join them). Returns whether the kernel's are open."""
    directory = here.directory
    if directory is None:
        directory = make_directory(prefix)
        if directory is None or not open_here(directory, threads, made=True):
            return False
    shm_setup.on_each(workers, open_here, directory, threads)  # one that cannot: TensorPipe
    return True


def directory() -> str | None:
    """Where this process's lanes are (None: off)."""
    return here.directory


def pause(paused: bool) -> None:
    """Send this process's calls through TensorPipe (``True``) or on lanes again; its
    lanes stay open (a benchmark compares the two routes in the same processes)."""
    here.paused = paused


def close() -> None:
    """Lanes off in this process: the listener, every lane and connection closed (a
    caller waiting on one gets :class:`~.state.LaneLost`), the socket file removed."""
    listener, directory = here.listener, here.directory
    here.directory = here.listener = None
    side_door.close()
    here.paused = False
    if listener is not None:
        same_user.stop_listening(listener)
        shut(listener)
        if directory is not None:
            with contextlib.suppress(OSError):
                os.unlink(socket_path(directory, _process.name()))
    with here.lock:
        lanes = [*here.main.values(), *here.shared.values()]
        served = list(here.served)
        here.main.clear()
        here.shared.clear()
        here.served.clear()
        here.laneless.clear()
        here.held.clear()
        here.on_device.clear()
    for lane in lanes:
        lane.close()
    for conn in served:
        shut(conn)
    if here.pool is not None:
        here.pool.stop()
        here.pool = None
    if here.made_directory and directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        here.made_directory = False
