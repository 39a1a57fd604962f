"""Stack dumps as the kernel takes them in: from several hosts at once, read into threads.

:mod:`.stacks` is what a process of a cluster sets up to be asked for its stacks without
its GIL, and the reading of those of this host's processes; it is also the script the
engine sources run on a worker's host (it imports only the standard library for that
reason). Here is what the kernel does with it: :func:`gather` runs that script on every
host at once (over ssh, or as a Slurm step) and :func:`parse` reads a dump's text, in
faulthandler's format or :func:`.stacks.format_threads`', into threads and frames.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbrpc import _timers

from . import stacks

_THREAD = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-f]+)(?: \[(.*)\])? \(most recent call first\):"
)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def gather(
    engines: dict[int, tuple[str, int]], run: Callable[[str, list[str]], str]
) -> dict[int, dict[str, Any]]:
    """:func:`.stacks.collect` on several hosts at once. ``engines``: engine id -> (its
    host, its pid there); ``run(host, argv)`` runs ``argv`` (``-c``, :mod:`.stacks`'
    source, the pids: what the host's Python is given) there, over ssh or as a Slurm step,
    and returns its stdout. The parts by engine id (pids of two hosts may be equal), or an
    error naming the host."""
    source = Path(stacks.__file__).read_text()
    places: dict[str, dict[int, int]] = {}  # host -> pid -> engine id
    for eid, (place, pid) in engines.items():
        places.setdefault(place, {})[pid] = eid
    found: dict[int, dict[str, Any]] = {}

    def one(place: str, ids: dict[int, int]) -> None:
        try:
            out = json.loads(run(place, ["-c", source, *map(str, ids)]))
            found.update({ids[int(p)]: part for p, part in out.items()})
        except Exception as exc:  # no answer from that host: said in its rows
            found.update({eid: {"error": f"{place}: {exc}"} for eid in ids.values()})

    _timers.at_once(one, places.items(), None)  # (``run`` bounds each host's wait)
    return found


def parse(dump: str) -> list[dict[str, Any]]:
    """A dump (faulthandler's text, or :func:`.stacks.format_threads`') as threads, frames
    innermost last, as a traceback prints."""
    threads: list[dict[str, Any]] = []
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append(
                {
                    "thread": int(head.group(2), 16),
                    "name": head.group(3),
                    "current": head.group(1) == "Current thread",
                    "frames": [],
                }
            )
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1]["frames"].insert(
                0, {"file": frame.group(1), "line": int(frame.group(2)), "function": frame.group(3)}
            )
    return threads
