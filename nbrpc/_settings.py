"""What a cluster was asked for: one frozen object, validated once, before anything starts.

``nbrpc.init``, ``nbrpc.Cluster`` and ``%rpc_init`` all build their :class:`Settings`
through :meth:`Settings.make`, so defaults (``n`` above all) are worked out in one place
and bad input is refused with a :class:`~nbrpc.ConfigError` before a process starts.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from . import _devices, _group, _hosts, _shm
from ._errors import ConfigError
from ._progress import in_notebook

__all__ = [
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_THREADS",
    "DEFAULT_WORKERS",
    "Settings",
    "validate_names",
]

DEFAULT_WORKERS = 2  # a local cluster's size when neither n nor names say otherwise
DEFAULT_RPC_TIMEOUT_S = 60.0
DEFAULT_THREADS = 16
PROCESS_GROUP_BACKENDS = ("gloo", "nccl")


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


@dataclass(frozen=True)
class Settings:
    """A cluster's settings (see :func:`nbrpc.init` for what each one means)."""

    n: int | None  # None: every engine of an attached ipyparallel cluster
    names: tuple[str, ...] | None
    self_name: str
    num_worker_threads: int
    rpc_timeout: float
    init_method: str | None
    profile: str | None
    cluster_id: str | None
    progress: str  # "widget", "text" or "off"
    listen: str | None
    gpus: str | None
    #: the kernel's maps to workers, checked for syntax now, against devices at boot
    device_maps: _devices.Maps = field(default_factory=dict)
    shm_threshold: int | None = _shm.DEFAULT_THRESHOLD
    python: str = sys.executable
    #: a torch.distributed process group among the workers ("gloo" or "nccl"), and which
    #: workers are in it, in rank order (None: all of them)
    process_group: str | None = None
    process_group_workers: tuple[str, ...] | None = None
    #: workers on other hosts over ssh, one per entry in order (see :mod:`nbrpc._hosts`)
    hosts: tuple[str, ...] | None = None
    ssh_args: tuple[str, ...] = ()
    remote_python: str | None = None

    @classmethod
    def make(
        cls,
        n: int | None = None,
        *,
        names: list[str] | None = None,
        self_name: str = "worker0",
        num_worker_threads: int | None = None,
        rpc_timeout: float | None = None,
        init_method: str | None = None,
        profile: str | None = None,
        cluster_id: str | None = None,
        progress: str | bool = "auto",
        listen: str | None = None,
        gpus: str | None = None,
        device_maps: dict[str, dict] | None = None,
        shm_threshold: int | None = _shm.DEFAULT_THRESHOLD,
        python: str | None = None,
        process_group: str | None = None,
        process_group_workers: list[str] | None = None,
        hosts: str | list[str] | None = None,
        ssh_args: str | list[str] | None = None,
        remote_python: str | None = None,
    ) -> Settings:
        """Defaults filled in and every argument checked; raises :class:`ConfigError`."""
        attached = profile is not None or cluster_id is not None
        clean = tuple(s.strip() for s in names) if names else None
        entries = _hosts.parse_hosts(hosts) if hosts is not None else None
        extra = tuple(shlex.split(ssh_args) if isinstance(ssh_args, str) else ssh_args or ())
        if entries is None and (extra or remote_python):
            raise ConfigError("--ssh-args and --remote-python go with --hosts")
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
            if clean is not None and len(clean) != len(entries):
                raise ConfigError(
                    f"{len(clean)} names for {len(entries)} --hosts entries: give one name per "
                    "entry (a host listed twice gets two workers)"
                )
            n = len(entries)
            if not listen:
                listen = _hosts.infer_listen(entries[0], extra)
            elif _group.is_loopback(listen):
                raise ConfigError(
                    f"--listen {listen} with --hosts: workers on other hosts cannot reach this "
                    "host's loopback. Give an address they reach (or leave --listen out: it "
                    "is worked out from the route towards the first host)."
                )
        if init_method and not listen:
            listen = _group.listen_of_init_method(init_method)
        if clean is not None:
            if n is not None and n != len(clean):
                raise ConfigError(f"-n {n} does not match {len(clean)} names: {list(clean)}")
            n = len(clean)
        if n is None and not attached:
            n = DEFAULT_WORKERS
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ConfigError(f"-n must be at least 1, got {n}")
        validate_names(clean or (), self_name)
        if init_method:
            _group.spec_from_init_method(init_method)  # refuse a bad URL before any start
        if listen:
            _group.interface_for(listen)  # refuse an address this host lacks
        if gpus not in (None, "auto"):
            raise ConfigError(f"--gpus {gpus!r}: only 'auto' is supported (one GPU per process)")
        if shm_threshold is not None and shm_threshold < 1:
            raise ConfigError(
                f"shm_threshold must be a positive number of bytes or None, got {shm_threshold}"
            )
        if process_group is not None and process_group not in PROCESS_GROUP_BACKENDS:
            raise ConfigError(
                f"--process-group {process_group!r}: use gloo (CPU tensors, any host) or nccl "
                "(CUDA tensors, a GPU per worker)"
            )
        members = tuple(s.strip() for s in process_group_workers or () if s.strip()) or None
        if members is not None:
            if process_group is None:
                raise ConfigError(
                    "--process-group-workers needs --process-group gloo (or nccl) as well"
                )
            if len(set(members)) != len(members):
                raise ConfigError(f"--process-group-workers lists a worker twice: {members}")
        if progress == "auto":
            progress = "widget" if in_notebook() else "off"
        mode = {True: "text", False: "off"}[progress] if isinstance(progress, bool) else progress
        if mode not in ("widget", "text", "off"):
            raise ConfigError(f"progress={progress!r}: use 'auto', 'widget', 'text' or 'off'")
        return cls(
            n=n,
            names=clean,
            self_name=self_name,
            num_worker_threads=int(num_worker_threads or DEFAULT_THREADS),
            rpc_timeout=float(DEFAULT_RPC_TIMEOUT_S if rpc_timeout is None else rpc_timeout),
            init_method=init_method,
            profile=profile,
            cluster_id=cluster_id,
            progress=mode,
            listen=listen,
            gpus=gpus,
            device_maps=_devices.merge(self_name, (device_maps or {}).items()),
            shm_threshold=shm_threshold,
            python=python or sys.executable,
            process_group=process_group,
            process_group_workers=members,
            hosts=entries,
            ssh_args=extra,
            remote_python=remote_python,
        )

    @property
    def attached(self) -> bool:
        """Engines of an ipyparallel cluster someone else started (not stopped by us)."""
        return self.profile is not None or self.cluster_id is not None

    @property
    def host_plan(self) -> _hosts.HostPlan | None:
        if self.hosts is None:
            return None
        return _hosts.HostPlan(self.hosts, self.ssh_args, self.remote_python or "")

    @property
    def wants_devices(self) -> bool:
        return bool(self.gpus or self.device_maps)

    def worker_names(self, count: int) -> list[str]:
        return list(self.names) if self.names else [f"worker{i}" for i in range(1, count + 1)]

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
