"""Workers on other hosts: ``--hosts``, ssh, the address other hosts reach, and preflight.

A host is ``[user@]address`` as ``ssh`` takes it (an alias of the user's ssh config works
too; the entries' syntax is checked with the other options, :func:`nbrpc._placement.parse_hosts`),
and a host listed N times gets N workers, named in list order. Engines start through
ipyparallel's SSH launcher (:mod:`.ssh_launcher`, for :mod:`.ssh`); this module holds what
comes before:

- **ssh options.** Every ssh nbrpc runs (its own and ipyparallel's) reads the user's ssh
  config and adds ``BatchMode=yes`` (a notebook cannot answer a password prompt: it would
  hang) and a connect timeout, so an unreachable host is an error within seconds. The
  user's ``ssh_args`` come after, and go to ``scp`` too (ipyparallel copies the
  controller's connection file with it), with ``-p PORT`` spelled ``-P PORT`` there.
- **The kernel's address.** Workers connect back to the kernel (its store, its RPC agent,
  the ipyparallel controller), so the kernel listens on one address the hosts reach:
  ``listen`` if given, else the source address of this host's route towards the first
  host (what the kernel's packets to it would carry; no packet is sent to find out).
- **Preflight.** Before any engine starts, each host is asked over ssh, in parallel, for
  its Python and package versions and whether it reaches the kernel's store. Every
  failure is a :class:`~nbrpc.BootError` naming the host and the fix, within the connect
  timeout, instead of a join that times out after 30 s with the cause in an engine log.
"""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

from nbrpc import _fence, _network, _timers
from nbrpc._errors import BootError, ConfigError

CONNECT_TIMEOUT_S = 5
PREFLIGHT_TIMEOUT_S = 30.0  # ssh connect (5 s) plus a Python start that imports torch
#: Packages whose versions must match the kernel's on every host: torch's wire format,
#: cloudpickle's by-value code and nbrpc's own messages all assume one version.
MATCHED = ("torch", "cloudpickle", "ipyparallel", "nbrpc")


def counts(entries: tuple[str, ...]) -> dict[str, int]:
    """Workers per host, in the order hosts first appear."""
    out: dict[str, int] = {}
    for entry in entries:
        out[entry] = out.get(entry, 0) + 1
    return out


def ssh_options(ssh_args: tuple[str, ...] = ()) -> list[str]:
    """What nbrpc adds to every ssh (and scp) it runs, then the user's own arguments."""
    return [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={CONNECT_TIMEOUT_S}",
        *ssh_args,
    ]


def scp_args(ssh_args: tuple[str, ...] = ()) -> list[str]:
    """``ssh_options`` as scp spells them (its port option is ``-P``)."""
    out = ssh_options(ssh_args)
    return ["-P" if a == "-p" else a for a in out]


def ssh_hostname(entry: str, ssh_args: tuple[str, ...] = ()) -> str:
    """The address ssh would connect to for ``entry``, after the user's ssh config."""
    try:
        out = subprocess.run(
            ["ssh", "-G", *ssh_options(ssh_args), entry],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BootError(f"cannot run ssh ({exc}); install the OpenSSH client") from exc
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value.strip()
    return entry.rsplit("@", 1)[-1]


def infer_listen(first: str, ssh_args: tuple[str, ...] = ()) -> str:
    """This host's source address on its route towards ``first`` (no packet is sent)."""
    name = ssh_hostname(first, ssh_args)
    try:
        family, _, _, _, addr = socket.getaddrinfo(name, 22, proto=socket.IPPROTO_TCP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            local = s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"cannot work out which address of this host {first} reaches ({name}: {exc}). "
            "Give it with --listen ADDR (listen=ADDR): an address of this host that every "
            "worker host can connect to."
        ) from exc
    if _network.is_loopback(local):
        raise ConfigError(
            f"{first} resolves to this host's loopback ({name}); workers there could not "
            "tell this host from their own. Give --listen ADDR with an address the hosts "
            "reach, and list hosts by that network's names or addresses."
        )
    return local


_PROBE = r"""
import json, socket, sys
out = {"python": "%d.%d" % sys.version_info[:2], "executable": sys.executable,
       "host": socket.gethostname(), "versions": {}}
from importlib import metadata
for name in NAMES:
    try:
        out["versions"][name] = metadata.version(name)
    except Exception:
        out["versions"][name] = None
try:
    socket.create_connection((ADDR, PORT), TIMEOUT).close()
    out["store"] = "ok"
except OSError as exc:
    out["store"] = "%s" % exc
print("NBRPC-PREFLIGHT " + json.dumps(out))
"""


def addresses(entries: tuple[str, ...], ssh_args: tuple[str, ...] = ()) -> list[str]:
    """The addresses ``entries`` reach, as ssh resolves them (the user's ssh config too):
    the cluster admits them before their engines start (see nbrpc._fence)."""
    found: set[str] = set()
    for entry in counts(entries):
        name = ssh_hostname(entry, ssh_args)
        try:
            found.update(
                str(a[4][0]) for a in socket.getaddrinfo(name, 22, proto=socket.IPPROTO_TCP)
            )
        except OSError:
            continue  # the preflight says why it cannot be reached
    return sorted(found)


@dataclass(frozen=True)
class HostPlan:
    """What a cluster on other hosts was asked for (plain data: it ships to tests)."""

    entries: tuple[str, ...]
    ssh_args: tuple[str, ...] = ()
    remote_python: str = ""  # "" : the kernel's interpreter path


def probe_code(store: tuple[str, int]) -> str:
    return (
        _PROBE.replace("NAMES", repr(MATCHED))
        .replace("ADDR", repr(store[0]))
        .replace("PORT", str(store[1]))
        .replace("TIMEOUT", str(CONNECT_TIMEOUT_S))
    )


def _check_one(
    entry: str, ssh_args: list[str], python: str, store: tuple[str, int], mine: dict
) -> dict:
    argv = ["ssh", *ssh_args, entry, python, "-"]
    try:
        out = subprocess.run(
            argv,
            input=probe_code(store),
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise BootError(
            f"{entry}: no answer over ssh within {PREFLIGHT_TIMEOUT_S:.0f} s. Check that "
            f"`ssh {entry} {python} -V` works from this host."
        ) from None
    err = out.stderr.strip().splitlines()
    last = err[-1] if err else f"exit status {out.returncode}"
    if out.returncode == 255:
        raise BootError(
            f"{entry}: cannot log in over ssh ({last}). nbrpc runs ssh with BatchMode (no "
            "password prompts): set up key login (ssh-copy-id), check the host's name, and "
            "give ssh options with --ssh-args (e.g. '-F ~/.ssh/config -i KEY')."
        )
    line = next((x for x in out.stdout.splitlines() if x.startswith("NBRPC-PREFLIGHT ")), "")
    if not line:
        raise BootError(
            f"{entry}: {python} does not run there ({last}). Install the same environment "
            "on every host (same path), or name the remote interpreter with "
            "--remote-python PATH."
        )
    info = json.loads(line.split(" ", 1)[1])
    if info["python"] != mine["python"]:
        raise BootError(
            f"{entry}: Python {info['python']} there ({info['executable']}), {mine['python']} "
            "here. Workers unpickle the kernel's code: use the same Python minor version on "
            "every host (--remote-python PATH)."
        )
    for name in MATCHED:
        theirs, ours = info["versions"].get(name), mine["versions"].get(name)
        if theirs != ours:
            have = f"{name} {theirs}" if theirs else f"no {name}"
            raise BootError(
                f"{entry}: {have} in {info['executable']}, {name} {ours} here. Install the "
                f"same version on every host (pip install {name}=={ours})."
            )
    if info["store"] != "ok":
        raise BootError(
            f"{entry} cannot reach this kernel at {store[0]}:{store[1]} ({info['store']}). "
            f"Workers connect back to the kernel: give --listen with an address {entry} "
            "reaches, and open that host's way to this one (docs/multi-host.md, ports)."
        )
    return info


def local_versions() -> dict:
    import sys
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in MATCHED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": "{}.{}".format(*sys.version_info[:2]), "versions": versions}


def preflight(
    plan: HostPlan, python: str, listen: str, ssh_args: list[str] | None = None
) -> dict[str, dict]:
    """Check every host at once (see the module doc); returns what each one reported.

    Reaching the kernel is tried against a socket opened here for the check, on ``listen``
    and a free port: the store, the RPC endpoint and the controller listen on that address
    too, each on a port of its own, so a host that reaches this one reaches them.

    ``ssh_args``: the full ssh options (default: :func:`ssh_options`); the launcher passes
    its shared-connection options, so the engines' ssh sessions reuse these connections.
    """
    ssh_args = ssh_args if ssh_args is not None else ssh_options(plan.ssh_args)
    mine = local_versions()
    hosts = list(counts(plan.entries))
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
        probe.bind((listen, 0))
        _fence.fence_socket(probe)
        probe.listen(64)  # the handshake completes in the backlog: nothing to accept
    except OSError as exc:
        raise BootError(f"cannot listen on {listen} ({exc}): is it this host's address?") from exc
    store = (listen, probe.getsockname()[1])
    got: dict[str, Any] = {}  # host -> what its check found, or its error

    def one(host: str) -> None:
        try:
            got[host] = _check_one(host, ssh_args, python, store, mine)
        except BootError as exc:
            got[host] = exc
        except Exception as exc:  # a check that broke: said as the host's error
            got[host] = BootError(f"{host}: {type(exc).__name__}: {exc}")

    with probe:
        _timers.at_once(one, [(h,) for h in hosts], None)  # (each ssh has its own timeout)
    errors = [str(got[h]) for h in hosts if isinstance(got.get(h), BootError)]
    found = {h: got[h] for h in hosts if h in got and not isinstance(got[h], BootError)}
    if errors:
        raise BootError("preflight failed:\n  " + "\n  ".join(errors))
    return found
