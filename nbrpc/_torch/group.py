"""The process's RPC agent, the dynamic group's membership and TensorPipe's options.

nbrpc's kernel stays in its dynamic group across clusters, and edits the group when a
worker dies or leaves; these are the private names it does that with.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed.rpc as rpc
import torch.distributed.rpc._utils as rpc_utils
import torch.distributed.rpc.api as rpc_api
import torch.distributed.rpc.backend_registry as backend_registry
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

from .calls import patch_api

# -- the current agent ---------------------------------------------------------------------


#: ``agent()``: this process's RPC agent (torch keeps it in a private module global); its
#: own function, asked on every call (no frame of ours around it)
agent: Callable[[], Any] = rpc_api._get_current_rpc_agent


def agent_is_set() -> bool:
    return rpc_api._is_current_rpc_agent_set()


def set_rpc_timeout(seconds: float) -> None:
    """The default timeout of later calls (torch's setter is private)."""
    rpc._set_rpc_timeout(seconds)


def leave_group(timeout: float = 0) -> None:
    """torch's own graceful shutdown; on a dynamic group it is a leave."""
    rpc_api.shutdown(graceful=True, timeout=timeout)


# -- the dynamic group's membership -------------------------------------------------------

GROUP_TOKEN_KEY = "RpcGroupManagementToken"  # the key of the join/leave critical section
MEMBER_LIST_KEY = "_ALL_WORKER_INFOS"  # under the "names" prefix: "name-id," entries


#: what a process keeps when told a peer left: its devices and its reply maps to the others
Kept = tuple[list[str], dict[str, dict[str, str]]]


class _Changes:
    """How many times this process's agent was told a peer joined or left, and what it
    keeps through a leave (:func:`keep_through_leaves`)."""

    count = 0
    keeps: Callable[[Any], Kept] | None = None


_changes = _Changes()


def keep_through_leaves(keeps: Callable[[Any], Kept] | None) -> Callable[[Any], Kept] | None:
    """``keeps(info)``: the devices and reply maps this process keeps when told ``info``
    left (``nbrpc._group``: its own, less the leaver's); the one it replaces."""
    before, _changes.keeps = _changes.keeps, keeps
    return before


def kept_through_leave(info: Any) -> Kept:
    """What this process keeps when told ``info`` left (nothing: torch's leave)."""
    return ([], {}) if _changes.keeps is None else _changes.keeps(info)


def counted_update(update: Callable[..., Any]) -> Callable[..., Any]:
    """torch's membership update, counted (:func:`membership_changes`) once it is done: a
    lookup made meanwhile is looked up again. A leaver's own message (torch's graceful
    leave, ``%rpc_scale`` down) hands each member no devices and no reply maps, and the
    member's agent drops all it has: until the kernel gave them back
    (``nbrpc._setup.device_replies``, a round later) a reply holding a CUDA tensor failed
    with torch's "only supports CPU tensors" (110 of 3,228 calls on an H200, issue 63's
    risk 2), and a CUDA message found no stream. The member keeps its own instead."""

    @functools.wraps(update)  # torch's module and name: sent by name, found by name
    def _update_group_membership(
        info: Any, devices: Any, replies: Any, is_join: bool, *args: Any, **kwargs: Any
    ) -> Any:
        if not is_join and not devices and not replies:
            devices, replies = _as_devices(*kept_through_leave(info))
        try:
            return update(info, devices, replies, is_join, *args, **kwargs)
        finally:
            _changes.count += 1

    return _update_group_membership


def _as_devices(devices: list[str], replies: dict[str, dict[str, str]]) -> tuple[list, dict]:
    """Device names as ``torch.device``s, as the agent's membership update takes them."""
    import torch

    return [torch.device(d) for d in devices], {
        peer: {torch.device(k): torch.device(v) for k, v in mapping.items()}
        for peer, mapping in replies.items()
    }


#: The function torch's join and leave run on every member, by name (nbrpc's leave on a
#: worker's behalf runs :func:`forget_locally` there instead, which keeps the peer's
#: devices), counted. Every module of torch's that holds it holds the counted one: a
#: function sent by name must be the one its module holds, or the pickler sends it whole.
update_group_membership = counted_update(rpc_utils._update_group_membership)
for _holder in (rpc_utils, rpc_api, backend_registry):
    _holder._update_group_membership = update_group_membership  # type: ignore[attr-defined]


def forget_locally(
    info: Any, devices: list[str] | None = None, replies: dict | None = None
) -> None:
    """What :data:`update_group_membership` does, in this process: ``info`` left. It keeps
    ``devices`` and the reply maps ``replies`` (peer -> {device: the peer's}), and drops
    every other (torch's own leave message keeps none)."""
    agent()._update_group_membership(info, *_as_devices(devices or [], replies or {}), False)
    _changes.count += 1


def membership_changes() -> int:
    """How many times this process's agent was told a peer joined or left, so far. A
    ``WorkerInfo`` looked up before the last change may name a process that is gone: a
    restarted or re-added worker has a new id under its old name, and a worker that had
    called the old one kept calling it (EPIPE, for good). torch tells each member by
    running ``_update_group_membership`` there."""
    return _changes.count


def hold_devices(devices: list[str], replies: dict[str, dict[str, str]]) -> None:
    """Give this process's agent back its CUDA devices and the maps its replies go by
    (``replies``: peer -> {this process's device: the peer's}), where missing.

    torch's dynamic group loses both. A leave tells every member to drop every device and
    every reply map (``updateGroupMembership(..., isJoin=false)`` keeps only those it is
    handed, and it is handed none). A join hands each member the *joiner's* reply maps
    (keyed by the other members), so no member learns how to reply to the joiner, and a
    reply holding a CUDA tensor to it failed with "Response device mapping is not
    available". Worse, a key it had may hold another pair's map (with several GPUs, a
    wrong one). So first a leave's update of a worker that never was (a name and id no
    member has: only the maps go, ``devices`` stay), then a join's update with this
    process's own name, which adds what it is handed and changes nothing else."""
    me = agent()
    mine, maps = _as_devices(devices, replies)
    me._update_group_membership(rpc.WorkerInfo(_NOBODY, -1), mine, {}, False)
    me._update_group_membership(me.get_worker_info(), mine, maps, True)


#: the name of the worker that never was (:func:`hold_devices`): no process takes it
_NOBODY = "nbrpc-no-such-worker"


# -- the kernel's devices, lent cluster by cluster -------------------------------------------

#: torch's functions of a dynamic join that decide a process's devices: its own list
#: (from its maps, at its join) and what a joiner learns of every member's maps
LENDING_HOOKS = ("_create_device_list", "_get_device_infos")


def can_lend_devices() -> bool:
    """Whether this torch has the functions :func:`devices_withheld` and
    :func:`advertise_devices` replace (torch 2's dynamic groups)."""
    return all(callable(getattr(backend_registry, name, None)) for name in LENDING_HOOKS)


@contextlib.contextmanager
def devices_withheld() -> Iterator[None]:
    """While this process joins: its agent's device list stays empty though its options
    hold device maps (torch derives the list from them, and an agent with devices takes
    CUDA streams for every message it reads, which brings CUDA up in the process).
    :func:`hold_devices` lends the devices later, when a cluster uses them."""
    saved = backend_registry._create_device_list
    backend_registry._create_device_list = lambda *args, **kwargs: []
    try:
        yield
    finally:
        backend_registry._create_device_list = saved


def advertise_devices(current: Callable[[], tuple[dict, list]]) -> None:
    """What a joining worker learns of this process's maps and devices is ``current()``
    (``({worker: {this process's device: the worker's}}, [devices])``), not the maps its
    options hold. torch's joiner asks every member (``_get_device_infos``, run on the
    member): it derives from the answer how it replies to the member and which devices
    both need, so a CPU cluster's workers, told no maps, start no CUDA."""
    import torch

    def _get_device_infos() -> tuple[int, dict, list]:
        maps, devices = current()
        return (
            torch.cuda.device_count(),
            {
                dest: {torch.device(k): torch.device(v) for k, v in mapping.items()}
                for dest, mapping in maps.items()
            },
            [torch.device(d) for d in devices],
        )

    backend_registry._get_device_infos = _get_device_infos


#: torch's ``_all_gather`` (the collective its RPC layer builds barriers with), as it was
_torch_all_gather = rpc_api._all_gather


def route_all_gather(members: Callable[[], list[str]]) -> None:
    """``torch.distributed.rpc.api._all_gather`` without names gathers over ``members()``
    (idempotent). torch defaults to ``_ALL_WORKER_NAMES``, the processes a process saw when
    it joined: in a dynamic group the kernel saw only itself, and a gather hung."""

    def _all_gather(obj: Any, worker_names: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _torch_all_gather(obj, worker_names or set(members()), timeout)

    patch_api("_all_gather", _all_gather)


def reset_all_gather() -> None:
    """A new cluster's gathers count from 0 in every process, as its fresh workers do:
    torch numbers them per set of names, and a kernel that re-runs reuses the names."""
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()
        rpc_api._all_gather_sequence_id_to_states.clear()


# -- TensorPipe ----------------------------------------------------------------------------

#: TensorPipe reads this variable when an agent is created: the interface it listens on.
TP_SOCKET_IFNAME = "TP_SOCKET_IFNAME"
#: gloo's equivalent, read when a process group is created.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"


def tensorpipe_options(transports: list[str], channels: list[str], **kwargs: Any) -> Any:
    """``TensorPipeRpcBackendOptions`` with transport and channel lists (private arguments)."""
    return rpc.TensorPipeRpcBackendOptions(_transports=transports, _channels=channels, **kwargs)


# -- DistributedDataParallel -------------------------------------------------------------


def guard_ddp(check: Callable[[Any], None]) -> None:
    """``DistributedDataParallel.forward`` calls ``check(module.process_group)`` first
    (idempotent): nbrpc refuses a module whose process group it destroyed, which would
    otherwise wait in its first collective for peers that left that group."""
    from torch.nn.parallel import DistributedDataParallel

    forward = DistributedDataParallel.forward
    if getattr(forward, "_nbrpc_guard", None) is not None:
        forward._nbrpc_guard[0] = check  # type: ignore[attr-defined]
        return
    guard = [check]

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard[0](self.process_group)
        return forward(self, *args, **kwargs)

    guarded._nbrpc_guard = guard  # type: ignore[attr-defined]
    DistributedDataParallel.forward = guarded  # type: ignore[method-assign]
