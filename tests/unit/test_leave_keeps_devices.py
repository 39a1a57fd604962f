"""A member told by a leaver's own message that it left keeps its devices and its reply
maps to the others (``nbrpc._torch.group``'s membership update; issue 63's risk 2)."""

import torch
from torch.distributed.rpc import WorkerInfo

from nbrpc import _torch
from nbrpc._torch import group


def test_a_leavers_empty_message_keeps_this_process_s_devices_and_other_maps():
    """torch's graceful leave sends every member ``(info, [], {}, False)``, and the agent
    keeps only what it is handed: on an H200, 110 of 3,228 CUDA replies made while a
    cluster shrank failed with "only supports CPU tensors" until the kernel gave the maps
    back. Now the member's own devices and maps (less the leaver's) go in its place."""
    seen = []
    update = group.counted_update(lambda *args: seen.append(args))
    kept = (["cuda:0"], {"worker0": {"cuda:0": "cuda:0"}})
    ours = group.keep_through_leaves(lambda info: kept)
    try:
        before = _torch.membership_changes()
        update(WorkerInfo("worker3", 3), [], {}, False)
    finally:
        group.keep_through_leaves(ours)
    ((info, devices, replies, is_join),) = seen
    assert (info.name, is_join) == ("worker3", False)
    assert devices == [torch.device("cuda:0")]
    assert replies["worker0"] == {torch.device("cuda:0"): torch.device("cuda:0")}
    assert _torch.membership_changes() == before + 1
    # a join, or a leave that hands something, goes to torch as it came
    update(WorkerInfo("worker4", 4), [torch.device("cpu")], {}, True)
    assert seen[-1][1:] == ([torch.device("cpu")], {}, True)
    update(WorkerInfo("worker4", 4), [torch.device("cpu")], {}, False)
    assert seen[-1][1:] == ([torch.device("cpu")], {}, False)


def test_nbrpc_keeps_what_it_holds_less_the_leaver_s_maps():
    """What ``nbrpc._group`` answers (its devices, its reply maps but the leaver's); a CPU
    process keeps nothing, so torch's leave is unchanged there."""
    import nbrpc._group  # noqa: F401  (it installs what it keeps)

    ours = group.keep_through_leaves(None)
    group.keep_through_leaves(ours)
    assert ours is not None
    assert ours.__module__ == "nbrpc._group"
    devices, replies = group.kept_through_leave(WorkerInfo("worker3", 3))
    assert devices == []  # this process joined no cluster with CUDA
    assert replies == {}
