"""What every view draws with: the font, sizes in bytes, text columns, a widget's display
data with a text fallback, and the retirement of displays no longer live (:class:`Retiring`).
nbrpc imports nothing here.

ipywidgets keeps every widget until it is closed, with its layout and style (widgets too),
for the kernel's life: a bar is 11 widgets (30 KB in the kernel), a boot's progress 27 for
two workers, and a day of ``%rpc_init``, ``%rpc_status`` and tqdm loops grew the kernel
without bound (docs/soak.md: 40 widgets a cycle). A display that no longer changes is
drawn once more as static HTML, through its display handle, and its widgets are closed.
"""

from __future__ import annotations

import threading
from typing import Any

FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


def bytes_text(n: int | None) -> str:
    if n is None:
        return "–"
    if n < 2**10:
        return f"{n} B"
    for unit, size in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.0f} KB"


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


def widget_bundle(widget: Any, text: str) -> dict[str, Any]:
    """``widget``'s display data with ``text`` as its text/plain: what a front end without
    widgets (nbval, nbconvert, a terminal) shows instead of "HBox(...)"."""
    bundle = widget._repr_mimebundle_()
    data = dict(bundle[0] if isinstance(bundle, tuple) else bundle or {})
    data["text/plain"] = text
    return data


def close_widget(widget: Any) -> None:
    """Close ``widget``, its children, and the layout and style of each (widgets too)."""
    for child in getattr(widget, "children", ()):
        close_widget(child)
    for part in (getattr(widget, "layout", None), getattr(widget, "style", None), widget):
        if part is not None:
            part.close()


def retire(handle: Any, html: str, text: str, widget: Any) -> None:
    """Draw a display once more as static ``html`` (``text`` as its text/plain: what
    nbval and nbconvert keep) through its display ``handle`` (None: none to update), then
    close ``widget`` and every widget in it: the cell keeps showing it, the kernel holds
    nothing."""
    if handle is not None:
        handle.update({"text/plain": text, "text/html": html}, raw=True)
    close_widget(widget)


class Retiring:
    """The displays of one kind of which the newest ``keep`` stay live: as another is
    added, the oldest beyond them is retired (its ``retire()``, which calls
    :func:`retire`). Thread-safe: bars come from the output thread."""

    def __init__(self, keep: int) -> None:
        assert keep >= 1, keep
        self.keep = keep
        self.live: list[Any] = []
        self._lock = threading.Lock()

    def add(self, shown: Any) -> None:
        """``shown`` (with a ``retire()``) is the newest; retire those beyond ``keep``."""
        with self._lock:
            self.live.append(shown)
            old = self.live[: -self.keep]
            del self.live[: -self.keep]
        for each in old:
            each.retire()
