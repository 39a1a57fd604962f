"""The cluster panel (``%rpc_panel``): the card, the ownership view and the last
recording's timeline in one column, with a button per action. Its front end
(``nbrpc/static/panel.js``) asks before it sends an action and says what came of it."""

from __future__ import annotations

from html import escape
from typing import Any

from .cluster import cluster_html, cluster_text
from .draw import FONT
from .ownership import ownership_svg, ownership_text
from .timeline import timeline_html

_BUTTON = (
    "margin:2px 4px 2px 0;padding:2px 8px;font-size:12px;border:1px solid #bbb;"
    "border-radius:4px;background:#fff;cursor:pointer"
)


def _button(action: str, target: str, label: str) -> str:
    return (
        f'<button class="nbrpc-action" data-action="{action}" data-target="{escape(target)}" '
        f'style="{_BUTTON}">{escape(label)}</button>'
    )


def _section(title: str, body: str) -> str:
    return (
        f'<div class="nbrpc-panel-section" style="margin-top:10px">'
        f'<div style="font-weight:600;font-size:13px;margin-bottom:4px">{escape(title)}</div>'
        f"{body}</div>"
    )


def panel_html(data: dict[str, Any]) -> str:
    """The panel: ``data`` holds ``state``, ``workers`` (``nbrpc.status()`` rows),
    ``members`` and ``rrefs`` (the ownership view's), ``timeline`` (the last recording's
    ``calls``, ``processes`` and ``recording``, or None)."""
    state, rows = data["state"], data["workers"]
    parts = [cluster_html(rows, state)]
    if rows and state == "ready":
        buttons = []
        for row in rows:
            if row.get("role") != "kernel":
                name = row["name"]
                buttons.append(
                    f'<div class="nbrpc-actions" data-worker="{escape(name)}">'
                    f"{_button('restart', name, f'restart {name}')}"
                    f"{_button('stacks', name, f'stacks of {name}')}</div>"
                )
        buttons.append(
            '<div class="nbrpc-actions">'
            f"{_button('stacks', '', 'all stacks')}{_button('shutdown', '', 'shut down')}</div>"
        )
        parts.append(_section("actions", "".join(buttons)))
    if data["members"]:
        ownership = ownership_svg(data["members"], data["rrefs"], fit=True)  # the side bar's width
        parts.append(_section("ownership", ownership))
    timeline = data["timeline"]
    if timeline is not None:
        parts.append(
            _section(
                "the last recording",
                timeline_html(timeline["calls"], timeline["processes"], timeline["recording"]),
            )
        )
    return f'<div class="nbrpc-panel-body" style="{FONT}">{"".join(parts)}</div>'


def panel_text(data: dict[str, Any]) -> str:
    """The panel as text (a front end without widgets)."""
    text = cluster_text(data["workers"], data["state"])
    if data["rrefs"]:
        text += "\n" + ownership_text(data["rrefs"])
    return text
