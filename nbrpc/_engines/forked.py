"""Engines forked from the zygote, the kernel's side: the process, and the launcher that
forks from it.

:class:`Zygote` starts ``python -m nbrpc._engines.zygote`` (:mod:`.zygote`, that process's
own side) and asks it for each engine with one JSON line; :class:`ForkedEngineSetLauncher`
is ipyparallel's local engine launcher with such a fork in place of a new process.
:class:`.local.LocalController` runs both; what it keeps between clusters (the controller,
its spares, the warm-up at ``%load_ext``) is :mod:`.local`'s. The two variables a forked
engine reads from its environment (:data:`MARKS_ENV`, :data:`KERNEL_ENV`) are declared
here, once for both sides.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Any as AnyTrait

from nbrpc._errors import BootError

from .controller import tail

#: Set for every engine: a folder where it leaves a mark once it is running, so that an
#: engine that exits without one failed to start (rather than died later).
MARKS_ENV = "NBRPC_ENGINE_MARKS"
#: Set for every engine: the kernel's pid; the engine exits when that process is gone.
KERNEL_ENV = "NBRPC_KERNEL_PID"
ZYGOTE_TIMEOUT_S = 120.0  # its imports; minutes only on a machine far slower than this one


class Zygote:
    """The process every engine is forked from (see :mod:`.zygote`)."""

    def __init__(self, python: str, workdir: str) -> None:
        self.python = python
        self.log = os.path.join(workdir, "zygote.log")
        with open(self.log, "wb") as errors:
            try:
                self.proc = subprocess.Popen(
                    [python, "-m", "nbrpc._engines.zygote"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    bufsize=0,
                    start_new_session=True,  # not hit by the signals sent to the kernel
                )
            except OSError as exc:
                raise BootError(
                    f"could not start engines with {python!r}: {exc}. Give a Python that "
                    "has torch and nbrpc installed (python=... / --python; default: the "
                    "kernel's)."
                ) from exc
        self._lock = threading.Lock()
        self._started = time.monotonic()
        #: seconds from start to its first engine: its imports (torch's, mostly)
        self.ready_seconds: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int:
        """Ask for one engine; returns its pid (waits for the zygote's imports once)."""
        request = {"argv": argv, "env": env, "cwd": cwd, "output": output}
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None, "the zygote's stdin is a pipe"
        assert stdout is not None, "the zygote's stdout is a pipe"
        with self._lock:
            try:
                stdin.write((json.dumps(request) + "\n").encode())
                poller = select.poll()  # select() refuses descriptors past 1024
                poller.register(stdout, select.POLLIN)
                ready = poller.poll(ZYGOTE_TIMEOUT_S * 1000)
                line = stdout.readline() if ready else b""
            except (BrokenPipeError, ValueError):
                line = b""
        if not line:
            with open(self.log, errors="replace") as f:
                output = tail(f.read())
            raise BootError(
                f"engines could not start: {self.python} -m nbrpc._engines.zygote "
                + ("exited" if self.proc.poll() is not None else "did not answer")
                + f". Its output:\n{output}\nUse a Python that has torch and nbrpc "
                "installed (python=... / --python; default: the kernel's)."
            )
        if self.ready_seconds is None:
            self.ready_seconds = time.monotonic() - self._started
        answer = json.loads(line)
        for said in answer.get("said", ()):  # a module it could not preload (.zygote)
            print(said, file=sys.stderr)
        return int(answer["pid"])

    def close(self) -> None:
        """Stop it now: it holds no state, and its engines are stopped separately."""
        with contextlib.suppress(OSError, AttributeError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError, AttributeError):
            self.proc.stdout.close()  # type: ignore[union-attr]


class ForkedEngineLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher, with a fork of the zygote for a new process.

    Everything else is ipyparallel's: the engine's arguments, environment, log file, and
    how it is watched (by pid) and stopped (signals).
    """

    def start(self) -> None:
        zygote: Zygote = self.parent.zygote
        env = os.environ.copy()
        env.update(self.get_env())
        argv = self.cluster_args + self.engine_args
        self.pid = zygote.fork(argv, env, os.path.abspath(self.work_dir), self.output_file)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """A set of :class:`ForkedEngineLauncher` engines, all forked from ``zygote``."""

    launcher_class = ForkedEngineLauncher
    zygote = AnyTrait()
