"""Plain data in, HTML/SVG/text out: what the widgets and the summaries draw, as pure
functions (it imports nothing of nbrpc, so every layer may draw with it).

Every view is computed here from the lists and dicts that ``nbrpc.status()``,
``nbrpc.ownership()`` and ``nbrpc.trace_backward()`` return, so it can be tested without a
browser and used without widgets (``_repr_html_`` in nbconvert, text in a terminal). The
SVG carries ``data-*`` attributes (worker names, RRef ids, edge kinds) that the widget's
front end uses for hover highlighting and that the browser test reads.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

_STATE_COLOR = {
    "ready": "#2e7d32",
    "booting": "#f9a825",
    "dead": "#c62828",
    "stopped": "#757575",
    "shutting down": "#f9a825",
}
_KIND_FILL = {
    "root": "#c8e6c9",
    "send": "#ffe0b2",
    "recv": "#bbdefb",
    "accumulate": "#eeeeee",
    "function": "#ffffff",
}
FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"
MAX_RREFS_PER_OWNER = 16  # more are summarised as "+N more" so a 10,000-RRef loop stays drawable


def _figure(value: Any) -> str:
    return "–" if value is None else str(value)


# -- cluster ------------------------------------------------------------------------------


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
            f'data-state="{escape(r["state"])}" style="border:1px solid #ccc;'
            f"border-left:6px solid {color};border-radius:6px;padding:6px 10px;"
            'min-width:170px;background:#fafafa">'
            f'<div style="font-weight:600;font-size:14px">{escape(r["name"])} '
            f'<span style="color:{color};font-size:12px">● {escape(r["state"])}</span></div>'
            f'<div style="font-size:12px;color:#444">{escape(r.get("role", ""))} · rank '
            f"{r.get('rank', '–')}</div>"
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


def bytes_text(n: int | None) -> str:
    if n is None:
        return "–"
    if n < 2**10:
        return f"{n} B"
    for unit, size in (("GB", 2**30), ("MB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.0f} KB"


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
    off = [f"{r['name']} {r['state']}" for r in rows if r["state"] != "ready"]
    if not off or all(r["state"] == state for r in rows):
        return f"{count}, {state}"
    ready = len(rows) - len(off)
    parts = ", ".join(([f"{ready} ready"] if ready else []) + off)
    return f"{count}: {parts}" if state == "ready" else f"{count}, {state}: {parts}"


def columns(rows: list[list[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart (``right``: aligned right)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append(("  " + "  ".join(cells)).rstrip())
    return lines


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
    """A cluster's processes as a table (``Cluster.summary()``, ``%rpc_init``'s printout)."""
    booted = f" (booted in {boot_s:.1f} s)" if boot_s is not None else ""
    lines = [f"nbrpc RPC group: {headline(rows, state)}{booted}"]
    table = [["name", "rank", "pid", "host", "role", "state"]]
    table += [
        [r["name"], str(r["rank"]), str(r["pid"]), r["host"], r["role"], r["state"]] for r in rows
    ]
    lines += columns(table, right=frozenset({1, 2}))
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


# -- ownership ----------------------------------------------------------------------------

_LANE_W, _LANE_GAP, _HEAD_H, _NODE_H, _NODE_GAP, _BAND = 190, 44, 34, 34, 8, 26


def ownership_svg(workers: list[str], rrefs: list[dict[str, Any]]) -> str:
    """Workers as columns; each RRef a box in its owner's column; an edge to each holder."""
    names = list(workers) + sorted({r["owner"] for r in rrefs} - set(workers))
    x_of = {name: 10 + i * (_LANE_W + _LANE_GAP) for i, name in enumerate(names)}
    by_owner: dict[str, list[dict]] = defaultdict(list)
    for r in rrefs:
        by_owner[r["owner"]].append(r)
    rows = max([min(len(v), MAX_RREFS_PER_OWNER + 1) for v in by_owner.values()] + [1])
    height = _HEAD_H + _BAND + 30 + rows * (_NODE_H + _NODE_GAP)
    width = 20 + len(names) * (_LANE_W + _LANE_GAP)
    parts = [
        f'<svg class="nbrpc-ownership" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" style="{FONT};font-size:12px">',
        '<defs><marker id="nbrpc-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7"'
        ' markerHeight="7" orient="auto"><path d="M0,0L10,5L0,10z" fill="#6a1b9a"/></marker>'
        "</defs>",
    ]
    for name in names:
        x = x_of[name]
        parts.append(
            f'<g class="lane" data-worker="{escape(name)}">'
            f'<rect x="{x}" y="4" width="{_LANE_W}" height="{height - 8}" rx="8" '
            'fill="#f5f5f5" stroke="#ddd"/>'
            f'<rect x="{x}" y="4" width="{_LANE_W}" height="{_HEAD_H - 4}" rx="8" fill="#37474f"/>'
            f'<text x="{x + _LANE_W / 2}" y="24" text-anchor="middle" fill="#fff" '
            f'font-weight="600">{escape(name)}</text></g>'
        )
    edges, nodes = [], []
    lane_of = {name: i for i, name in enumerate(names)}
    for owner, items in by_owner.items():
        x = x_of[owner]
        shown = items[:MAX_RREFS_PER_OWNER]
        for i, r in enumerate(shown):
            y = _HEAD_H + _BAND + 10 + i * (_NODE_H + _NODE_GAP)
            rid = escape(r["id"])
            title = escape(f"RRef {r['id']}: {r.get('type')} made by {r.get('created_by')}")
            nodes.append(
                f'<g class="rref" data-rref="{rid}" data-owner="{escape(owner)}" '
                f'data-holders="{escape(",".join(r["holders"]))}"><title>{title}</title>'
                f'<rect x="{x + 8}" y="{y}" width="{_LANE_W - 16}" height="{_NODE_H}" rx="5" '
                'fill="#ede7f6" stroke="#6a1b9a"/>'
                f'<text x="{x + 14}" y="{y + 14}" font-weight="600">{rid} · '
                f"{escape(str(r.get('type') or '?')[:18])}</text>"
                f'<text x="{x + 14}" y="{y + 28}" fill="#555" font-size="10">'
                f"{escape(str(r.get('created_by') or '')[:32])}</text></g>"
            )
            for k, holder in enumerate(r["holders"]):
                if holder not in x_of:
                    continue
                # Out of the box sideways, up the gap beside the owner's lane, along the
                # band under the headers, into the holder's header: never across a box.
                right = lane_of[holder] > lane_of[owner]
                sx = x + (_LANE_W - 8 if right else 8)
                gap = x + _LANE_W + 6 + (i % 5) * 6 if right else x - 6 - (i % 5) * 6
                band = _HEAD_H + 4 + ((i * 3 + k) % 7) * 3
                tx = x_of[holder] + _LANE_W / 2 + ((i % 5) - 2) * 8
                edges.append(
                    f'<path class="hold-edge" data-rref="{rid}" data-holder="{escape(holder)}" '
                    f'd="M{sx},{y + _NODE_H / 2} H{gap} V{band} H{tx} V{_HEAD_H + 1}" '
                    'fill="none" stroke="#6a1b9a" stroke-width="1.4" opacity="0.75" '
                    'stroke-linejoin="round" marker-end="url(#nbrpc-arrow)"/>'
                )
        if len(items) > len(shown):
            y = _HEAD_H + _BAND + 10 + len(shown) * (_NODE_H + _NODE_GAP)
            nodes.append(
                f'<text class="more" x="{x + 14}" y="{y + 18}" fill="#555">'
                f"+{len(items) - len(shown)} more</text>"
            )
    parts.extend(nodes)
    parts.extend(edges)  # on top, so crossing edges stay visible
    parts.append("</svg>")
    return "".join(parts)


def ownership_text(rrefs: list[dict[str, Any]]) -> str:
    if not rrefs:
        return "nbrpc: no live RRefs"
    lines = [f"nbrpc: {len(rrefs)} live RRefs"]
    for r in rrefs:
        holders = ", ".join(r["holders"]) or "(owner only)"
        lines.append(
            f"  {r['id']:<8}{r.get('type')!s:<16}owner {r['owner']:<10}held by {holders:<20}"
            f"{r.get('created_by') or ''}"
        )
    return "\n".join(lines)


# -- backward -----------------------------------------------------------------------------


def _depths(trace: dict[str, Any]) -> dict[str, int]:
    """Longest distance from a root along the gradient flow (edges point that way)."""
    succ: dict[str, list[str]] = defaultdict(list)
    indeg: dict[str, int] = {n["id"]: 0 for n in trace["nodes"]}
    for e in trace["edges"]:
        if e["src"] in indeg and e["dst"] in indeg:
            succ[e["src"]].append(e["dst"])
            indeg[e["dst"]] += 1
    depth = {n: 0 for n, d in indeg.items() if d == 0}
    queue = list(depth)
    while queue:
        node = queue.pop()
        for nxt in succ[node]:
            depth[nxt] = max(depth.get(nxt, 0), depth[node] + 1)
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                queue.append(nxt)
    for n in indeg:  # a cycle cannot happen in autograd; be safe anyway
        depth.setdefault(n, 0)
    return depth


def _short_name(name: str) -> str:
    return name.replace("Backward0", "").replace("Backward", "") or name


_BOX_W, _BOX_H, _ROW_H, _SLOT_W, _HEADER_H = 118, 30, 46, 126, 46


def backward_svg(trace: dict[str, Any]) -> str:
    """One column per worker; autograd functions top to bottom in the order gradients
    reach them; send→recv hops drawn across columns in orange.

    Columns, not rows: a backward pass is deep and a cluster is narrow, so the drawing
    grows downwards, the way a notebook scrolls.
    """
    workers = [w["name"] for w in trace["workers"]]
    for n in trace["nodes"]:
        if n["worker"] not in workers:
            workers.append(n["worker"])
    depth = _depths(trace)
    order = sorted(trace["nodes"], key=lambda n: (depth[n["id"]], n["id"]))
    slot_of: dict[str, int] = {}
    used: dict[tuple[str, int], int] = defaultdict(int)
    for n in order:
        key = (n["worker"], depth[n["id"]])
        slot_of[n["id"]] = used[key]
        used[key] += 1
    slots = defaultdict(lambda: 1, {w: 1 for w in workers})
    for (w, _), count in used.items():
        slots[w] = max(slots[w], count)
    lane_x, x = {}, 6
    for w in workers:
        lane_x[w] = x
        x += slots[w] * _SLOT_W + 28
    width = x
    height = _HEADER_H + 30 + (max(depth.values(), default=0) + 1) * _ROW_H
    pos = {
        n["id"]: (
            lane_x[n["worker"]] + 14 + slot_of[n["id"]] * _SLOT_W,
            _HEADER_H + 36 + depth[n["id"]] * _ROW_H,
        )
        for n in trace["nodes"]
    }
    timing = {w["name"]: w.get("timing") for w in trace["workers"]}
    parts = [
        f'<svg class="nbrpc-backward" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" style="{FONT};font-size:11px">',
        '<defs><marker id="nbrpc-arrow-local" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" '
        'fill="#888"/></marker><marker id="nbrpc-arrow-rpc" viewBox="0 0 10 10" refX="9" '
        'refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0L10,5L0,10z" '
        'fill="#e65100"/></marker></defs>',
        f'<text x="6" y="16" font-weight="600">backward pass, context {trace.get("context_id")}'
        " — gradients flow top to bottom; orange arrows cross processes</text>",
    ]
    for w in workers:
        t = timing.get(w)
        busy = f"{t['busy_s'] * 1e3:.2f} ms busy" if t else ""
        lw = slots[w] * _SLOT_W + 16
        parts.append(
            f'<g class="lane" data-worker="{escape(w)}"><rect x="{lane_x[w]}" y="24" '
            f'width="{lw}" height="{height - 28}" rx="6" fill="#f7f7f7" stroke="#ddd"/>'
            f'<text x="{lane_x[w] + 10}" y="44" font-weight="600" font-size="12">{escape(w)}'
            f'</text><text x="{lane_x[w] + 10}" y="60" fill="#555">{busy}</text></g>'
        )
    for e in trace["edges"]:
        if e["src"] not in pos or e["dst"] not in pos:
            continue
        (sx, sy), (tx, ty) = pos[e["src"]], pos[e["dst"]]
        x1: float
        y1: float
        x2: float
        y2: float
        if e["kind"] == "rpc":
            right = tx > sx
            x1, y1 = sx + (_BOX_W if right else 0), sy + _BOX_H / 2
            x2, y2 = tx + (0 if right else _BOX_W), ty + _BOX_H / 2
            bend = 40 if right else -40
            parts.append(
                f'<path class="rpc-edge" data-src="{escape(e["src"])}" data-dst="'
                f'{escape(e["dst"])}" d="M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},'
                f'{y2}" fill="none" stroke="#e65100" stroke-width="2.5" stroke-dasharray="6 3" '
                'marker-end="url(#nbrpc-arrow-rpc)"/>'
            )
        else:
            x1, y1, x2, y2 = sx + _BOX_W / 2, sy + _BOX_H, tx + _BOX_W / 2, ty
            parts.append(
                f'<path class="local-edge" d="M{x1},{y1} C{x1},{y1 + 10} {x2},{y2 - 10} {x2},'
                f'{y2}" fill="none" stroke="#888" marker-end="url(#nbrpc-arrow-local)"/>'
            )
    for n in trace["nodes"]:
        x, y0 = pos[n["id"]]
        label = escape(_short_name(n["name"]))[:18]
        ms = f" {n['duration_s'] * 1e3:.2f} ms" if n.get("duration_s") is not None else ""
        stroke = "#e65100" if n["kind"] in ("send", "recv") else "#607d8b"
        parts.append(
            f'<g class="node" data-node="{escape(n["id"])}" data-kind="{n["kind"]}" '
            f'data-worker="{escape(n["worker"])}"><title>{escape(n["name"])} on '
            f"{escape(n['worker'])}{ms}</title>"
            f'<rect x="{x}" y="{y0}" width="{_BOX_W}" height="{_BOX_H}" rx="4" '
            f'fill="{_KIND_FILL.get(n["kind"], "#fff")}" stroke="{stroke}"/>'
            f'<text x="{x + 6}" y="{y0 + 13}">{label}</text>'
            f'<text x="{x + 6}" y="{y0 + 25}" fill="#555" font-size="10">{n["kind"]}{ms}'
            "</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def backward_text(trace: dict[str, Any]) -> str:
    hops = [e for e in trace["edges"] if e["kind"] == "rpc"]
    lines = [
        f"backward pass, context {trace.get('context_id')}: {len(trace['nodes'])} autograd "
        f"functions on {len(trace['workers'])} processes, {len(hops)} cross-process hops"
    ]
    per_worker: dict[str, int] = defaultdict(int)
    for n in trace["nodes"]:
        per_worker[n["worker"]] += 1
    for w in trace["workers"]:
        t = w.get("timing")
        busy = f", {t['busy_s'] * 1e3:.2f} ms busy" if t else ""
        lines.append(f"  {w['name']}: {per_worker[w['name']]} functions{busy}")
    for e in hops:
        lines.append(f"  hop {e['src']} -> {e['dst']}")
    return "\n".join(lines)


def widget_bundle(widget: Any, text: str) -> dict[str, Any]:
    """``widget``'s display data with ``text`` as its text/plain: what a front end without
    widgets (nbval, nbconvert, a terminal) shows instead of "HBox(...)"."""
    bundle = widget._repr_mimebundle_()
    data = dict(bundle[0] if isinstance(bundle, tuple) else bundle or {})
    data["text/plain"] = text
    return data
