"""The backward view: a distributed backward pass lane by lane, with the gradient hops
between processes (``BackwardView``); from ``nbrpc.trace_backward()``."""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

from nbrpc._errors import counted

from .draw import FONT

_KIND_FILL = {
    "root": "#c8e6c9",
    "send": "#ffe0b2",
    "recv": "#bbdefb",
    "accumulate": "#eeeeee",
    "function": "#ffffff",
}


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
        f"backward pass, context {trace.get('context_id')}: "
        f"{counted(len(trace['nodes']), 'autograd function')} on "
        f"{counted(len(trace['workers']), 'process', 'processes')}, "
        f"{counted(len(hops), 'cross-process hop')}"
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
