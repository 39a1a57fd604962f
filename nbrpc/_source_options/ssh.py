"""The ssh source's options (``--hosts``): :class:`Hosts`.

``%rpc_init --hosts root@h1,h1,h2 --ssh-args '-F cfg'`` (``nbrpc.init(hosts=[...],
ssh_args=...)``): the ``hosts`` option's text is the entries, ``ssh_args`` is declared in
:mod:`nbrpc._options` as ``part_of="hosts.ssh_args"``. The source that reads it is
:mod:`nbrpc._engines.ssh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbrpc import _network
from nbrpc._errors import ConfigError, counted
from nbrpc._placement import SourceOptions, parse_hosts, split_args


@dataclass(frozen=True)
class Hosts(SourceOptions):
    """Workers on other hosts over ssh, one per entry in order (``entries``: each
    ``[user@]address``, a host listed N times gets N workers); ``ssh_args``: ssh options
    added after nbrpc's own."""

    source = "hosts"
    asks_for = "cluster over ssh"
    typed = False  # given as text: "root@h1,h1,h2" or a list
    remote = True

    entries: tuple[str, ...] = ()
    ssh_args: tuple[str, ...] = ()

    @classmethod
    def asked(cls, v: dict[str, Any]) -> bool:
        return v["hosts"] is not None

    @classmethod
    def given(cls, value: Any, parts: dict[str, Any]) -> Hosts:
        args = split_args(parts.get("ssh_args"))
        return cls(entries=parse_hosts(value), ssh_args=args)

    @classmethod
    def alone(cls, flags: str, opts: dict[str, Any]) -> str:
        return f"{flags} goes with {opts[cls.source].flag}"

    def workers(self) -> int | None:
        return len(self.entries)

    def check(self, v: dict[str, Any]) -> None:
        if v["profile"] is not None or v["cluster_id"] is not None:
            raise ConfigError(
                "--hosts starts engines over ssh; --profile/--cluster-id attach to engines "
                "someone else started. Use one or the other."
            )
        n, names = v["n"], v["names"] or None
        entries = counted(len(self.entries), "--hosts entry", "--hosts entries")
        if n is not None and n != len(self.entries):
            raise ConfigError(
                f"-n {n} does not match the {entries}: a host "
                "listed N times gets N workers, so leave -n out"
            )
        if names is not None and len(names) != len(self.entries):
            raise ConfigError(
                f"{counted(len(names), 'name')} for {entries}: give one name "
                "per entry (a host listed twice gets two workers)"
            )
        listen = v["listen"]
        if listen and _network.is_loopback(listen):
            raise ConfigError(
                f"--listen {listen} with --hosts: workers on other hosts cannot reach this "
                "host's loopback. Give an address they reach (or leave --listen out: it "
                "is worked out from the route towards the first host)."
            )
