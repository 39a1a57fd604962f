"""What a cluster can be asked for: every option declared once, and the frozen settings.

:class:`Options` is the one declaration. Each entry is an option's name, the type a caller
gives it, and an :class:`Opt`: its ``%rpc_init`` flag, its help line, its default, and how
the flag's text becomes the value. From it come:

* the keyword arguments of :func:`nbrpc.init` and :class:`nbrpc.Cluster`, typed
  (``**options: Unpack[Options]``), and the options part of their docstrings;
* ``%rpc_init``'s arguments and ``--help``, and ``docs/options.md``: the options as text,
  in :mod:`nbrpc._option_text`.

:class:`Settings` is what a cluster was asked for once checked: one frozen object whose
fields are the options' names (the test holds the two together), with defaults worked out
and every bad value refused with a :class:`~nbrpc.ConfigError` before a process starts
(:meth:`Settings.make`). An engine source's own options are one value of its own class
(``slurm``: an :class:`nbrpc.Slurm`; ``hosts``: a ``Hosts``; ``profile``: an ``Attached``;
each a :class:`~nbrpc._placement.SourceOptions` in :mod:`nbrpc._source_options`,
registered once); the flags that give its fields one by one (``--nodes``, ``--ssh-args``,
``--cluster-id``, ...) are options marked ``part_of`` the field they give, folded into
that value. Whichever source's value was asked
for, :class:`Settings` holds it in one field, ``source_options`` (``options_of(Slurm)``):
a new source adds no field here. What only the engine source can work out (``--hosts``:
``--listen`` on the route to the first host) it completes (:func:`nbrpc._engines.resolve`).

Adding an option: one entry in :class:`Options` (its ``doc`` is its documentation), its
field in :class:`Settings` (none for a source's value or a ``part_of`` option: their
fields are in the source's options class), and its use.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, TypedDict, get_type_hints

from . import _devices, _group, _network, _option_checks as _checks
from ._errors import ConfigError
from ._placement import Opts, SourceOptions, source_options, where
from ._source_options import Attached, Slurm
from ._wire import shm

DEFAULT_RPC_TIMEOUT_S = 60.0
DEFAULT_THREADS = 16


@dataclass(frozen=True)
class Opt:
    """How an option is given and documented.

    ``flag``: its ``%rpc_init`` flag (None: from Python only). ``help``: one line for
    ``--help``; ``doc``: more, for the docstring and docs/options.md. ``parse``: the flag's
    text (a list of texts for a ``repeat`` flag) to the option's value. ``switch``: the flag
    takes no value and sets the option to ``switch[1]`` (``switch[0]`` when absent).
    ``part_of``: ``"slurm.args"``: the option is the ``args`` field of the value option
    ``slurm`` takes (the options class registered for source ``slurm``, an
    :class:`nbrpc.Slurm`), given flat (``--sbatch-args``, ``slurm=True, sbatch_args=...``);
    :class:`Settings` holds that value (``source_options``), not this option.
    """

    flag: str | None
    help: str
    default: Any = None
    doc: str = ""
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    switch: tuple[Any, Any] | None = None
    repeat: bool = False
    part_of: str | None = None


def _comma_list(text: str) -> list[str]:
    return [s for s in text.split(",") if s.strip()]


def _unquote(value: str) -> str:
    """IPython splits magic lines keeping quotes: ``--ssh-args '-F cfg'`` arrives quoted."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _device_map_flags(texts: list[str]) -> dict[str, dict] | None:
    return dict(_devices.parse_device_map(text) for text in texts) or None


class Options(TypedDict, total=False):
    """The options of :func:`nbrpc.init`, :class:`nbrpc.Cluster` and ``%rpc_init``."""

    n: Annotated[
        int | None,
        Opt(
            "-n",
            "number of workers to start (default 2)",
            doc="How many workers to start. Default: 2, or one per ``names`` or ``hosts`` "
            "entry, or every engine of an attached ipyparallel cluster.",
            parse=int,
        ),
    ]
    names: Annotated[
        list[str] | None,
        Opt(
            "--names",
            "comma-separated worker names, e.g. ps,trainer1",
            doc="The workers' names, in order (default ``worker1`` ... ``workerN``).",
            metavar="NAMES",
            parse=_comma_list,
        ),
    ]
    self_name: Annotated[
        str,
        Opt(
            "--self",
            "the kernel's name",
            default="worker0",
            doc="The name the calling process joins as (rank 0). Fixed for the kernel's lifetime.",
        ),
    ]
    num_worker_threads: Annotated[
        int | None,
        Opt("--threads", "RPC threads per process (default 16)", parse=int),
    ]
    rpc_timeout: Annotated[
        float | None,
        Opt("--timeout", "default RPC timeout, seconds (60)", parse=float),
    ]
    init_method: Annotated[
        str | None,
        Opt(
            "--init-method",
            "tcp://HOST:PORT for groups across hosts",
            doc="The group's rendezvous: ``tcp://HOST:PORT`` (workers on other hosts connect "
            "there) or ``file:///shared/path``. Default: a private file store.",
        ),
    ]
    profile: Annotated[
        str | None,
        Opt(
            "--profile",
            "attach to the ipyparallel cluster of this profile",
            doc="Attach to a running ipyparallel cluster (engines on other hosts included) "
            "instead of starting engines; ``n`` then picks how many of its engines join "
            "(default: as many as the cluster was started with, read from its cluster "
            "file, waited for up to the boot timeout). Its engines keep running after a "
            "shutdown.",
        ),
    ]
    cluster_id: Annotated[
        str | None,
        Opt(
            "--cluster-id",
            "attach to the ipyparallel cluster with this id",
            part_of="profile.cluster_id",
        ),
    ]
    progress: Annotated[
        str | bool,
        Opt(
            None,
            "the boot's progress: 'auto', 'widget', 'text' or 'off'",
            default="auto",
            doc="How the boot shows its progress: ``'auto'`` (widgets in a notebook, "
            "nothing elsewhere), ``'widget'``, ``'text'`` (lines on stderr) or ``'off'``; "
            "``True``/``False`` mean text/off. ``%rpc_init --quiet`` turns it off.",
        ),
    ]
    listen: Annotated[
        str | None,
        Opt(
            "--listen",
            "this host's address for workers on other hosts (default: loopback only; "
            "anyone who reaches it can run code: see docs/security.md)",
            doc="Everything listens on loopback unless ``listen`` names one of this host's "
            "addresses: then the kernel's RPC endpoint, its membership store and the "
            "ipyparallel controller it starts listen there, for workers on other hosts. "
            "torch RPC has no authentication: whoever reaches those ports can run code here "
            "(docs/security.md).",
            metavar="ADDR",
        ),
    ]
    gpus: Annotated[
        str | None,
        Opt(
            "--gpus",
            "'auto': one GPU per process, device maps for all pairs",
            doc="``'auto'`` gives each process one GPU (round-robin per host) and maps every "
            "pair, checked against each process's devices before any join (the kernel's "
            "first join maps worker1..worker16 on a GPU host: docs/architecture.md).",
        ),
    ]
    device_maps: Annotated[
        dict[str, dict] | None,
        Opt(
            "--device-map",
            "the kernel's device map to WORKER, e.g. worker1=cuda:0->cuda:1 (repeatable)",
            doc="The kernel's device maps by hand, e.g. ``{'worker1': {'cuda:0': "
            "'cuda:1'}}``; checked against the devices each process reports.",
            metavar="WORKER=LOCAL->REMOTE",
            parse=_device_map_flags,
            repeat=True,
        ),
    ]
    shm_threshold: Annotated[
        int | None,
        Opt(
            "--no-shm",
            "send large CPU tensors through TensorPipe, not shared memory",
            default=shm.DEFAULT_THRESHOLD,
            doc="CPU tensors whose storage has at least this many bytes travel through "
            "shared memory between processes of one host (``None``, ``--no-shm``: never); "
            "a small call's lane sends every storage over the 64 KB its frame holds that "
            "way too; see docs/architecture.md.",
            switch=(shm.DEFAULT_THRESHOLD, None),
        ),
    ]
    fast_calls: Annotated[
        bool,
        Opt(
            "--no-fast-calls",
            "send small calls through TensorPipe, not the same-host lanes",
            default=True,
            doc="Small Python calls (``rpc_sync``/``rpc_async``, no RRef, small CPU tensors) "
            "between processes of a local cluster travel on Unix-socket lanes beside "
            "TensorPipe (``False``, ``--no-fast-calls``: always TensorPipe); see "
            "docs/architecture.md.",
            switch=(True, False),
        ),
    ]
    python: Annotated[
        str | None,
        Opt(
            "--python",
            "the interpreter workers run (default: the kernel's); it needs torch and nbrpc",
            metavar="PATH",
        ),
    ]
    process_group: Annotated[
        str | None,
        Opt(
            "--process-group",
            "the workers also form a torch.distributed process group: gloo or nccl",
            doc="``'gloo'`` (or ``'nccl'``): the workers also form a ``torch.distributed`` "
            "process group, for collectives and DDP in ``%%rpc`` cells.",
            metavar="BACKEND",
        ),
    ]
    process_group_workers: Annotated[
        list[str] | None,
        Opt(
            "--process-group-workers",
            "its members in rank order, comma-separated (default: every worker)",
            metavar="NAMES",
            parse=lambda text: text.split(","),
        ),
    ]
    hosts: Annotated[
        str | list[str] | None,
        Opt(
            "--hosts",
            "workers on other hosts over ssh, one per entry ([user@]address), named in "
            "order; a host listed N times gets N workers (docs/multi-host.md)",
            doc="One worker per entry on other hosts over ssh (``['root@h1', 'h1', 'h2']`` "
            "or ``'root@h1,h1,h2'``), named in list order. Each host is checked first (ssh "
            "login, same Python and package versions, reaching this host), and ``listen`` "
            "defaults to this host's address on the route towards the first host. See "
            "docs/multi-host.md.",
            metavar="HOST[,HOST...]",
        ),
    ]
    ssh_args: Annotated[
        str | list[str] | None,
        Opt(
            "--ssh-args",
            "extra ssh options for --hosts, quoted, e.g. --ssh-args '-F ~/.ssh/cluster_config'",
            doc="ssh options added after nbrpc's own (the user's ssh config is read; "
            "BatchMode is always on).",
            metavar="ARGS",
            parse=_unquote,
            part_of="hosts.ssh_args",
        ),
    ]
    remote_python: Annotated[
        str | None,
        Opt(
            "--remote-python",
            "the interpreter on the hosts or Slurm's nodes (default: the kernel's path)",
            metavar="PATH",
        ),
    ]
    restart: Annotated[
        str | None,
        Opt(
            "--restart-dead",
            "replace a worker that died before the next cell runs",
            doc="``'dead'``: before each cell (IPython), a worker that died is replaced by a "
            "fresh process under the same name, with a line that names it and why it died "
            "(see :func:`nbrpc.restart`). ``None``: a dead worker stays dead.",
            switch=(None, "dead"),
        ),
    ]
    slurm: Annotated[
        bool | Slurm | None,
        Opt(
            "--slurm",
            "workers from Slurm: one job of -n engine tasks (a step of the kernel's own job "
            "when it runs in one); docs/slurm.md",
            doc="``True`` or a :class:`nbrpc.Slurm`: the workers are the tasks of one Slurm "
            "job (``sbatch``), or a step of the kernel's own job when ``SLURM_JOB_ID`` is "
            "set (``srun``), named ``worker1..N`` in task order. The flags below (or the "
            "``Slurm`` fields) shape the job. See docs/slurm.md.",
            switch=(None, True),
        ),
    ]
    nodes: Annotated[
        int | None,
        Opt("--nodes", "with --slurm: how many nodes", parse=int, part_of="slurm.nodes"),
    ]
    partition: Annotated[
        str | None,
        Opt("--partition", "with --slurm: the partition", part_of="slurm.partition"),
    ]
    time: Annotated[
        str | None,
        Opt(
            "--time",
            "with --slurm: the job's time limit, as sbatch --time takes it",
            part_of="slurm.time",
        ),
    ]
    gpus_per_node: Annotated[
        int | None,
        Opt(
            "--gpus-per-node",
            "with --slurm: GPUs per node, one per worker by its rank on the node",
            parse=int,
            part_of="slurm.gpus_per_node",
        ),
    ]
    sbatch_args: Annotated[
        str | list[str] | None,
        Opt(
            "--sbatch-args",
            "with --slurm: more sbatch options, quoted, e.g. --sbatch-args '--account=ml'",
            metavar="ARGS",
            parse=_unquote,
            part_of="slurm.args",
        ),
    ]
    queue_timeout: Annotated[
        float | None,
        Opt(
            "--queue-timeout",
            "with --slurm: seconds to wait for the job to start, then cancel it",
            parse=float,
            part_of="slurm.queue_timeout",
        ),
    ]


def declared() -> dict[str, Opt]:
    """Every option's :class:`Opt`, in declaration order."""
    hints = get_type_hints(Options, include_extras=True)
    return {name: hint.__metadata__[0] for name, hint in hints.items()}


@dataclass(frozen=True)
class Settings:
    """A cluster's options, checked (see :class:`Options` for what each one means)."""

    n: int | None  # None: every engine of an attached ipyparallel cluster
    names: tuple[str, ...] | None
    self_name: str
    num_worker_threads: int
    rpc_timeout: float
    init_method: str | None
    progress: str  # "widget", "text" or "off"
    listen: str | None
    gpus: str | None
    #: the kernel's maps to workers, checked for syntax now, against devices at boot
    device_maps: _devices.Maps = field(default_factory=dict)
    shm_threshold: int | None = shm.DEFAULT_THRESHOLD
    fast_calls: bool = True
    python: str = sys.executable
    #: a torch.distributed process group among the workers ("gloo" or "nccl"), and which
    #: workers are in it, in rank order (None: all of them)
    process_group: str | None = None
    process_group_workers: tuple[str, ...] | None = None
    #: the interpreter on other hosts (--hosts) or Slurm's nodes: read by both sources
    remote_python: str | None = None
    #: "dead": replace workers that died before the next cell (nbrpc._lifecycle.restart)
    restart: str | None = None
    #: the engine source's own options value, of whichever source was asked for (an
    #: nbrpc.Slurm, a Hosts, an Attached: see nbrpc._source_options), whether given as the
    #: value or as its flags/keywords (--nodes, --ssh-args, ...: the options part_of it);
    #: read it with options_of
    source_options: SourceOptions | None = None

    @classmethod
    def make(cls, n: int | None = None, /, **options: Any) -> Settings:
        """Defaults filled in and every argument checked; raises :class:`ConfigError`.

        What needs the engine source to work out (``--listen`` for ``--hosts``: the
        address on the route towards the first host) is completed by
        :func:`nbrpc._engines.resolve`.
        """
        opts = declared()
        unknown = sorted(set(options) - set(opts))
        if unknown:
            raise ConfigError(_checks.unknown(unknown[0], opts))
        if n is not None and options.get("n") is not None and options["n"] != n:
            raise ConfigError(f"n given twice: {n} and {options['n']}")
        v = {name: opt.default for name, opt in opts.items()}
        v.update(options)
        v["n"] = n if n is not None else v["n"]
        v["self_name"] = _checks.self_name(options.get("self_name"), opts["self_name"].default)
        return cls._checked(v)

    @classmethod
    def _checked(cls, v: dict[str, Any]) -> Settings:
        asked = source_options(v, declared())
        n, names, listen = where(v, asked)
        init_method, gpus, shm_threshold = v["init_method"], v["gpus"], v["shm_threshold"]
        if init_method:
            _group.spec_from_init_method(init_method)  # refuse a bad URL before any start
        if listen:
            _network.interface_for(listen)  # refuse an address this host lacks
        if gpus not in (None, "auto"):
            raise ConfigError(f"--gpus {gpus!r}: only 'auto' is supported (one GPU per process)")
        if shm_threshold is not None and shm_threshold < 1:
            raise ConfigError(
                f"shm_threshold must be a positive number of bytes or None, got {shm_threshold}"
            )
        process_group, members = _checks.process_group(v)
        threads, timeout = v["num_worker_threads"], v["rpc_timeout"]
        if threads is not None and threads < 1:  # 0 once meant the default, 16, unsaid
            raise ConfigError(
                f"--threads {threads}: each process needs at least 1 RPC thread "
                f"(default {DEFAULT_THREADS})"
            )
        if timeout is not None and timeout < 0:
            raise ConfigError(
                f"--timeout {timeout:g}: a timeout is seconds, 0 or more "
                f"(default {DEFAULT_RPC_TIMEOUT_S:g}; 0: none)"
            )
        if asked is not None and gpus is None:
            gpus = asked.implies().get("gpus")
        return cls(
            n=n,
            names=names,
            self_name=v["self_name"],
            num_worker_threads=int(threads or DEFAULT_THREADS),
            rpc_timeout=float(DEFAULT_RPC_TIMEOUT_S if timeout is None else timeout),
            init_method=init_method,
            progress=_checks.progress_mode(v["progress"]),
            listen=listen,
            gpus=gpus,
            device_maps=_devices.merge(v["self_name"], (v["device_maps"] or {}).items()),
            shm_threshold=shm_threshold,
            fast_calls=bool(v["fast_calls"]),
            python=v["python"] or sys.executable,
            process_group=process_group,
            process_group_workers=members,
            remote_python=v["remote_python"],
            restart=_checks.restart_mode(v["restart"]),
            source_options=asked,
        )

    def options_of(self, cls: type[Opts]) -> Opts | None:
        """The options value of ``cls``'s source, when these settings ask for that source."""
        return self.source_options if isinstance(self.source_options, cls) else None

    @property
    def slurm(self) -> Slurm | None:
        """The Slurm job asked for (``options_of(Slurm)``), read-only."""
        return self.options_of(Slurm)

    @property
    def attached(self) -> bool:
        """Engines of an ipyparallel cluster someone else started (not stopped by us)."""
        return self.options_of(Attached) is not None

    @property
    def wants_devices(self) -> bool:
        return bool(self.gpus or self.device_maps)

    def worker_names(self, count: int) -> list[str]:
        return list(self.names) if self.names else [f"worker{i}" for i in range(1, count + 1)]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
