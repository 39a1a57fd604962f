"""A per-test hang watchdog for the test session, in a process of its own.

pytest-timeout's thread method needs the GIL to report a timeout. A deadlock in C++ that
holds the GIL (torch's RPC threads and the kernel's main thread) never gives it back, so
the run would stall until CI's own limit, with no clue. This process needs nothing from
the one it watches: conftest arms it before each test (``arm SECONDS NAME`` on stdin) and
disarms it after (``disarm``). When an armed deadline passes it prints every thread's
Python *and native* stack of the test process (py-spy; gdb for every thread), then kills
that process (the nbrpc watchdog then stops its engines), so the run fails in minutes and
says where.

Usage (conftest does this): ``python tools/hang_watchdog.py PID``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time


def _dump(pid: int, name: str) -> None:
    out = sys.stderr
    out.write(f"\n\n=== HANG: {name} outlived its deadline; stacks of pid {pid} ===\n")
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.exists(py_spy):
        for args in (["--native"], []):
            done = subprocess.run(
                [py_spy, "dump", *args, "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            out.write(done.stdout + done.stderr)
            if done.returncode == 0:
                break
    else:
        out.write("(py-spy is not installed: no stacks)\n")
    _native_threads(pid, out)
    out.flush()


def _native_threads(pid: int, out) -> None:
    """Every thread's native stack (gdb), those py-spy does not list included: torch's RPC
    and TensorPipe threads that never ran Python. A deadlock between the GIL and one of
    torch's mutexes shows only its Python side in py-spy (a fresh run, 2026-11-30: the
    main thread in ``RRefContext::delUser``, waiting on a mutex, the holder unlisted)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        out.write("(gdb is not installed: no stacks of threads that never ran Python)\n")
        return
    try:
        done = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        out.write("(gdb took over 120 s: no native stacks)\n")
        return
    frames = [line for line in done.stdout.splitlines() if line.startswith(("Thread ", "#"))]
    out.write("\n--- every thread, native (gdb) ---\n" + "\n".join(frames) + "\n")


def main(pid: int) -> None:
    """Read the pipe's bytes as they come and act on every whole line among them: a test's
    ``disarm`` and the next test's ``arm`` often arrive in one read, and a buffered
    ``readline`` after ``select`` left the second in Python's buffer, where ``select`` never
    saw it again. The watchdog then stayed disarmed through a real deadlock (a fresh run,
    2026-11-29: a worker held the GIL for 20 minutes, and nothing fired)."""
    deadline: float | None = None
    name = ""
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the test process closed the pipe: the session ended
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                words = line.decode().split(maxsplit=2)
                if words and words[0] == "arm":
                    deadline, name = time.monotonic() + float(words[1]), words[2].strip()
                elif words:
                    deadline = None
            continue
        _dump(pid, name)
        os.kill(pid, signal.SIGKILL)
        return


if __name__ == "__main__":
    main(int(sys.argv[1]))
