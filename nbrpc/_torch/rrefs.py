"""RRef internals: forks, ids, creation futures, counts and torch's own methods.

torch has no public accessor for an RRef's id, its fork data or its creation future; the
ledger (who owns which remote object) and the RRef paths of calls use these.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_rpc import (
    PyRRef as PyRRef,
    _delete_all_user_and_unforked_owner_rrefs,
    _rref_context_get_debug_info,
)

# the default of every ``timeout`` torch's calls take: "the agent's default"
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT as UNSET_RPC_TIMEOUT

from .wording import UNKNOWN_DESTINATION

#: torch's own methods of ``PyRRef`` that :func:`patch_rref_method` replaced, by name
_rref_methods: dict[str, Any] = {}

#: how torch's RRef repr names its id (torch has no accessor)
RREF_ID = re.compile(r"created_on=(\d+), local_id=(\d+)")


def rref_fork(rref: PyRRef) -> tuple:
    """The fork data torch pickles an RRef as (registers a fork with its owner)."""
    return rref._serialize()


def rref_from_fork(fork_data: tuple) -> PyRRef:
    """The receiving side of :func:`rref_fork` (what torch's unpickler does)."""
    return PyRRef._deserialize(fork_data)


def rref_type_future(rref: PyRRef) -> Any:
    """A future of the value's type; a user RRef asks its owner once and caches it."""
    return original_get_type(rref, blocking=False)


def original_get_type(
    rref: PyRRef, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True
) -> Any:
    """torch's own ``RRef._get_type`` (the value's type, or with ``blocking=False`` a future
    of it; a handle keeps the first answer), also after :func:`patch_rref_method` replaced
    it. torch's RRef proxies (``rref.rpc_sync().f()`` & co.) ask it before every call."""
    get_type = _rref_methods.get("_get_type", PyRRef._get_type)
    return get_type(rref, timeout=timeout, blocking=blocking)


#: The creation futures of the user RRefs this process's ``remote()`` made, by handle.
#: torch's ``RRef._get_future()`` has one only for those: on any other RRef (one a call
#: returned, a fork received in arguments) it dereferences a null future and the process
#: dies (SIGSEGV). So it is asked once, right after ``remote()``, and never again.
_creations: weakref.WeakKeyDictionary[PyRRef, Any] = weakref.WeakKeyDictionary()


def remember_creation(rref: PyRRef) -> None:
    """Keep the creation future of ``rref``, which this process's ``remote()`` returned."""
    if not rref.is_owner():
        _creations[rref] = rref._get_future()


def rref_creation_future(rref: PyRRef) -> Any:
    """The future of a user RRef's creation by ``remote()`` in this process, done once the
    owner holds the value (or failed to make it); None for any other RRef."""
    return _creations.get(rref)


def rref_id(rref: PyRRef) -> str:
    """torch's globally unique RRef id as ``"created_on:local_id"``, read from its repr
    (torch has no accessor; ranks are unique in nbrpc's groups)."""
    match = RREF_ID.search(str(rref))
    return f"{match.group(1)}:{match.group(2)}" if match else str(rref)


def owned_rref_count() -> int:
    """How many RRefs this process owns that some process still references."""
    return int(_rref_context_get_debug_info().get("num_owner_rrefs", 0))


def pending_user_rrefs() -> int:
    """How many user RRefs of this process wait for their owner's confirmation (one just
    made by ``remote()`` or forked, or one whose owner died first: that one waits for good)."""
    return int(_rref_context_get_debug_info().get("num_pending_users", 0))


def delete_user_rrefs(timeout_s: float) -> None:
    """Delete this process's user RRefs, telling their owners (torch's static-group
    shutdown does this; its dynamic leave does not)."""
    _delete_all_user_and_unforked_owner_rrefs(timedelta(seconds=timeout_s))


def patch_rref_method(name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``PyRRef.NAME`` (a pybind11 class, so every RRef handle); idempotent."""
    if name not in _rref_methods:
        _rref_methods[name] = getattr(PyRRef, name)
    setattr(PyRRef, name, replacement)


def original_owner(rref: PyRRef) -> Any:
    """torch's own ``RRef.owner``, also after :func:`patch_rref_method` replaced it."""
    return _rref_methods.get("owner", PyRRef.owner)(rref)


def original_to_here(rref: PyRRef, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """torch's own ``RRef.to_here``, also after :func:`patch_rref_method` replaced it."""
    return _rref_methods.get("to_here", PyRRef.to_here)(rref, timeout)


def owner_name(rref: PyRRef) -> str | None:
    """The name of an RRef's owner; ``None`` when it left the group (torch raises)."""
    try:
        return rref.owner_name()
    except RuntimeError as exc:
        if UNKNOWN_DESTINATION in str(exc):
            return None
        raise
