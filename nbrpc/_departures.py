"""Workers out of the dynamic group on their behalf: a dead one, a half-joined one, one
whose leave failed half way.

torch's own leave (:func:`nbrpc._group.leave`) tells every member, removes the worker's
name from the group's list in the store and frees the group's join/leave token. A worker
that cannot do it itself (killed, stopped by the stop button in the middle of its join,
failed in the middle of its leave) leaves those undone: its name blocks a new worker of
that name ("not unique"), a stale entry in a peer makes that peer's own later leave fail,
and a kept token makes every later join and leave wait until its timeout. The kernel does
each step here instead, as torch's messages and store edits do.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import _group, _torch


def forget(dead: list[str], live: list[str]) -> None:
    """Tell this process and the ``live`` peers that the ``dead`` workers left the group.

    A killed worker cannot say so itself, and torch's leave notifies every member it
    knows: a live worker's leave would fail on the dead peer, and torch would then never
    release the group's join/leave token, blocking every later join. So nbrpc sends,
    on the dead worker's behalf, the message torch's own leave sends.
    """
    agent = _torch.agent()
    infos = {w.name: w for w in agent.get_worker_infos()}
    for name in dead:
        info = infos.get(name)
        if info is None:
            continue
        for peer in live:
            _tell_left(peer, info)
        _group.forget_peer(info)
        _remove_from_member_list(agent.store, info.name, info.id)


def tell_peers_left(ranks: dict[str, int], live: list[str]) -> None:
    """Tell the ``live`` peers that the workers of ``ranks`` (name -> rank) left, whether
    or not this process knows them (a grow stopped half way, a leave that failed half
    way). A join or a leave tells the members one by one, so a peer may know one the
    kernel does not; that stale entry made the peer's own later leave fail on it (EPIPE,
    its name left in torch's list: the next worker of a new grow then waited 90 s to
    reach it)."""
    for name, rank in ranks.items():
        info = rpc.WorkerInfo(name, rank)
        for peer in live:
            with contextlib.suppress(Exception):  # a peer that died meanwhile
                _tell_left(peer, info)


def _tell_left(peer: str, info: rpc.WorkerInfo) -> None:
    """What torch's own leave tells each member, ``info`` left the group, but the member
    keeps its CUDA devices and its other reply maps (:func:`nbrpc._group.forget_peer`)."""
    _torch.rpc_sync(peer, _group.forget_peer, args=(info,), timeout=10)


def forget_names(names: list[str]) -> None:
    """After a failed boot: drop ``names`` from the group, joined or half joined.

    A worker whose join failed half way (it listed its name, took torch's join token, then
    could not reach a peer) is unknown to the kernel's agent, yet its name would block a
    new worker of that name ("not unique") and its token every later join and leave.
    """
    agent = _torch.agent()
    infos = {w.name: w for w in agent.get_worker_infos()}
    for name in names:
        if name in infos and name != _group.joined_name():
            _group.forget_peer(infos[name])
        _remove_from_member_list(agent.store, name, None)
    release_stale_token()


def _remove_from_member_list(store: dist.Store, name: str, worker_id: int | None) -> None:
    """What torch's ``removeCurrentName`` does on a graceful leave, for a dead worker.

    torch lists a dynamic group's members as ``"name-id,"`` entries under
    ``names/_ALL_WORKER_INFOS``; a joining worker refuses a name already listed, so a dead
    worker's entry would block a new worker of the same name.
    """
    names = dist.PrefixStore("names", store)
    if not names.check([_torch.MEMBER_LIST_KEY]):
        return
    listed = names.get(_torch.MEMBER_LIST_KEY).decode()
    entries = listed.split(",")
    kept = [
        e
        for e in entries
        if not (e.rpartition("-")[0] == name and (worker_id is None or e == f"{name}-{worker_id}"))
    ]
    if kept != entries:
        names.set(_torch.MEMBER_LIST_KEY, ",".join(kept))


def release_stale_token() -> None:
    """After every worker is gone, free torch's join/leave token if a failed join or leave
    kept it. Processes already waiting for it wait on the holder's own key
    (``Token_for_<name>_join``), so that is marked done as torch's own release does."""
    store = _torch.agent().store
    held = (
        store.get(_torch.GROUP_TOKEN_KEY).decode() if store.check([_torch.GROUP_TOKEN_KEY]) else ""
    )
    store.set(_torch.GROUP_TOKEN_KEY, "")
    if held:
        store.set(held, "Done")
