"""Each option's value checked on its own, before a cluster's settings are made
(``nbrpc._options.Settings``): an unknown option with the nearest one, the kernel's name,
the workers' process group, the restart and progress modes. Each refusal is a
:class:`~nbrpc.ConfigError` that names the option and a value that works."""

from __future__ import annotations

from typing import Any

from . import _group, _process
from ._errors import ConfigError

#: The backends of the workers' torch.distributed process group (--process-group)
PROCESS_GROUP_BACKENDS = ("gloo", "nccl")


def unknown(name: str, opts: dict[str, Any]) -> str:
    """The error for an option nobody declared, with the nearest one (by its name, or by
    its ``%rpc_init`` flag: ``threads`` is ``num_worker_threads``); ``opts``: every
    option's declaration (``nbrpc._options.declared()``)."""
    import difflib

    by_flag = {o.flag.lstrip("-").replace("-", "_"): n for n, o in opts.items() if o.flag}
    names = {**{n: n for n in opts}, **by_flag}
    near = difflib.get_close_matches(name, list(names), n=1)
    hint = ""
    if near:
        option = names[near[0]]
        flag = opts[option].flag
        hint = f": did you mean {option!r}" + (f" (%rpc_init {flag})?" if flag else "?")
    return f"unknown option {name!r}{hint} The options are in docs/options.md."


def self_name(asked: str | None, default: str) -> str:
    """The kernel's name: torch fixes a process's name when it first joins, so once this
    kernel joined, it keeps that name without being asked again (a different --self is
    refused as a cluster starts, before anything is drawn: ``_group.check_kernel_name``)."""
    if asked is not None:
        return asked
    joined = _group.current_kernel_membership()
    return joined.name if joined is not None else default


def process_group(v: dict[str, Any]) -> tuple[str | None, tuple[str, ...] | None]:
    """The workers' process group: its backend and members, checked."""
    backend = v["process_group"]
    if backend is not None and backend not in PROCESS_GROUP_BACKENDS:
        raise ConfigError(
            f"--process-group {backend!r}: use gloo (CPU tensors, any host) or nccl "
            "(CUDA tensors, a GPU per worker)"
        )
    members = tuple(s.strip() for s in v["process_group_workers"] or () if s.strip()) or None
    if members is not None:
        if backend is None:
            raise ConfigError(
                "--process-group-workers needs --process-group gloo (or nccl) as well"
            )
        if len(set(members)) != len(members):
            raise ConfigError(f"--process-group-workers lists a worker twice: {members}")
    return backend, members


def restart_mode(restart: str | None) -> str | None:
    if restart not in (None, "dead"):
        raise ConfigError(f"restart={restart!r}: use 'dead' (replace workers that died) or None")
    return restart


def progress_mode(progress: str | bool) -> str:
    if progress == "auto":
        progress = "widget" if _process.in_notebook() else "off"
    mode = {True: "text", False: "off"}[progress] if isinstance(progress, bool) else progress
    if mode not in ("widget", "text", "off"):
        raise ConfigError(f"progress={progress!r}: use 'auto', 'widget', 'text' or 'off'")
    return mode
