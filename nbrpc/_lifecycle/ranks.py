"""Ranks as a script has them: 0 for the kernel, 1..N for the workers in naming order.

torch's own ids (``get_worker_info().id``) are that only in a kernel's first cluster: the
kernel's RPC agent joins once and keeps a connection per id for its life, so a later
cluster's workers take new ids (docs/architecture.md, "Ranks").
"""

from __future__ import annotations

from nbrpc import _group, _process, _torch
from nbrpc._errors import UnknownWorkerError
from nbrpc._wire import output

from .cluster import running


def rank(name: str | None = None) -> int:
    """The rank a script would give process ``name`` (default: this one): 0 for the
    kernel, 1..N for the workers in the order they were named, in every cluster. Code that
    computes with ranks (``get_worker_info().id - 1``) uses ``nbrpc.rank()`` instead; on a
    worker it asks the kernel for the order once."""
    me = _process.name()
    name = me if name is None else name
    order = _order()
    if name not in order:
        raise UnknownWorkerError(name, order)
    return order.index(name)


def names_in_order() -> list[str]:
    """The current cluster's processes, the kernel first, in naming order ([] for none)."""
    cluster = running()
    return [r.name for r in cluster.records] if cluster is not None else []


def _order() -> list[str]:
    _group.require_active("nbrpc.rank()")
    order = names_in_order()
    if order:
        return order
    if not _asked_order:  # a worker: its cluster lives in the kernel
        _asked_order.extend(_torch.rpc_sync(output.kernel_name(), names_in_order))
    return _asked_order


_asked_order: list[str] = []  # a worker's cluster does not change its names
