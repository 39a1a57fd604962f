"""Where the workers run and what they are called: their names, the ``--hosts`` entries,
an engine source's own options (the Slurm job, ``--slurm``); each checked before anything
starts.

:func:`where` works out how many workers, named what, on which hosts, with the kernel
listening where, and refuses combinations that cannot work. An engine source that takes
options of its own declares them as one class extending :class:`SourceOptions`, registered
once (:func:`register`): :class:`Slurm` is what ``nbrpc.init(slurm=nbrpc.Slurm(...))``
takes, and the one declaration of the job's fields. The same value can be given as flat
options (``%rpc_init --slurm --nodes 2 --time 10``, ``nbrpc.init(slurm=True, nodes=2)``),
whose flags are declared with the others in :mod:`nbrpc._options`, each marked as the
field it gives (``part_of="slurm.nodes"``); :func:`nbrpc._options.source_options` makes one
value of either form, the only form the settings keep (``Settings.source_options``). What
only Slurm can judge (a partition, a time over its limit) it judges with ``sbatch
--test-only`` (:mod:`nbrpc._engines.slurm`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from . import _group
from ._errors import ConfigError

DEFAULT_WORKERS = 2  # a local cluster's size when neither n nor names say otherwise


class SourceOptions:
    """An engine source's own options value (:class:`Slurm`), one frozen dataclass
    extending this, registered once (:func:`register`).

    ``source``: the option that takes the value, and the ``X`` of the ``part_of="X.field"``
    options that give its fields one by one (``"slurm"``); the settings hold whichever
    source's value was asked for in one field (``Settings.source_options``). ``asks_for``:
    what the value asks for, in errors ("--nodes shape a Slurm job").
    """

    source: ClassVar[str]
    asks_for: ClassVar[str]

    @classmethod
    def from_parts(cls: type[Opts], parts: dict[str, Any]) -> Opts:
        """The value of ``<source>=True`` and its flat options, ``{field: value}``."""
        return cls(**parts)

    def check(self, v: dict[str, Any]) -> None:
        """Refuse a bad value, or one that cannot go with the other options (``v``: every
        option as given)."""

    def implies(self) -> dict[str, Any]:
        """Options this value sets where the caller gave none, ``{option: value}`` (read
        for ``gpus``: ``Slurm(gpus_per_node=2)`` means ``gpus="auto"``)."""
        return {}


Opts = TypeVar("Opts", bound=SourceOptions)

#: Each engine source's options class, by the option that takes its value (its
#: ``source``): one registration per source.
SOURCE_OPTIONS: dict[str, type[SourceOptions]] = {}


def register(cls: type[Opts]) -> type[Opts]:
    """Register an engine source's options class (a class decorator)."""
    SOURCE_OPTIONS[cls.source] = cls
    return cls


def parts(v: dict[str, Any], whole: str, opts: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The options that are fields of option ``whole``'s value, as given in ``v``:
    ``{option: (field, value)}`` in declaration order (``{"sbatch_args": ("args", ...)}``);
    ``opts``: every option's declaration (:func:`nbrpc._options.declared`)."""
    found = {}
    for name, opt in opts.items():
        owner, _, part = (opt.part_of or "").partition(".")
        if opt.part_of is not None and owner == whole:
            found[name] = (part, v[name])
    return found


def source_options(v: dict[str, Any], opts: dict[str, Any]) -> SourceOptions | None:
    """The engine source's own options value asked for, checked: ``<source>=`` a value of
    its registered class (``slurm=nbrpc.Slurm(...)``), or ``<source>=True`` and the options
    ``part_of`` it (``slurm=True, nodes=2``); None when no source's is. ``v``: every option
    as given; ``opts``: every option's declaration (:func:`nbrpc._options.declared`). Flat
    options without their source, or two sources' values, are refused."""
    asked: dict[str, tuple[type[SourceOptions], dict[str, tuple[str, Any]], list[str]]] = {}
    for source, cls in SOURCE_OPTIONS.items():
        flat = parts(v, source, opts)
        given = [k for k, (_, value) in flat.items() if value not in (None, "", [], ())]
        if v[source]:
            asked[source] = (cls, flat, given)
        elif given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ConfigError(
                f"{flags} shape a {cls.asks_for}: add {opts[source].flag} ({source}=True)"
            )
    if len(asked) > 1:
        both = " and ".join(f"{opts[s].flag} ({s}=)" for s in asked)
        raise ConfigError(f"{both} each say where the workers come from: use one")
    if not asked:
        return None
    [(source, (cls, flat, given))] = asked.items()
    value = v[source]
    if isinstance(value, cls):
        if given:
            raise ConfigError(
                f"give the {cls.asks_for}'s {', '.join(given)} in nbrpc.{cls.__name__}(...) "
                "or as keywords, not both"
            )
    elif value is True:
        value = cls.from_parts(dict(flat.values()))
    else:
        raise ConfigError(f"{source}={value!r}: use True or nbrpc.{cls.__name__}(...)")
    value.check(v)
    return value


@register
@dataclass(frozen=True)
class Slurm(SourceOptions):
    """Workers from Slurm (``nbrpc.init(n=4, slurm=nbrpc.Slurm(nodes=2, time="30"))``).

    One job of ``n`` engine tasks (``%rpc_init --slurm -n N``), or a step of the job the
    kernel runs in (``SLURM_JOB_ID`` set). ``nodes``: how many nodes (Slurm's choice when
    None); ``partition``; ``time``: the job's time limit in any of ``sbatch --time``'s
    formats ("30", "1:00:00", "2-0"); ``gpus_per_node``: GPUs asked on each node, one per
    worker by its rank on the node; ``args``: more ``sbatch`` options, as written on its
    command line; ``queue_timeout``: seconds to wait for the job to start (None: as long as
    it takes) before it is cancelled and the boot fails naming Slurm's reason.
    """

    source = "slurm"
    asks_for = "Slurm job"

    nodes: int | None = None
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    args: tuple[str, ...] = ()
    queue_timeout: float | None = None

    def sbatch_options(self, n: int) -> list[str]:
        """The ``sbatch`` (and ``srun``) options for ``n`` tasks."""
        opts = [f"--ntasks={n}"]
        if self.nodes is not None:
            opts.append(f"--nodes={self.nodes}")
        if self.partition:
            opts.append(f"--partition={self.partition}")
        if self.time:
            opts.append(f"--time={self.time}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        return [*opts, *self.args]

    @classmethod
    def from_parts(cls, parts: dict[str, Any]) -> Slurm:
        """The job of ``slurm=True`` and its flat options (``--sbatch-args`` as one text)."""
        extra = parts.get("args")
        args = tuple(shlex.split(extra) if isinstance(extra, str) else extra or ())
        return cls(**{**parts, "args": args})

    def check(self, v: dict[str, Any]) -> None:
        if v["hosts"] is not None or v["profile"] is not None or v["cluster_id"] is not None:
            raise ConfigError(
                "--slurm takes its workers from Slurm; --hosts starts them over ssh and "
                "--profile/--cluster-id attach to engines someone else started. Use one."
            )
        if self.nodes is not None and self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ConfigError("--queue-timeout must be a positive number of seconds")
        if self.time is not None and not re.fullmatch(r"[0-9:-]+|UNLIMITED|INFINITE", self.time):
            raise ConfigError(
                f"--time {self.time!r}: Slurm takes minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                "D-HH:MM:SS"
            )
        if (v["listen"] or "") and _group.is_loopback(v["listen"]):
            raise ConfigError(
                f"--listen {v['listen']} with --slurm: workers on the cluster's nodes cannot "
                "reach this host's loopback. Give an address they reach (or leave --listen "
                "out: it is worked out from the route towards Slurm's controller)."
            )

    def implies(self) -> dict[str, Any]:
        """GPUs per node: a GPU per worker, by its rank on the node, maps for all pairs."""
        return {"gpus": "auto"} if self.gpus_per_node else {}


def validate_names(names: list[str] | tuple[str, ...], self_name: str) -> None:
    for name in [self_name, *names]:
        if not name or len(name) >= 128 or not all(c.isalnum() or c in "_-" for c in name):
            raise ConfigError(
                f"bad worker name {name!r}: use letters, digits, '_' or '-' "
                "(at most 127 characters), e.g. --names ps,trainer1"
            )
    if len(set(names)) != len(names) or self_name in names:
        raise ConfigError(
            f"worker names must be unique and differ from the kernel's ({self_name!r}); "
            f"got {[self_name, *names]}"
        )


_HOST_ENTRY = re.compile(r"^(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9._:-]+$")


def parse_hosts(hosts: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"root@h1,h1,h2"`` (or a list) -> ``("root@h1", "h1", "h2")``, each entry checked."""
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    entries = tuple(str(h).strip() for h in items if str(h).strip())
    if not entries:
        raise ConfigError("--hosts is empty: give [user@]address entries, e.g. --hosts h1,h1,h2")
    for entry in entries:
        if not _HOST_ENTRY.match(entry):
            raise ConfigError(
                f"--hosts entry {entry!r} is not [user@]address (letters, digits, '.', '-', "
                "'_', ':'); ssh options such as a port or key go in --ssh-args, e.g. "
                "--ssh-args='-p 2222 -i ~/.ssh/cluster'"
            )
    return entries


def where(v: dict[str, Any]) -> tuple:
    """How many workers, named what, on which hosts, with the kernel listening where:
    ``(n, names, hosts, ssh_args, listen)``, checked against each other."""
    n = v["n"]
    attached = v["profile"] is not None or v["cluster_id"] is not None
    names = tuple(s.strip() for s in v["names"]) if v["names"] else None
    entries = parse_hosts(v["hosts"]) if v["hosts"] is not None else None
    ssh_args = v["ssh_args"]
    extra = tuple(shlex.split(ssh_args) if isinstance(ssh_args, str) else ssh_args or ())
    if entries is None and extra:
        raise ConfigError("--ssh-args goes with --hosts")
    if entries is None and v["remote_python"] and not v["slurm"]:
        raise ConfigError("--remote-python goes with --hosts or --slurm")
    listen = v["listen"]
    if entries is not None:
        if attached:
            raise ConfigError(
                "--hosts starts engines over ssh; --profile/--cluster-id attach to engines "
                "someone else started. Use one or the other."
            )
        if n is not None and n != len(entries):
            raise ConfigError(
                f"-n {n} does not match the {len(entries)} --hosts entries: a host listed "
                "N times gets N workers, so leave -n out"
            )
        if names is not None and len(names) != len(entries):
            raise ConfigError(
                f"{len(names)} names for {len(entries)} --hosts entries: give one name per "
                "entry (a host listed twice gets two workers)"
            )
        n = len(entries)
        if listen and _group.is_loopback(listen):
            raise ConfigError(
                f"--listen {listen} with --hosts: workers on other hosts cannot reach this "
                "host's loopback. Give an address they reach (or leave --listen out: it "
                "is worked out from the route towards the first host)."
            )
    if v["init_method"] and not listen:
        listen = _group.listen_of_init_method(v["init_method"])
    if names is not None:
        if n is not None and n != len(names):
            raise ConfigError(f"-n {n} does not match {len(names)} names: {list(names)}")
        n = len(names)
    if n is None and not attached:
        n = DEFAULT_WORKERS
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"-n must be at least 1, got {n}")
    validate_names(names or (), v["self_name"])
    return n, names, entries, extra, listen
