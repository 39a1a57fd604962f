"""What ``%rpc_scale`` refuses before anything changes, and the names and ranks a grow
hands out: a scale's plan, read from the cluster as it is, with nothing started (the
steps themselves are :mod:`nbrpc._lifecycle.scale`'s). Each refusal names what to do
instead and says that nothing changed.
"""

from __future__ import annotations

from nbrpc._errors import ConfigError, counted
from nbrpc._options import Settings
from nbrpc._placement import check_named, validate_names
from nbrpc._rows import WorkerRecord

from . import collective
from .running import Cluster


def check(
    cluster: Cluster,
    workers: list[WorkerRecord],
    n: int | None,
    remove: list[str],
    names: list[str] | None,
    hosts: tuple[str, ...],
) -> tuple[list[WorkerRecord], int]:
    """Refuse, before anything changes, what a scale cannot do; the leavers and how many
    join."""
    current = [r.name for r in workers]
    if n is None and not remove:
        raise ConfigError(
            "say the new size (%rpc_scale 4) or the workers to remove (%rpc_scale --remove worker3)"
        )
    if n is not None and n < 1:
        raise ConfigError(
            f"%rpc_scale {n}: a cluster keeps at least 1 worker. %rpc_shutdown stops them all."
        )
    check_named(remove, current, "remove", "the kernel cannot leave its own cluster")
    if remove and n is not None and n != len(current) - len(remove):
        raise ConfigError(
            f"%rpc_scale {n} --remove {','.join(remove)}: removing {len(remove)} of "
            f"{counted(len(current), 'worker')} leaves {len(current) - len(remove)}, not {n}"
        )
    target = n if n is not None else len(current) - len(remove)
    if target < 1:
        raise ConfigError("a cluster keeps at least 1 worker: %rpc_shutdown stops them all")
    if remove:
        leavers = [r for r in workers if r.name in remove]
    else:  # the highest ranks leave first
        leavers = sorted(workers, key=lambda r: r.order)[target:] if target < len(workers) else []
    count = max(0, target - len(current))
    if (names or hosts) and not count:
        flag = "--names" if names else "--hosts"
        raise ConfigError(f"{flag} says where new workers go, but %rpc_scale {target} adds none")
    settings, source = cluster.settings, cluster.engines.source
    if source.cannot_scale:
        raise ConfigError(f"cannot scale this cluster: {source.cannot_scale}")
    if count and settings.wants_devices:
        raise ConfigError(
            "cannot grow a cluster with device maps (--gpus, --device-map): torch fixed "
            "the kernel's maps when it joined, and they cannot name new workers. Shrinking "
            "works; for more workers, %rpc_shutdown then %rpc_init -n N with the maps."
        )
    if names is not None:
        if len(names) != count:
            raise ConfigError(
                f"--names {','.join(names)}: {counted(len(names), 'name')} for "
                f"{counted(count, 'new worker')}"
            )
        taken = [name for name in names if name in current]
        if taken:
            are = "is already a worker" if len(taken) == 1 else "are already workers"
            raise ConfigError(
                f"--names {','.join(names)}: {', '.join(taken)} {are} of this cluster"
            )
        validate_names(names, settings.self_name)
    if count:
        source.check_hosts(hosts)
        source.check_room(count)
        _refuse_beside_dead(cluster)
    pg = cluster.booted.process_group
    if pg and pg["backend"] not in collective.REBUILDABLE:
        raise ConfigError(
            f"cannot scale: the workers' {pg['backend']} process group cannot be made again "
            "at a new size. Nothing changed; run %rpc_shutdown then %rpc_init."
        )
    return leavers, count


def _refuse_beside_dead(cluster: Cluster) -> None:
    """A new worker joins by reaching every member, and a dead one never answers (its
    join waited 90 s for it, then failed): a grow beside a dead worker that stays is
    refused at once, naming it and the fixes."""
    dead = cluster.dead_workers()
    if dead:
        names, one = ", ".join(dead), len(dead) == 1
        raise ConfigError(
            f"cannot add workers: {names} {'is' if one else 'are'} dead (the process is "
            "gone), and a new worker joins by reaching every member. Nothing changed. Run "
            f"%rpc_restart {' '.join(dead)} first, or %rpc_scale --remove {','.join(dead)} "
            "to go on without " + ("it." if one else "them.")
        )


def free_names(settings: Settings, current: set[str], count: int) -> list[str]:
    """The lowest free default names (``worker1``, ``worker2``, ...)."""
    found: list[str] = []
    i = 1
    while len(found) < count:
        name = f"worker{i}"
        if name not in current and name != settings.self_name:
            found.append(name)
        i += 1
    return found


def free_orders(used: set[int], count: int) -> list[int]:
    """The lowest free ``nbrpc.rank()`` values (0 is the kernel's)."""
    found: list[int] = []
    i = 1
    while len(found) < count:
        if i not in used:
            found.append(i)
        i += 1
    return found
