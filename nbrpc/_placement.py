"""Where the workers run and what they are called: their names, the ``--hosts`` entries,
the base and registry of the engine sources' own options; each checked before anything
starts.

:func:`where` works out how many workers, named what, with the kernel listening where,
asking the engine source's options value what it fixes (``--hosts``: one worker per
entry) rather than which source it is. An engine source that takes options of its own
declares them as one class extending :class:`SourceOptions`, registered once
(:func:`register`), in :mod:`nbrpc._source_options` (``Slurm``: what
``nbrpc.init(slurm=nbrpc.Slurm(...))`` takes; ``Hosts``; ``Attached``). Its value can be
given whole (a Slurm job) or as flat options (``%rpc_init --slurm --nodes 2 --time 10``,
``nbrpc.init(slurm=True, nodes=2)``, ``--hosts h1,h2 --ssh-args '-F cfg'``), whose flags are
declared with the others in :mod:`nbrpc._options`, each marked as the field it gives
(``part_of="slurm.nodes"``); :func:`source_options` makes one value of either form, the
only form the settings keep (``Settings.source_options``). What only Slurm can judge (a
partition, a time over its limit) it judges with ``sbatch --test-only``
(:mod:`nbrpc._engines.slurm`).
"""

from __future__ import annotations

import re
import shlex
from typing import Any, ClassVar, TypeVar

from . import _group, _process
from ._errors import ConfigError, counted

DEFAULT_WORKERS = 2  # a local cluster's size when neither n nor names say otherwise


class SourceOptions:
    """An engine source's own options value (``nbrpc.Slurm``), one frozen dataclass
    extending this in :mod:`nbrpc._source_options`, registered once (:func:`register`).

    ``source``: the option that takes the value, and the ``X`` of the ``part_of="X.field"``
    options that give its fields one by one (``"slurm"``); the settings hold whichever
    source's value was asked for in one field (``Settings.source_options``). ``asks_for``:
    what the value asks for, in errors ("--nodes shape a Slurm job"). ``typed``: its option
    takes a value of this class (``slurm=nbrpc.Slurm(...)``, exported from ``nbrpc``);
    ``--hosts`` and ``--profile`` take text instead. ``remote``: its workers run where
    ``--remote-python`` names the interpreter. ``sized_later``: without ``-n``, the source
    finds how many workers once it runs (an attached cluster's engines).
    """

    source: ClassVar[str]
    asks_for: ClassVar[str]
    typed: ClassVar[bool] = True
    remote: ClassVar[bool] = False
    sized_later: ClassVar[bool] = False

    @classmethod
    def asked(cls, v: dict[str, Any]) -> bool:
        """Whether the options as given (``v``) ask for this source."""
        return bool(v[cls.source])

    @classmethod
    def given(cls: type[Opts], value: Any, parts: dict[str, Any]) -> Opts:
        """The value from its option as given (``value``: not of this class) and its flat
        options, ``{field: value}``: ``True`` and the parts by default."""
        if value is True:
            return cls.from_parts(parts)
        raise ConfigError(f"{cls.source}={value!r}: use True or nbrpc.{cls.__name__}(...)")

    @classmethod
    def from_parts(cls: type[Opts], parts: dict[str, Any]) -> Opts:
        """The value of ``<source>=True`` and its flat options, ``{field: value}``."""
        return cls(**parts)

    @classmethod
    def alone(cls, flags: str, opts: dict[str, Any]) -> str:
        """The error for its flat options (``flags``) given without its own option."""
        return f"{flags} shape a {cls.asks_for}: add {opts[cls.source].flag} ({cls.source}=True)"

    def workers(self) -> int | None:
        """How many workers this value fixes (one per ``--hosts`` entry); None: ``-n``
        or the names say."""
        return None

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
    its registered class (``slurm=nbrpc.Slurm(...)``), or the source's option as given and
    the options ``part_of`` it (``slurm=True, nodes=2``; ``hosts="h1,h2", ssh_args=...``);
    None when no source's is. ``v``: every option as given; ``opts``: every option's
    declaration (:func:`nbrpc._options.declared`). Flat options without their source, or
    two sources' values, are refused (each value's own check first: it says which two)."""
    asked: dict[str, SourceOptions] = {}
    for source, cls in SOURCE_OPTIONS.items():
        flat = parts(v, source, opts)
        given = [k for k, (_, value) in flat.items() if value not in (None, "", [], ())]
        if cls.asked(v):
            value = v[source]
            if isinstance(value, cls):
                if given:
                    raise ConfigError(
                        f"give the {cls.asks_for}'s {', '.join(given)} in "
                        f"nbrpc.{cls.__name__}(...) or as keywords, not both"
                    )
            else:
                value = cls.given(value, dict(flat.values()))
            asked[source] = value
        elif given:
            raise ConfigError(cls.alone(", ".join(_flag(k) for k in given), opts))
    for value in asked.values():
        value.check(v)
    if len(asked) > 1:
        both = " and ".join(f"{opts[s].flag} ({s}=)" for s in asked)
        raise ConfigError(f"{both} each say where the workers come from: use one")
    return next(iter(asked.values()), None)


def check_named(names: list[str], workers: list[str], doing: str, kernel_note: str) -> None:
    """Refuse ``names`` that are not among ``workers`` or are given twice, for a change
    of the cluster (``doing``: "restart", "remove"; ``kernel_note``: why the kernel is not
    among them), before anything changes."""
    unknown = [n for n in names if n not in workers]
    if unknown:
        raise ConfigError(
            f"cannot {doing} {', '.join(unknown)}: {not_workers(unknown, _process.name())}. "
            f"Its workers: {', '.join(workers)} ({kernel_note})."
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"{doing} {', '.join(names)}: a name is given twice")


def not_workers(unknown: list[str], kernel: str) -> str:
    """What ``unknown``, names given where workers of this cluster are wanted, are: the
    kernel by its name (``%rpc_restart worker0``), the rest not workers of this cluster."""
    said = []
    if kernel in unknown:
        said.append(f"{kernel} is the kernel (this notebook's own process), not a worker")
    others = [n for n in unknown if n != kernel]
    if others:
        are = "is not a worker" if len(others) == 1 else "are not workers"
        said.append(f"{', '.join(others)} {are} of this cluster")
    return ", and ".join(said)


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


def where(v: dict[str, Any], asked: SourceOptions | None) -> tuple:
    """How many workers, named what, with the kernel listening where: ``(n, names,
    listen)``, checked against each other and against what the engine source's options
    value (``asked``, checked) fixes."""
    n = v["n"]
    names = tuple(s.strip() for s in v["names"]) if v["names"] else None
    if v["remote_python"] and (asked is None or not asked.remote):
        takers = [s for s, cls in SOURCE_OPTIONS.items() if cls.remote]
        raise ConfigError(f"--remote-python goes with {' or '.join(_flag(s) for s in takers)}")
    listen = v["listen"]
    fixed = asked.workers() if asked is not None else None
    if fixed is not None:
        n = fixed
    if v["init_method"] and not listen:
        listen = _group.listen_of_init_method(v["init_method"])
    if names is not None:
        if n is not None and n != len(names):
            raise ConfigError(f"-n {n} does not match {counted(len(names), 'name')}: {list(names)}")
        n = len(names)
    if n is None and not (asked is not None and asked.sized_later):
        n = DEFAULT_WORKERS
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"-n must be at least 1, got {n}")
    validate_names(names or (), v["self_name"])
    return n, names, listen


def split_args(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Extra command-line options as given: one text (split as a shell would) or a list."""
    return tuple(shlex.split(value) if isinstance(value, str) else value or ())


def _flag(option: str) -> str:
    """An option's ``%rpc_init`` flag, by its name (``remote_python``: ``--remote-python``)."""
    return "--" + option.replace("_", "-")
