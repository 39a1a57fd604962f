"""The ownership view: every live RRef inside its owner, with an edge to each process
that holds it (``OwnershipView``); from ``nbrpc.ownership()`` rows."""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

from .draw import FONT

MAX_RREFS_PER_OWNER = 16  # more are summarised as "+N more" so a 10,000-RRef loop stays drawable

_LANE_W, _LANE_GAP, _HEAD_H, _NODE_H, _NODE_GAP, _BAND = 190, 44, 34, 34, 8, 26


def ownership_svg(workers: list[str], rrefs: list[dict[str, Any]], fit: bool = False) -> str:
    """Workers as columns; each RRef a box in its owner's column; an edge to each holder.
    ``fit``: as wide as its container and never wider than drawn (the panel's side bar,
    250-350 px), the whole drawing scaled to it; otherwise drawn at its own size."""
    names = list(workers) + sorted({r["owner"] for r in rrefs} - set(workers))
    x_of = {name: 10 + i * (_LANE_W + _LANE_GAP) for i, name in enumerate(names)}
    by_owner: dict[str, list[dict]] = defaultdict(list)
    for r in rrefs:
        by_owner[r["owner"]].append(r)
    rows = max([min(len(v), MAX_RREFS_PER_OWNER + 1) for v in by_owner.values()] + [1])
    height = _HEAD_H + _BAND + 30 + rows * (_NODE_H + _NODE_GAP)
    width = 20 + len(names) * (_LANE_W + _LANE_GAP)
    size, fitted = f'width="{width}" height="{height}"', ""
    if fit:  # the height follows from the viewBox
        size, fitted = 'width="100%"', f";max-width:{width}px;height:auto"
    parts = [
        f'<svg class="nbrpc-ownership" xmlns="http://www.w3.org/2000/svg" {size} '
        f'viewBox="0 0 {width} {height}" style="{FONT};font-size:12px{fitted}">',
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
