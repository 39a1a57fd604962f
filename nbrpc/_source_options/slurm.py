"""The Slurm source's options (``--slurm``): :class:`Slurm`, exported as ``nbrpc.Slurm``.

Its flags (``--nodes``, ``--partition``, ``--time``, ``--gpus-per-node``,
``--sbatch-args``, ``--queue-timeout``) are declared in :mod:`nbrpc._options`, each
``part_of`` a field here; the source that reads it is :mod:`nbrpc._engines.slurm`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nbrpc import _network
from nbrpc._errors import ConfigError
from nbrpc._placement import SourceOptions, split_args


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
    remote = True  # --remote-python names the nodes' interpreter

    nodes: int | None = None
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    args: tuple[str, ...] = ()
    queue_timeout: float | None = None

    def sbatch_options(self, n: int) -> list[str]:
        """The ``sbatch`` (and ``srun``) options for ``n`` tasks. Raises nothing."""
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
        """The job of ``slurm=True`` and its flat options (``--sbatch-args`` as one text):
        ``parts`` maps this class's fields to the values given. Raises ``TypeError`` for a
        name that is not a field."""
        args = split_args(parts.get("args"))
        return cls(**{**parts, "args": args})

    def check(self, v: dict[str, Any]) -> None:
        """Refuse, before anything starts, what Slurm cannot be asked for: ``v`` holds the
        cluster's other options by name (``hosts``, ``profile``, ``listen``, ...). Raises
        :class:`~nbrpc.ConfigError` for ``--hosts`` or ``--profile`` beside ``--slurm``,
        a ``nodes`` under 1, a negative ``gpus_per_node``, a ``queue_timeout`` that is not
        positive, a ``time`` Slurm cannot read, and a loopback ``--listen``."""
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
        if (v["listen"] or "") and _network.is_loopback(v["listen"]):
            raise ConfigError(
                f"--listen {v['listen']} with --slurm: workers on the cluster's nodes cannot "
                "reach this host's loopback. Give an address they reach (or leave --listen "
                "out: it is worked out from the route towards Slurm's controller)."
            )

    def implies(self) -> dict[str, Any]:
        """GPUs per node: a GPU per worker, by its rank on the node, maps for all pairs
        (the options a ``gpus_per_node`` implies: ``gpus="auto"``). Raises nothing."""
        return {"gpus": "auto"} if self.gpus_per_node else {}
