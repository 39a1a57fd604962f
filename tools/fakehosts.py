"""Other hosts on this machine, for tests and for trying ``--hosts`` without a second box.

Each fake host is a network namespace with its own address from the documentation range
198.51.100.0/24, linked by a veth pair into a bridge that holds this machine's address
on that network (198.51.100.1). Nothing routes anywhere else: the namespaces have no
default route. Every process of a host runs under ``unshare --uts --mount --pid``, so it
has its own hostname, a private ``/dev/shm`` and ``/etc/hosts`` (a stock Debian one: the
hostname resolves to 127.0.1.1) and its own PID namespace. The PID namespace matters:
without it TensorPipe sees a peer's pid and picks its cross-process-memory channel, and
no byte would cross the "network". The filesystem is shared, so the same ``.venv`` runs
everywhere, as it would on hosts with one environment.

Each host runs an sshd on its address, key-only, with a key made for this run; the
``ssh_config`` written beside it names the hosts ``fakeh1``, ``fakeh2`` ... and is what
``ssh -F`` (nbrpc's ``ssh_args=["-F", path]``) reads.

Needs root (namespaces, a bridge) and ``/usr/sbin/sshd`` (Debian's openssh-server)::

    python tools/fakehosts.py up 2      # prints the ssh config's path and the addresses
    python tools/fakehosts.py down      # removes every namespace, link and process

Tests use :class:`FakeHosts` directly (``up()`` then ``down()``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SSHD = "/usr/sbin/sshd"
BRIDGE = "nbrpcbr0"
PREFIX = "nbrpc-h"  # namespaces nbrpc-h1 ...; veths nbrpcv1 (here) / eth0 (there)
NET = "198.51.100"
KERNEL_ADDRESS = f"{NET}.1"
STATE = os.path.join(tempfile.gettempdir(), "nbrpc-fakehosts.json")


def address(i: int) -> str:
    return f"{NET}.{10 + i}"


def missing() -> str | None:
    """Why fake hosts cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "fake hosts need root (network namespaces and a bridge)"
    for tool in (SSHD, "/usr/bin/ssh", "/usr/bin/ssh-keygen", "/usr/bin/unshare"):
        if not os.path.exists(tool):
            return f"fake hosts need {tool} (Debian: openssh-server, openssh-client, util-linux)"
    if shutil.which("ip") is None:
        return "fake hosts need the ip command (Debian: iproute2)"
    return None


def _output(argv: list[str], what: str, timeout: float) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what}: {out.returncode} {out.stderr[-2000:]}")
    return out.stdout


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


class FakeHosts:
    """``n`` fake hosts named ``fakeh1`` ... with sshd; the kernel side is 198.51.100.1."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.workdir = ""
        self.ssh_config = ""
        self.names = [f"fakeh{i}" for i in range(1, n + 1)]
        self.addresses = [address(i) for i in range(1, n + 1)]
        self._sshd: list[subprocess.Popen] = []

    # -- up ----------------------------------------------------------------------------

    def up(self) -> FakeHosts:
        why = missing()
        if why:
            raise RuntimeError(why)
        down()  # leftovers of a run that was killed
        t0 = time.monotonic()
        self.workdir = tempfile.mkdtemp(prefix="nbrpc-fakehosts-")
        try:
            self._network()
            self._keys()
            for i in range(1, self.n + 1):
                self._sshd.append(self._start_host(i))
            for i in range(1, self.n + 1):
                self._wait_for_sshd(address(i))
        except BaseException:
            self.down()
            raise
        self.seconds = time.monotonic() - t0
        with open(STATE, "w") as f:
            json.dump({"workdir": self.workdir, "pids": [p.pid for p in self._sshd]}, f)
        return self

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{KERNEL_ADDRESS}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i in range(1, self.n + 1):
            ns, here = f"{PREFIX}{i}", f"nbrpcv{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", here, "master", BRIDGE)
            _run("ip", "link", "set", here, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _keys(self) -> None:
        w = self.workdir
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{w}/client_key")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{w}/host_key")
        shutil.copy(f"{w}/client_key.pub", f"{w}/authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
        hosts = [
            f"Host {name}\n    HostName {addr}\n    User root\n"
            for name, addr in zip(self.names, self.addresses, strict=True)
        ]
        self.ssh_config = f"{w}/ssh_config"
        with open(self.ssh_config, "w") as f:
            f.write("\n".join(hosts))
            f.write(
                f"\nHost {NET}.* fakeh*\n"
                f"    IdentityFile {w}/client_key\n"
                "    IdentitiesOnly yes\n"
                "    StrictHostKeyChecking no\n"
                "    UserKnownHostsFile /dev/null\n"
                "    LogLevel ERROR\n"
            )

    def _start_host(self, i: int) -> subprocess.Popen:
        w, name = self.workdir, self.names[i - 1]
        config = f"{w}/sshd_config_{i}"
        with open(config, "w") as f:
            f.write(
                f"ListenAddress {address(i)}\nPort 22\nHostKey {w}/host_key\n"
                f"AuthorizedKeysFile {w}/authorized_keys\nPidFile none\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
                "Subsystem sftp internal-sftp\nLogLevel ERROR\n"
            )
        hosts = f"{w}/hosts_{i}"
        with open(hosts, "w") as f:  # as Debian writes it: the hostname is a loopback address
            f.write(f"127.0.0.1 localhost\n127.0.1.1 {name}\n")
        script = (
            f"hostname {name} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
            f"mount --bind {hosts} /etc/hosts && exec {SSHD} -D -e -f {config}"
        )
        return subprocess.Popen(
            [
                *("ip", "netns", "exec", f"{PREFIX}{i}"),
                *("unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc"),
                *("--kill-child", "sh", "-c", script),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(f"{w}/sshd_{i}.log", "wb"),  # closed with the process
            start_new_session=True,
        )

    def _wait_for_sshd(self, addr: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection((addr, 22), 0.5):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {addr} did not start; see {self.workdir}")
            time.sleep(0.05)

    # -- use ---------------------------------------------------------------------------

    def root_pids(self) -> list[int]:
        """The processes this object started (each the root of one host's processes)."""
        return [p.pid for p in self._sshd]

    def ssh(self, host: str, command: str, timeout: float = 30) -> str:
        """Run ``command`` on a fake host; returns its stdout (raises on failure)."""
        argv = ["ssh", "-F", self.ssh_config, "-o", "BatchMode=yes", host, command]
        return _output(argv, f"ssh {host} {command!r}", timeout)

    def python(self, host: str, code: str, timeout: float = 60) -> str:
        """Run ``code`` with this interpreter in ``host``'s network (its address, its
        routes), as a process there would; returns its stdout (raises on failure)."""
        netns = f"{PREFIX}{self.names.index(host) + 1}"
        argv = ["ip", "netns", "exec", netns, sys.executable, "-c", code]
        return _output(argv, f"python on {host}", timeout)

    def processes(self, host: str) -> list[str]:
        """Command lines of the processes on ``host`` (its PID namespace), sshd's aside."""
        out = self.ssh(host, "ps -eo args=")
        return [
            line
            for line in out.splitlines()
            if line.strip()
            and "sshd" not in line
            and "ps -eo" not in line
            and not line.startswith(("sh -c", "bash -c", "unshare"))
        ]

    def kill(self, host: str, pattern: str) -> None:
        """``kill -9`` the processes on ``host`` whose command line matches ``pattern``."""
        unmatched_by_itself = f"[{pattern[0]}]{pattern[1:]}"  # the ssh shell's own line
        self.ssh(host, f"pkill -9 -f '{unmatched_by_itself}' || true")

    # -- down --------------------------------------------------------------------------

    def down(self) -> None:
        for p in self._sshd:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # unshare --kill-child ends the host's pids
            p.wait()
        self._sshd.clear()
        down()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> FakeHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def down() -> None:
    """Remove every fake host (namespaces, links, their processes), ours or left over."""
    with contextlib.suppress(OSError, ValueError), open(STATE) as f:
        state = json.load(f)
        for pid in state.get("pids", []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(state.get("workdir", ""), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(STATE)
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for ns in [n for n in listed if n.startswith(PREFIX)]:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run("ip", "netns", "del", ns, check=False)
    for link in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = link.split(":")[1].strip().split("@")[0] if ":" in link else ""
        if name == BRIDGE or name.startswith("nbrpcv"):
            _run("ip", "link", "del", name, check=False)
    # the stack files nbrpc's processes there left in the /tmp they share with this host (a
    # real host sweeps its own at the next nbrpc process; a fake host never comes back)
    stacks = os.path.join(tempfile.gettempdir(), f"nbrpc-{os.getuid()}", "stacks")
    for path in glob.glob(os.path.join(glob.escape(stacks), "fakeh*.*")):
        with contextlib.suppress(OSError):
            os.unlink(path)


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "down":
        down()
        return 0
    if len(sys.argv) >= 2 and sys.argv[1] == "up":
        hosts = FakeHosts(int(sys.argv[2]) if len(sys.argv) > 2 else 2).up()
        hosts._sshd.clear()  # they outlive this command; `down` removes them
        print(
            json.dumps(
                {
                    "ssh_config": hosts.ssh_config,
                    "hosts": hosts.names,
                    "addresses": hosts.addresses,
                    "listen": KERNEL_ADDRESS,
                    "seconds": round(hosts.seconds, 2),
                }
            )
        )
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
