"""The cluster view: one card per process (``%rpc_status``, ``ClusterView``), the one-line
headline, and the summary ``%rpc_init`` prints; from ``nbrpc.status()`` rows."""

from __future__ import annotations

from html import escape
from typing import Any

from nbrpc._rows import WorkerState

from .draw import FONT, bytes_text, columns

_STATE_COLOR = {
    WorkerState.READY: "#2e7d32",
    WorkerState.DEAD: "#c62828",
    WorkerState.STOPPED: "#757575",
    # a cluster's own states, for a row that carries one (the text of ClusterState's)
    "booting": "#f9a825",
    "shutting down": "#f9a825",
}


def _figure(value: Any) -> str:
    return "–" if value is None else str(value)


def _torch_id(r: dict[str, Any]) -> str:
    """ " · torch id 4": a row's torch id (``get_worker_info().id``), beside its rank
    (``nbrpc.rank()``), which it equals only in a kernel's first cluster."""
    return "" if r.get("torch_id") is None else f" · torch id {r['torch_id']}"


def cluster_html(rows: list[dict[str, Any]], state: str) -> str:
    """One card per process: state, pid@host, devices, calls, RRefs."""
    if not rows:
        what = (
            "booting: starting workers and joining them (progress is shown where "
            "<code>%rpc_init</code> runs)"
            if state == "booting"
            else f"no cluster ({escape(state)}). Start one with <code>%rpc_init -n 2</code>"
        )
        return (
            f'<div class="nbrpc-cluster" data-state="{escape(state)}" style="{FONT}">'
            f"<b>nbrpc</b>: {what}.</div>"
        )
    cards = []
    for r in rows:
        color = _STATE_COLOR.get(r["state"], "#757575")
        devices = ", ".join(r.get("devices") or []) or "–"
        cards.append(
            f'<div class="nbrpc-worker" data-worker="{escape(r["name"])}" '
            f'data-state="{escape(r["state"])}" data-pid="{r.get("pid", "")}" '
            'style="border:1px solid #ccc;'
            f"border-left:6px solid {color};border-radius:6px;padding:6px 10px;"
            'min-width:170px;background:#fafafa">'
            f'<div style="font-weight:600;font-size:14px">{escape(r["name"])} '
            f'<span style="color:{color};font-size:12px">● {escape(r["state"])}</span></div>'
            f'<div style="font-size:12px;color:#444">{escape(r.get("role", ""))} · rank '
            f"{r.get('rank', '–')}{_torch_id(r)}</div>"
            f'<div style="font-size:12px;color:#444">pid {r.get("pid", "–")} @ '
            f"{escape(str(r.get('host', '–')))}</div>"
            f'<div style="font-size:12px;color:#444">devices: {escape(devices)}</div>'
            f'<div style="font-size:12px">calls: <b>{_figure(r.get("calls_in_flight"))}</b> '
            f"running, {_figure(r.get('calls_done'))} done</div>"
            f'<div style="font-size:12px">RRefs: {_figure(r.get("rrefs_owned"))} owned, '
            f"{_figure(r.get('rrefs_held'))} held</div>"
            f'<div class="resources" style="font-size:12px">{escape(resources_text(r))}</div>'
            f"{_cuda_html(r.get('cuda'))}{_maps_html(r.get('device_maps'))}</div>"
        )
    return (
        f'<div class="nbrpc-cluster" data-state="{escape(state)}" style="{FONT}">'
        f'<div class="nbrpc-headline" style="margin-bottom:4px"><b>nbrpc</b> cluster: '
        f"{escape(headline(rows, state))}</div>"
        f'<div style="display:flex;flex-wrap:wrap;gap:8px">{"".join(cards)}</div></div>'
    )


def resources_text(r: dict[str, Any]) -> str:
    """ "CPU 12 % · 310.2 MB": a process's CPU (of one core) and resident memory."""
    cpu = r.get("cpu_percent")
    return f"CPU {'–' if cpu is None else f'{cpu:.0f}'} % · {bytes_text(r.get('memory_rss'))}"


def cuda_text(device: dict[str, Any]) -> str:
    """ "cuda:0 1.2 GB / 2.0 GB, 40 %": allocated / reserved memory, utilisation."""
    used = device.get("utilization")
    memory = f"{bytes_text(device['allocated'])} / {bytes_text(device['reserved'])}"
    return f"{device['device']} {memory}" + ("" if used is None else f", {used} %")


def _cuda_html(devices: list | None) -> str:
    if not devices:
        return ""
    lines = "".join(f"<div>{escape(cuda_text(d))}</div>" for d in devices)
    return f'<div class="cuda" style="font-size:11px;color:#1b5e20">{lines}</div>'


def _maps_html(maps: dict | None) -> str:
    if not maps:
        return ""
    lines = "".join(
        f"<div>→ {escape(dest)}: "
        + escape(", ".join(f"{a}→{b}" for a, b in pairs.items()))
        + "</div>"
        for dest, pairs in maps.items()
    )
    return f'<div class="device-maps" style="font-size:11px;color:#6a1b9a">{lines}</div>'


def headline(rows: list[dict[str, Any]], state: str) -> str:
    """How many processes and in what state, in one line: "3 processes, ready" only when
    the cluster and every process are ready; otherwise the ready ones are counted and the
    others named: "3 processes: 2 ready, worker2 dead" (the cluster's own state first when
    it is not ready: "3 processes, shutting down: ...")."""
    count = f"{len(rows)} process{'es' if len(rows) != 1 else ''}"
    off = [f"{r['name']} {r['state']}" for r in rows if r["state"] != WorkerState.READY]
    if not off or all(r["state"] == state for r in rows):
        return f"{count}, {state}"
    ready = len(rows) - len(off)
    parts = ", ".join(([f"{ready} ready"] if ready else []) + off)
    return f"{count}: {parts}" if state == "ready" else f"{count}, {state}: {parts}"


def cluster_text(rows: list[dict[str, Any]], state: str) -> str:
    if not rows:
        return "nbrpc: booting" if state == "booting" else f"nbrpc: no cluster ({state})"
    lines = [f"nbrpc cluster: {headline(rows, state)}"]
    table = [
        [
            r["name"],
            r["state"],
            f"pid {r.get('pid', '–')}",
            f"calls {_figure(r.get('calls_in_flight'))} running / "
            f"{_figure(r.get('calls_done'))} done",
            f"RRefs {_figure(r.get('rrefs_owned'))} owned",
            resources_text(r),
            "; ".join(cuda_text(d) for d in r.get("cuda") or []),
        ]
        for r in rows
    ]
    return "\n".join(lines + columns(table))


def records_text(
    rows: list[dict[str, Any]], state: str, boot_s: float | None, notes: list[str]
) -> str:
    """A cluster's processes as a table (``Cluster.summary()``, ``%rpc_init``'s printout):
    ``rank`` is ``nbrpc.rank()``, ``torch id`` torch's (``get_worker_info().id``)."""
    booted = f" (booted in {boot_s:.1f} s)" if boot_s is not None else ""
    lines = [f"nbrpc RPC group: {headline(rows, state)}{booted}"]
    table = [["name", "rank", "torch id", "pid", "host", "role", "state"]]
    table += [
        [
            r["name"],
            str(r["rank"]),
            _figure(r.get("torch_id")),
            str(r["pid"]),
            r["host"],
            r["role"],
            r["state"],
        ]
        for r in rows
    ]
    lines += columns(table, right=frozenset({1, 2, 3}))
    lines.extend(f"  {note}" for note in notes)
    return "\n".join(lines)


def summary_text(
    rows: list[dict[str, Any]],
    state: str,
    boot_s: float | None,
    tensors: str | None,
    group: str | None,
    device_maps: list[str],
    engines: str = "",
) -> str:
    """``Cluster.summary()``: the processes, then where the engines came from (a Slurm
    job), how CPU tensors travel, the process group and the device maps (each line made
    by the module that knows it)."""
    notes = [line for line in (engines, tensors, group) if line]
    if device_maps:
        notes.append("device maps (and where replies go):")
        notes.extend(f"  {line}" for line in device_maps)
    return records_text(rows, state, boot_s, notes)
