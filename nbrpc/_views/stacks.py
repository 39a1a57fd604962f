"""The stacks view: the threads of every process with the call each serves
(``%rpc_stacks``); from the rows ``nbrpc.stacks()`` returns.

By default it shows the threads that matter to the person asking: those serving a call and
those running their code (a frame of a notebook cell, a ``%%rpc`` cell or a file that is no
library's). The others, nbrpc's, IPython's, torch's and ipyparallel's own threads waiting
for work (25,000-34,000 characters on an idle cluster of 2 workers), are counted, and
``%rpc_stacks --all`` shows them too; the rows always hold every thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nbrpc._errors import counted, library_file

#: how a process's stacks were read (``StackRow.how``), as the view says it
_READ_BY = {
    "thread": "its stack thread",
    "signal": "a signal (a thread holds the GIL)",
    "rpc": "RPC",
    "this process": "this process",
}


def stacks_text(
    rows: Sequence[Mapping[str, Any]], frames: int = 12, all_threads: bool = False
) -> str:
    """Every process's threads, those serving a call first; each thread's innermost
    ``frames`` frames, innermost last (as a traceback prints). Without ``all_threads``
    only the threads that serve a call or run the user's code (:func:`matters`), and how
    many others each process has."""
    lines: list[str] = []
    hidden = 0
    for r in rows:
        how = _READ_BY.get(r["how"], r["how"])
        lines.append(f"== {r['name']} (pid {r['pid']} on {r['host']}, read by {how})")
        if r["error"]:
            lines.append(f"   {r['error']}")
        shown = [t for t in r["threads"] if all_threads or matters(t)]
        for t in sorted(shown, key=lambda t: t["serving"] is None):
            label = t["name"] or f"thread {t['thread']:#x}"
            serving = f": serving {t['serving']}" if t["serving"] else ""
            lines.append(f"-- {label}{serving}")
            inner = t["frames"][-frames:]
            if len(t["frames"]) > len(inner):
                lines.append(f"   ... {len(t['frames']) - len(inner)} outer frames")
            for f in inner:
                lines.append(f'   File "{f["file"]}", line {f["line"]}, in {f["function"]}')
        left = len(r["threads"]) - len(shown)
        if left:
            hidden += left
            lines.append(
                f"   ({'no thread serves a call or runs your code; ' if not shown else ''}"
                f"{counted(left, 'other thread')} of nbrpc's and the libraries' left out)"
            )
    if hidden:
        lines.append(
            f"nbrpc: left out {counted(hidden, 'thread')} serving no call and running none of "
            "your code; %rpc_stacks --all shows every thread (nbrpc.stacks() returns them all)"
        )
    return "\n".join(lines)


def matters(thread: Mapping[str, Any]) -> bool:
    """A thread worth showing by default: it serves a call, or one of its frames is the
    user's code (not nbrpc's, torch's, IPython's, the standard library's or a package's)."""
    return bool(thread["serving"]) or any(not library_file(f["file"]) for f in thread["frames"])
