"""The stacks view: every thread of every process with the call it serves
(``%rpc_stacks``); from the rows ``nbrpc.stacks()`` returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: how a process's stacks were read (``StackRow.how``), as the view says it
_READ_BY = {
    "thread": "its stack thread",
    "signal": "a signal (a thread holds the GIL)",
    "rpc": "RPC",
    "this process": "this process",
}


def stacks_text(rows: Sequence[Mapping[str, Any]], frames: int = 12) -> str:
    """Every process's threads, those serving a call first; each thread's innermost
    ``frames`` frames, innermost last (as a traceback prints)."""
    lines: list[str] = []
    for r in rows:
        how = _READ_BY.get(r["how"], r["how"])
        lines.append(f"== {r['name']} (pid {r['pid']} on {r['host']}, read by {how})")
        if r["error"]:
            lines.append(f"   {r['error']}")
        for t in sorted(r["threads"], key=lambda t: t["serving"] is None):
            label = t["name"] or f"thread {t['thread']:#x}"
            serving = f": serving {t['serving']}" if t["serving"] else ""
            lines.append(f"-- {label}{serving}")
            shown = t["frames"][-frames:]
            if len(t["frames"]) > len(shown):
                lines.append(f"   ... {len(t['frames']) - len(shown)} outer frames")
            for f in shown:
                lines.append(f'   File "{f["file"]}", line {f["line"]}, in {f["function"]}')
    return "\n".join(lines)
