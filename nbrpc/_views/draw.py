"""What every view draws with: the font, sizes in bytes, text columns, and a widget's
display data with a text fallback. Pure functions; nbrpc imports nothing here."""

from __future__ import annotations

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
