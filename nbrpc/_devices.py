"""CUDA device maps: parsing, planning and validation, as pure functions (no processes).

A device map tells TensorPipe where a CUDA tensor lands: ``{"worker1": {"cuda:0":
"cuda:1"}}`` set on the kernel sends the kernel's ``cuda:0`` tensors to worker1's
``cuda:1`` directly, device to device; worker1's replies travel the inverse map. torch
checks maps late and, on a CPU-only machine, says only "Cannot access accelerator device
when none is available". nbrpc checks every map against the devices each process
reported at boot, *before* ``init_rpc``, and names the worker, the device and what exists.

Shapes used here (plain data, so they ship to workers and print in ``%rpc_status``)::

    devices: {"worker0": ["cpu", "cuda:0"], "worker1": ["cpu", "cuda:0", "cuda:1"]}
    maps:    {"worker0": {"worker1": {"cuda:0": "cuda:1"}}}   # source → destination → map
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ._errors import ConfigError, DeviceMapError

Maps = dict[str, dict[str, dict[str, str]]]

_CUDA = re.compile(r"^(?:cuda:)?(\d+)$")


def canonical(device: str | int) -> str:
    """``0``, ``"0"``, ``"cuda:0"`` → ``"cuda:0"``; anything else is refused."""
    text = str(device).strip()
    match = _CUDA.match(text)
    if match:
        return f"cuda:{int(match.group(1))}"
    if text in ("cpu", "cuda"):
        hint = "CPU tensors need no device map" if text == "cpu" else "name the index, e.g. cuda:0"
        raise DeviceMapError(f"device {text!r} cannot be mapped: {hint}")
    raise DeviceMapError(f"device {text!r} is not a CUDA device; write cuda:N (or N)")


def parse_device_map(text: str) -> tuple[str, dict[str, str]]:
    """``"worker1=cuda:0->cuda:1,cuda:1->cuda:0"`` → ``("worker1", {...})``.

    The syntax of ``%rpc_init --device-map`` (repeatable): the destination worker, then
    pairs *kernel device -> worker device*.
    """
    name, sep, pairs = text.partition("=")
    name = name.strip()
    if not sep or not name or not pairs.strip():
        raise DeviceMapError(
            f"--device-map {text!r}: write WORKER=LOCAL->REMOTE[,LOCAL->REMOTE...], "
            "e.g. worker1=cuda:0->cuda:1"
        )
    mapping: dict[str, str] = {}
    for pair in pairs.split(","):
        local, arrow, remote = pair.partition("->")
        if not arrow:
            raise DeviceMapError(
                f"--device-map {text!r}: {pair.strip()!r} is not LOCAL->REMOTE "
                "(e.g. cuda:0->cuda:1)"
            )
        src = canonical(local)
        if src in mapping:
            raise DeviceMapError(f"--device-map {text!r}: {src} is mapped twice")
        mapping[src] = canonical(remote)
    return name, mapping


def merge(source: str, entries: Iterable[tuple[str, dict]]) -> Maps:
    """Maps given by hand (``device_maps=`` or repeated ``--device-map``), from ``source``."""
    out: dict[str, dict[str, str]] = {}
    for dest, mapping in entries:
        target = out.setdefault(dest, {})
        for local, remote in mapping.items():
            src, dst = canonical(local), canonical(remote)
            if target.get(src, dst) != dst:
                raise DeviceMapError(
                    f"device map to {dest}: {src} is mapped to both {target[src]} and {dst}"
                )
            target[src] = dst
    return {source: out} if out else {}


def plan_gpus(devices: dict[str, list[str]], hosts: dict[str, str]) -> tuple[dict, Maps]:
    """``--gpus auto``: one GPU per process, round-robin per host, maps between all pairs.

    ``devices`` and ``hosts`` are keyed by process name in group order (the kernel first).
    Returns ``({name: [gpu]}, maps)``. With one GPU on a host every process there shares
    it (``cuda:0 -> cuda:0``), as in the CUDA-RPC tutorial.
    """
    chosen: dict[str, str] = {}
    seen_on_host: dict[str, int] = {}
    for name in devices:
        gpus = [d for d in devices[name] if d.startswith("cuda:")]
        if not gpus:
            raise DeviceMapError(
                f"--gpus auto: {name} on {hosts.get(name, '?')} has no CUDA device (its "
                f"devices: {', '.join(devices[name]) or 'none'}). Leave --gpus out to use "
                "CPU tensors, or start the workers where there are GPUs."
            )
        i = seen_on_host.get(hosts.get(name, ""), 0)
        seen_on_host[hosts.get(name, "")] = i + 1
        chosen[name] = gpus[i % len(gpus)]
    maps: Maps = {}
    for src in devices:
        maps[src] = {dst: {chosen[src]: chosen[dst]} for dst in devices if dst != src}
    return {name: [gpu] for name, gpu in chosen.items()}, maps


def plan(described: dict[str, dict], gpus: str | None, by_hand: Maps) -> tuple[Maps, dict]:
    """Every process's maps, from what each one reported at boot (``described``: name ->
    its ``describe_process()``, the kernel first), ``--gpus`` and the maps given by hand
    (which win over the plan); checked. Returns ``(maps, {name: [its gpu]})``."""
    devices = {name: info["devices"] for name, info in described.items()}
    hosts = {name: info["host"] for name, info in described.items()}
    chosen: dict = {}
    maps: Maps = {}
    if gpus == "auto":
        chosen, maps = plan_gpus(devices, hosts)
    for src, by_dest in by_hand.items():
        for dest, mapping in by_dest.items():
            maps.setdefault(src, {})[dest] = mapping
    validate(maps, devices, hosts)
    return maps, chosen


def validate(maps: Maps, devices: dict[str, list[str]], hosts: dict[str, str]) -> None:
    """Every map names known processes and devices they have; raise the first problem."""
    for src, by_dest in maps.items():
        if src not in devices:
            raise DeviceMapError(f"device map from {src}: no process of that name")
        for dest, mapping in by_dest.items():
            if dest == src:
                raise DeviceMapError(f"device map from {src} to itself: a map joins two processes")
            if dest not in devices:
                raise DeviceMapError(
                    f"device map {src} -> {dest}: no worker named {dest!r} (the cluster has "
                    f"{', '.join(devices)})"
                )
            targets: dict[str, str] = {}
            for local, remote in mapping.items():
                for who, dev in ((src, local), (dest, remote)):
                    if dev not in devices[who]:
                        cpu_only = all(not d.startswith("cuda") for d in devices[who])
                        why = (
                            f"{who} on {hosts.get(who, '?')} has no CUDA device at all"
                            if cpu_only
                            else f"{who} has {', '.join(devices[who])}"
                        )
                        raise DeviceMapError(
                            f"device map {src} -> {dest} ({local} -> {remote}): {who} has no "
                            f"{dev}; {why}. Fix the map, or leave it out to send CPU tensors."
                        )
                if remote in targets:
                    raise DeviceMapError(
                        f"device map {src} -> {dest}: {targets[remote]} and {local} both map "
                        f"to {remote}; replies could not tell them apart"
                    )
                targets[remote] = local


def check_local(name: str, maps: Maps, gpus: str | None, devices: list[str], host: str) -> None:
    """What this process can check about its own side before any worker starts."""
    if gpus == "auto":
        plan_gpus({name: devices}, {name: host})
    own = maps.get(name, {})
    # the workers' devices are not known yet: take their side of each map as given
    assumed = {dest: [*mapping.values()] for dest, mapping in own.items()}
    validate({name: own}, {**assumed, name: devices}, {name: host})


def inverse(maps: Maps) -> Maps:
    """Where replies go: for each ``src -> dest`` map, ``dest -> src`` with pairs swapped."""
    out: Maps = {}
    for src, by_dest in maps.items():
        for dest, mapping in by_dest.items():
            out.setdefault(dest, {})[src] = {v: k for k, v in mapping.items()}
    return out


def joining_devices(name: str, maps: Maps, chosen: dict[str, list[str]]) -> list[str] | None:
    """The CUDA devices process ``name`` joins with: its ``--gpus auto`` GPU and every
    device a map of another process sends to it (None: none).

    A ``--device-map`` given by hand names the kernel's maps only, and a worker that joins
    with no maps and no devices starts neither CUDA nor TensorPipe's CUDA channels: the
    first CUDA tensor sent to it would find no allocator (torch aborts the process) and
    no channel. torch's own static groups derive the same list from every peer's maps; a
    restart (no ``chosen``) gets the same list as the boot."""
    received = {
        dev
        for by_dest in maps.values()
        for dest, mapping in by_dest.items()
        if dest == name
        for dev in mapping.values()
    }
    devices = received | set(chosen.get(name, ()))
    return sorted(devices, key=lambda d: (len(d), d)) or None


def describe(maps: Maps) -> list[str]:
    """One line per map and its inverse, for ``%rpc_status``."""
    lines = []
    back = inverse(maps)
    for src, by_dest in maps.items():
        for dest, mapping in by_dest.items():
            pairs = ", ".join(f"{k}->{v}" for k, v in mapping.items())
            replies = ", ".join(f"{k}->{v}" for k, v in back[dest][src].items())
            lines.append(f"{src} -> {dest}: {pairs}   (replies {dest} -> {src}: {replies})")
    return lines


#: how many default worker names (worker1, worker2, ...) a kernel on a GPU host maps at its
#: first join, whatever that cluster is (``NBRPC_PREPARED_GPU_WORKERS``; 0: none)
PREPARED_GPU_WORKERS = 16


def prepared_maps(kernel_devices: list[str], count: int) -> dict[str, dict[str, str]]:
    """The kernel's maps to the default names ``worker1`` .. ``worker{count}`` that a later
    ``--gpus auto`` cluster on this host plans (:func:`plan_gpus`: the kernel takes the
    first GPU, the i-th worker the GPU i modulo their number), so that a GPU cluster can
    follow a CPU one in the kernel. Empty on a host without CUDA devices."""
    gpus = [d for d in kernel_devices if d.startswith("cuda:")]
    if not gpus or count <= 0:
        return {}
    return {f"worker{i}": {gpus[0]: gpus[i % len(gpus)]} for i in range(1, count + 1)}


def unfixed(fixed: dict[str, dict[str, str]], asked: dict[str, dict[str, str]]) -> list[str]:
    """The workers to which ``asked`` (the kernel's maps a cluster needs) differs from
    what the kernel's first join ``fixed``: every map asked must be the fixed one."""
    return sorted(dest for dest, mapping in asked.items() if fixed.get(dest) != mapping)


def check_fixed(
    fixed: dict[str, dict[str, str]] | None,
    kernel: str,
    gpus: str | None,
    by_hand: Maps,
    names: list[str] | None,
) -> None:
    """Refuse, before anything starts, a cluster whose device maps the kernel's first
    join made impossible. ``fixed``: the kernel's maps from that join (None: it has not
    joined); ``gpus``, ``by_hand`` and the worker ``names`` (None: known only once the
    engines registered) are what this cluster asks for.

    torch fixes a process's device maps when it joins the group, and the kernel joins
    once in its life; on a GPU host that join maps the default names
    (:func:`prepared_maps`) whatever the cluster. A CPU cluster needs none of the maps and
    always starts. A GPU cluster needs each of its maps fixed as it asks: checked here by
    name, and the maps themselves once the workers' devices are known (:func:`unfixed`,
    in ``_group.kernel_membership``)."""
    asks = gpus == "auto" or bool(by_hand.get(kernel))
    if fixed is None or not asks:
        return
    restart = "or restart the kernel (Kernel > Restart) to choose again"
    if not fixed:
        raise ConfigError(
            "this kernel joined torch RPC without device maps (no CUDA device was visible "
            "to it then, or NBRPC_PREPARED_GPU_WORKERS=0), and torch fixes a process's "
            f"device maps when it joins: in this kernel start CPU clusters, {restart}."
        )
    missing = unfixed(fixed, by_hand.get(kernel, {}))
    if gpus == "auto":
        missing += sorted(set(names or ()) - set(fixed) - set(missing))
    if missing:
        raise ConfigError(
            f"this kernel's device maps ({_named(fixed)}) were fixed when it first joined, "
            f"and torch keeps a process's maps for its lifetime; this cluster needs other "
            f"maps to {', '.join(missing)}. Start a GPU cluster of names it maps, with the maps "
            f"--gpus auto makes, {restart}."
        )


def _named(maps: dict[str, dict[str, str]], shown: int = 3) -> str:
    """The first ``shown`` maps in full, then how many more (a kernel on a GPU host has
    :data:`PREPARED_GPU_WORKERS` of them)."""
    ordered = sorted(maps.items(), key=lambda item: (len(item[0]), item[0]))
    text = ", ".join(
        f"{dest}: {', '.join(f'{k}->{v}' for k, v in mapping.items())}"
        for dest, mapping in ordered[:shown]
    )
    more = len(ordered) - shown
    return f"{text} and {more} more" if more > 0 else text
