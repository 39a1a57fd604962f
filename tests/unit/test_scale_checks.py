"""What ``%rpc_scale`` refuses before anything changes, and the names and ranks it hands
out (``nbrpc._lifecycle.scale_checks``; no workers needed: a pretend cluster's records)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nbrpc import _process
from nbrpc._engines.base import EngineSource
from nbrpc._engines.local import LocalSource
from nbrpc._errors import ConfigError
from nbrpc._lifecycle import scale, scale_checks
from nbrpc._options import Settings
from nbrpc._rows import WorkerRecord, WorkerState


class _Local(EngineSource):
    """A source that scales and places no engine on hosts (the base's check_hosts)."""

    cannot_scale = ""

    def __init__(self) -> None:
        pass


def _cluster(
    n: int = 3, *, devices: bool = False, backend: str | None = None, source=None, dead=()
):
    settings = Settings.make(n, device_maps={"worker1": {"cuda:0": "cuda:0"}} if devices else None)
    records = [WorkerRecord("worker0", 0, 1, "h", "kernel")] + [
        WorkerRecord(f"worker{i}", i, 100 + i, "h", f"engine {i}", order=i) for i in range(1, n + 1)
    ]
    for record in records:
        if record.name in dead:
            record.state = WorkerState.DEAD
    pg = {"backend": backend, "ranks": {}} if backend else None
    return SimpleNamespace(
        dead_workers=lambda: [r.name for r in records if r.state is WorkerState.DEAD],
        settings=settings,
        records=records,
        booted=SimpleNamespace(process_group=pg),
        engines=SimpleNamespace(
            source=source
            or SimpleNamespace(
                cannot_scale="",
                check_hosts=EngineSource.check_hosts.__get__(SimpleNamespace()),
                check_room=LocalSource.check_room,
            )
        ),
    )


def _check(cluster, n=None, remove=(), names=None, hosts=()):
    return scale_checks.check(cluster, cluster.records[1:], n, list(remove), names, hosts)


def test_the_highest_ranks_leave_first_or_the_named_ones():
    c = _cluster(4)
    leavers, count = _check(c, 2)
    assert [r.name for r in leavers] == ["worker3", "worker4"]
    assert count == 0
    leavers, count = _check(c, remove=["worker2"])
    assert [r.name for r in leavers] == ["worker2"]
    assert _check(c, 6) == ([], 2)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"n": 0}, "keeps at least 1 worker"),
        ({}, "say the new size"),
        ({"remove": ["worker9"]}, "worker9: worker9 is not a worker of this cluster"),
        ({"remove": ["worker8", "worker9"]}, "worker8, worker9 are not workers of this cluster"),
        ({"remove": ["worker1", "worker1"]}, "a name is given twice"),
        ({"n": 1, "remove": ["worker1"]}, "leaves 2, not 1"),
        ({"n": 5, "names": ["a"]}, "1 name for 2 new workers"),
        ({"n": 4, "names": ["a", "b"]}, "2 names for 1 new worker$"),
        ({"n": 4, "names": ["worker2"]}, "worker2 is already a worker of this cluster"),
        ({"n": 3, "names": ["a"]}, "adds none"),
        ({"n": 4, "hosts": ("h3",)}, "only a cluster started with --hosts"),
    ],
)
def test_bad_input_is_refused_before_anything_changes(kw, says):
    with pytest.raises(ConfigError, match=says):
        _check(_cluster(3), **kw)


def test_the_kernel_named_as_a_worker_is_called_the_kernel(monkeypatch):
    """``%rpc_scale --remove worker0`` said the kernel was "not workers of this cluster"."""
    monkeypatch.setattr(_process, "name", lambda: "worker0")
    with pytest.raises(ConfigError) as refused:
        _check(_cluster(3), remove=["worker0", "worker9"])
    said = str(refused.value)
    assert "worker0 is the kernel (this notebook's own process), not a worker" in said, said
    assert "worker9 is not a worker of this cluster" in said, said
    assert "the kernel cannot leave its own cluster" in said, said


def test_a_grow_beside_a_dead_worker_is_refused_naming_it_and_the_fixes():
    c = _cluster(3, dead=("worker2",))
    with pytest.raises(ConfigError) as refused:
        _check(c, 4)
    said = str(refused.value)
    assert "worker2 is dead" in said
    assert "%rpc_restart worker2" in said
    assert "%rpc_scale --remove worker2" in said
    assert [r.name for r in _check(c, remove=["worker2"])[0]] == ["worker2"]  # a shrink goes on


def test_a_grow_this_host_cannot_hold_is_refused_with_its_figures():
    with pytest.raises(ConfigError) as refused:
        _check(_cluster(2), 100_000)
    said = str(refused.value)
    assert said.startswith("99998 workers do not fit on this host")
    assert "available of" in said
    assert "room for at most" in said
    assert "--hosts" in said


def test_device_maps_refuse_a_grow_but_not_a_shrink():
    c = _cluster(3, devices=True)
    with pytest.raises(ConfigError, match="cannot grow a cluster with device maps"):
        _check(c, 4)
    assert [r.name for r in _check(c, 2)[0]] == ["worker3"]


def test_a_source_that_cannot_scale_and_a_group_that_cannot_be_rebuilt_are_refused():
    c = _cluster(2, source=SimpleNamespace(cannot_scale="not here"))
    with pytest.raises(ConfigError, match="cannot scale this cluster: not here"):
        _check(c, 3)
    with pytest.raises(ConfigError, match="mpi process group cannot be made again"):
        _check(_cluster(2, backend="mpi"), 3)


def test_new_workers_take_the_lowest_free_names_and_ranks():
    settings = Settings.make(2)
    assert scale_checks.free_names(settings, {"worker0", "worker1", "worker3"}, 2) == [
        "worker2",
        "worker4",
    ]
    assert scale_checks.free_orders({0, 1, 3}, 3) == [2, 4, 5]


def test_the_summary_says_who_joined_and_left_and_the_size():
    done = scale.Scaled({"worker3": (42, 3)}, ["worker5"], 3, 3, 1.25)
    text = done.summary()
    assert "worker3 (nbrpc.rank() 3, pid 42) joined" in text
    assert "worker5 left the cluster" in text
    assert "the cluster has 3 workers now (1.2 s)" in text
    assert "world size 3" in text


@pytest.mark.usefixtures("no_cluster")
def test_a_scale_before_init_says_to_run_it():
    import nbrpc

    with pytest.raises(nbrpc.NotInitializedError, match=r"nbrpc.scale\(\) \(%rpc_scale\)"):
        nbrpc.scale(3)
