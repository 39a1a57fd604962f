"""Starting an engine on another host: ipyparallel's SSH engine launcher, one ssh session a
step.

ipyparallel's launcher opens about seven ssh sessions per engine, several of them starting
a Python to run one shell step (profile creation, a directory check, a copy, the start);
measured on the fake hosts of the tests: 17.4 s to launch 3 engines on 2 hosts, 11 s to
stop them. :class:`HostEngineLauncher` starts an engine with one ssh session (a shell
script: make the run's directory, write the controller's connection file from stdin,
start the engine in the background), signals it with one ``kill`` and watches it with a
shell loop on its host. Every ssh goes through :func:`run_on`, over the connection per host
that :class:`.ssh.HostController` shares (OpenSSH's ControlMaster); what a cluster of
engines on other hosts does with them is :mod:`.ssh`'s.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shlex
import signal
import subprocess
import time
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

from nbrpc._errors import BootError

SSH_TIMEOUT_S = 30.0
WATCH_POLL_S = 1  # a remote engine's exit is noticed within this (a shell loop on its host)


def run_on(
    launcher: SSHEngineLauncher, script: str, stdin: str = "", timeout: float = SSH_TIMEOUT_S
) -> str:
    """Run a shell ``script`` on the launcher's host; its stdout (raises BootError)."""
    remote = "sh -c " + shlex.quote(script)
    argv = [*launcher.ssh_cmd, *launcher.ssh_args, launcher.location, remote]
    try:
        out = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BootError(f"{launcher.location}: ssh did not answer within {timeout:.0f} s") from None
    if out.returncode != 0:
        raise BootError(
            f"{launcher.location}: ssh failed (exit {out.returncode}): {out.stderr.strip()[-500:]}"
        )
    return out.stdout


def _written(path: str, timeout: float = 10.0) -> bytes:
    """The controller's connection file once it is whole. The controller writes it in
    place (``json.dump`` into the open file): a read as soon as it existed once sent an
    engine an empty file, which it failed to parse (seen in a full run of the suite)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                data = f.read()
            json.loads(data)
            return data
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


class HostEngineLauncher(SSHEngineLauncher):
    """ipyparallel's SSH engine launcher, one ssh session per step (see the module doc)."""

    def start(self, hostname: str | None = None, user: str | None = None, port: Any = None) -> None:
        if hostname is not None:
            self.hostname = hostname
        if user is not None:
            self.user = user
        files = []
        for local, remote in self.to_send:
            data = base64.b64encode(_written(local)).decode()
            files.append(f"echo {data} | base64 -d > {shlex.quote(remote)}")
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in self.get_env().items())
        cmd = shlex.join(self.program + self.program_args)
        out = shlex.quote(self.remote_output_file)
        script = "; ".join(
            [
                "set -e",
                "cd",
                f"mkdir -p {shlex.quote(self.remote_profile_dir)}/security "
                f"{shlex.quote(self.remote_profile_dir)}/log",
                *files,
                f"env {env} nohup {cmd} > {out} 2>&1 < /dev/null & echo __remote_pid=$!__",
            ]
        )
        stdout = run_on(self, script)
        pid = stdout.split("__remote_pid=", 1)[-1].split("__", 1)[0]
        if not pid.isdigit():
            raise BootError(f"{self.location}: the engine did not start: {stdout.strip()[-500:]}")
        self.pid = int(pid)
        self.notify_start({"host": self.location, "pid": self.pid})
        self._start_waiting()

    def signal(self, sig: int) -> None:
        if self.state == "running":
            with contextlib.suppress(BootError):
                run_on(self, f"kill -{int(sig)} {self.pid} 2>/dev/null || true", timeout=10)

    def wait_one(self, timeout: float) -> int:
        """Block up to ``timeout`` s on the engine's exit, in a shell loop on its host."""
        polls = max(1, int(timeout or 60))
        script = (
            f"i=0; while kill -0 {self.pid} 2>/dev/null; do i=$((i+1)); "
            f"if [ $i -ge {polls} ]; then echo running; exit 0; fi; sleep {WATCH_POLL_S}; done; "
            "echo gone"
        )
        try:
            out = run_on(self, script, timeout=polls + SSH_TIMEOUT_S)
        except BootError:
            if self._stop_waiting.is_set():
                return -1
            raise TimeoutError("host unreachable") from None
        if "running" in out:
            raise TimeoutError("still running")
        return -1

    _output: str | None = None

    def get_output(self, remove: bool = False) -> str:
        if self._output is None:
            try:
                self._output = run_on(
                    self, f"cat {shlex.quote(self.remote_output_file)}", timeout=10
                )
            except BootError as exc:
                self._output = f"(could not read the engine's log: {exc})"
        return self._output

    async def stop(self) -> None:
        self.signal(signal.SIGKILL)


class HostEngineSetLauncher(SSHEngineSetLauncher):
    launcher_class = HostEngineLauncher
