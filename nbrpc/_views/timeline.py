"""The timeline view: a recording's calls as bars on one clock, lane per process, with
arrows from caller to callee (``TimelineView``, ``%%rpc_timeline``); from the rows
``nbrpc.record()`` returns. The SVG carries ``data-call``, ``data-parent``,
``data-caller`` and ``data-callee`` on each call's group, and the row as its ``<title>``
(the tooltip), for the widget's front end and the browser test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from nbrpc._errors import counted

from .draw import FONT, bytes_text, columns


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"


def _path(row: Mapping[str, Any]) -> str:
    paths = sorted({p for p in (row.get("path_in"), row.get("path_out"), row.get("route")) if p})
    return "+".join(paths)


def _outcome(row: Mapping[str, Any]) -> str:
    """ "ok", "cancelled" (the stop button: nbrpc._calls.cancel), or the error's type."""
    if row["ok"]:
        return "ok"
    return "cancelled" if row["error"] == "CallCancelledError" else str(row["error"])


def timeline_text(calls: Sequence[Mapping[str, Any]], processes: list[str], recording: bool) -> str:
    """The recording as a table: one line per call (the first 40), nested calls indented."""
    state = "recording" if recording else "recorded"
    failed = sum(1 for c in calls if not c["ok"])
    lines = [
        f"timeline ({state}): {counted(len(calls), 'call')} between "
        f"{counted(len(processes), 'process', 'processes')}"
        + (f", {failed} failed" if failed else "")
    ]
    depth: dict[int, int] = {}
    rows = []
    for c in calls[:40]:
        d = depth[c["id"]] = depth.get(c["parent"], -1) + 1 if c["parent"] is not None else 0
        rows.append(
            [
                f"{c['start_s'] * 1e3:9.2f}",
                _ms(c["end_s"] - c["start_s"]),
                f"{c['caller']} -> {c['callee']}",
                "  " * d + c["function"],
                bytes_text(c["bytes_in"]) + " / " + bytes_text(c["bytes_out"]),
                _path(c) or "–",
                _outcome(c),
            ]
        )
    if rows:
        head = ["at (ms)", "took", "caller -> callee", "function", "in / out", "path", ""]
        lines += columns([head, *rows], right=frozenset({0, 1}))
    if len(calls) > 40:
        lines.append(f"... and {len(calls) - 40} more (rec.calls has them all)")
    return "\n".join(lines)


_LANE_H = 34


_CALL_COLORS = ("#1976d2", "#388e3c", "#f57c00", "#7b1fa2", "#0097a7", "#5d4037")


def timeline_svg(calls: Sequence[Mapping[str, Any]], processes: list[str], width: int = 760) -> str:
    """One lane per process, a bar per call on its callee's lane (nested calls a step
    lower), an arrow from the caller's lane at the sending to the bar. Each bar's
    ``<title>`` is the row (the tooltip); ``data-call``/``data-parent`` carry the ids."""
    names = list(processes)
    for c in calls:
        for n in (c["caller"], c["callee"]):
            if n not in names:
                names.append(n)
    left, right = 90, 10
    end = max([c["end_s"] for c in calls] + [1e-3])
    begin = min([c["sent_s"] for c in calls] + [0.0])
    span = max(end - begin, 1e-6)
    scale = (width - left - right) / span
    lane = {n: i for i, n in enumerate(names)}
    height = 24 + _LANE_H * len(names)
    out = [
        f'<svg class="nbrpc-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" style="{FONT};font-size:11px">',
        '<defs><marker id="nbrpc-arrow" markerWidth="6" markerHeight="6" refX="5" refY="3" '
        'orient="auto"><path d="M0,0 L6,3 L0,6 z" fill="#555"/></marker></defs>',
    ]
    for n, i in lane.items():
        y = 20 + i * _LANE_H
        out.append(
            f'<g class="nbrpc-lane" data-process="{escape(n)}">'
            f'<rect x="0" y="{y}" width="{width}" height="{_LANE_H}" '
            f'fill="{"#fafafa" if i % 2 else "#ffffff"}"/>'
            f'<text x="4" y="{y + _LANE_H / 2 + 4}" font-weight="bold">{escape(n)}</text></g>'
        )
    out.append(
        f'<text x="{left}" y="12" fill="#555">0</text>'
        f'<text x="{width - right}" y="12" fill="#555" text-anchor="end">{_ms(span)}</text>'
    )
    depth: dict[int, int] = {}
    colors: dict[str, str] = {}
    for c in calls:
        d = depth[c["id"]] = (depth.get(c["parent"], -1) + 1) if c["parent"] is not None else 0
        color = colors.setdefault(c["function"], _CALL_COLORS[len(colors) % len(_CALL_COLORS)])
        if not c["ok"]:
            color = "#c62828"
        x = left + (c["start_s"] - begin) * scale
        w = max((c["end_s"] - c["start_s"]) * scale, 1.5)
        y = 20 + lane[c["callee"]] * _LANE_H + 4 + min(d, 3) * 6
        sx = left + (c["sent_s"] - begin) * scale
        sy = 20 + lane[c["caller"]] * _LANE_H + _LANE_H / 2
        tip = (
            f"{c['function']}: {c['caller']} -> {c['callee']}, "
            f"{_ms(c['end_s'] - c['start_s'])} (sent at {c['sent_s'] * 1e3:.2f} ms), "
            f"in {bytes_text(c['bytes_in'])}, out {bytes_text(c['bytes_out'])}"
            + (f", path {_path(c)}" if _path(c) else "")
            + (
                ""
                if c["ok"]
                else ", cancelled"
                if _outcome(c) == "cancelled"
                else f", raised {c['error']}"
            )
            + f", id {c['id']}"
            + (f", inside {c['parent']}" if c["parent"] is not None else "")
        )
        parent = "" if c["parent"] is None else str(c["parent"])
        out.append(
            f'<g class="nbrpc-call" data-call="{c["id"]}" data-parent="{parent}" '
            f'data-caller="{escape(c["caller"])}" data-callee="{escape(c["callee"])}" '
            f'data-ok="{str(c["ok"]).lower()}"><title>{escape(tip)}</title>'
            f'<line x1="{sx:.1f}" y1="{sy:.1f}" x2="{x:.1f}" y2="{y:.1f}" stroke="#555" '
            f'stroke-width="0.8" marker-end="url(#nbrpc-arrow)"/>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="14" rx="2" '
            f'fill="{color}" fill-opacity="0.85" stroke="#212121" stroke-width="0"/>'
            + (
                f'<text x="{x + 3:.1f}" y="{y + 11:.1f}" fill="#fff">{escape(c["function"])}</text>'
                if w > 7 * len(c["function"])
                else ""
            )
            + "</g>"
        )
    out.append("</svg>")
    return "".join(out)


def timeline_html(calls: Sequence[Mapping[str, Any]], processes: list[str], recording: bool) -> str:
    head = timeline_text(calls, processes, recording).splitlines()[0]
    return (
        f'<div class="nbrpc-timeline-view" style="{FONT}"><div>{escape(head)}</div>'
        f"{timeline_svg(calls, processes)}</div>"
    )
