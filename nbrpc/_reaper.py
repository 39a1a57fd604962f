"""Stops a cluster's processes when the kernel that started them dies without stopping them.

A kernel killed by the OS (out of memory, ``kill -9``, a CI timeout) runs no ``atexit``
hook, and ipyparallel's controller and engines would run on, holding memory and ports.
The cluster starts this watchdog (``python -m nbrpc._reaper KERNEL_PID PID ...``) in its
own session: once a second it checks the kernel; when the kernel is gone it terminates the
listed processes (then kills what is left after a grace period). It exits by itself when
they are all gone, and the cluster terminates it on a normal shutdown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

POLL_S = 1.0
GRACE_S = 3.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def reap(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    kernel, pids = int(argv[1]), [int(p) for p in argv[2:]]
    while alive(kernel):
        if not any(alive(p) for p in pids):
            return 0
        time.sleep(POLL_S)
    reap(pids)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
