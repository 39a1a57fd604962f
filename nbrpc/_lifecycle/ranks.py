"""Ranks as a script has them: 0 for the kernel, 1..N for the workers in naming order.

torch's own ids (``get_worker_info().id``) are that only in a kernel's first cluster: the
kernel's RPC agent joins once and keeps a connection per id for its life, so a later
cluster's workers take new ids (docs/architecture.md, "Ranks"). A worker keeps its rank
for its life: a restart and a scale leave it alone, and a grow gives a new worker the
lowest free one (``WorkerRecord.order``). A worker asks the kernel once; a scale tells
the workers that stay the new ranks (:func:`set_order`).
"""

from __future__ import annotations

from collections.abc import Iterable

from nbrpc import _group, _process, _states, _torch
from nbrpc._errors import UnknownWorkerError
from nbrpc._wire import output


def rank(name: str | None = None) -> int:
    """The rank a script would give process ``name`` (default: this one): 0 for the
    kernel, 1..N for the workers in the order they were named, in every cluster. Code that
    computes with ranks (``get_worker_info().id - 1``) uses ``nbrpc.rank()`` instead; on a
    worker it asks the kernel for the order once. Raises
    :class:`~nbrpc.NotInitializedError` when no cluster runs and
    :class:`~nbrpc.UnknownWorkerError` for a ``name`` that is not a process of it."""
    me = _process.name()
    name = me if name is None else name
    order = _order()
    if name not in order:
        raise UnknownWorkerError(name, list(order))
    return order[name]


def in_rank_order(names: Iterable[str]) -> list[str]:
    """``names`` (processes of the running cluster) sorted by :func:`rank`, the kernel
    first; a name without a rank (none should be) goes last, in the order given."""
    order = _order()
    return sorted(names, key=lambda name: (name not in order, order.get(name, 0)))


def members() -> list[str]:
    """Every process in the cluster's RPC group, live or not, in :func:`rank` order (the
    kernel first): torch's members, which it lists by its own ids, in join order."""
    return in_rank_order(_group.member_names())


def ranks_of_names() -> dict[str, int]:
    """The current cluster's processes and their ranks, the kernel first ({} for none, and
    in a worker: its cluster lives in the kernel)."""
    workers = _states.orders()
    return {_process.name(): 0, **workers} if workers else {}


def set_order(order: dict[str, int]) -> None:
    """Runs on a worker: the cluster's ranks changed (a scale)."""
    _asked_order.clear()
    _asked_order.update(order)


def _order() -> dict[str, int]:
    _group.require_active("nbrpc.rank()")
    order = ranks_of_names()
    if order:
        return order
    if not _asked_order:  # a worker: its cluster lives in the kernel
        _asked_order.update(_torch.rpc_sync(output.kernel_name(), ranks_of_names))
    return _asked_order


_asked_order: dict[str, int] = {}  # a worker's: asked once, then told at each scale
