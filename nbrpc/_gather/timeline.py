"""``nbrpc.record()``: which calls ran where, how long, inside which other call.

Every process writes the rows of the calls it served, on its own clock
(:mod:`nbrpc._wire.recording`). This module, in the kernel, turns recording on and off in
every process of the group, collects the rows (also while recording, for a live view),
joins each with the size and path of its request (kept by the caller) and puts all times
on the kernel's clock, in seconds since the recording started.

Clocks: each process's offset from the kernel's clock is measured when it joins (and at
the first recording for one that joined otherwise): five round trips, the shortest one
kept, ``offset = its clock - (sent + received) / 2``. An offset smaller than half that
round trip cannot be told from zero and is taken as zero (processes of one host share a
clock), so a call made inside another call lies within it. Across hosts, the error of an
offset is at most half the shortest round trip (microseconds on a LAN).

``rec.save(path)`` writes Chrome's trace event format (Perfetto, chrome://tracing): a
track per process, a complete event per call on its callee's track (on the thread that
ran it), the caller's waiting on the caller's track, and a flow arrow from each call's
sending to its running.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from typing import Any

from nbrpc import _group, _process, _torch
from nbrpc._calls import facade as calls
from nbrpc._errors import NbrpcError
from nbrpc._rows import CallRow
from nbrpc._views import timeline_text
from nbrpc._wire import recording

from . import census

_ROUNDS = 5
_ASK_TIMEOUT_S = 10.0

_offsets: dict[int, float] = {}  # rank -> its clock minus the kernel's, seconds
_offsets_lock = threading.Lock()


def _rank(name: str) -> int:
    return _torch.agent().get_worker_info(name).id


def measure_clocks(names: list[str]) -> None:
    """Measure the clock offsets of ``names`` not measured yet (at their join)."""
    for name in names:
        try:
            rank = _rank(name)
        except RuntimeError:
            continue
        if rank in _offsets:
            continue
        best: tuple[float, float] | None = None
        for _ in range(_ROUNDS):
            t0 = recording.clock()
            try:
                theirs = calls.rpc_sync(name, recording.clock, timeout=_ASK_TIMEOUT_S)
            except (NbrpcError, RuntimeError):
                break
            t1 = recording.clock()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, theirs - (t0 + t1) / 2)
        if best is not None:
            rtt, offset = best
            with _offsets_lock:
                _offsets[rank] = 0.0 if abs(offset) <= rtt / 2 else offset


def offset_of(name: str) -> float:
    """``name``'s clock minus the kernel's, as measured (0 for the kernel, or unknown)."""
    try:
        return _offsets.get(_rank(name), 0.0)
    except RuntimeError:
        return 0.0


class Recording:
    """The calls of one recording (``with nbrpc.record() as rec:``); see the module doc.

    ``rec.calls``: the rows (:class:`~nbrpc.CallRow`), by start; ``rec.save(path)``: a
    Chrome trace; ``nbrpc.widgets.TimelineView(rec)`` draws it, live while it records.
    """

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.recording = False
        self.t0 = 0.0  # the kernel's clock when it started
        self.seconds = 0.0  # how long it recorded
        self.processes: list[str] = []
        self._rows: dict[int, dict] = {}
        self._sent: dict[int, dict] = {}
        self._offsets: dict[str, float] = {}
        self._lock = threading.Lock()

    # -- on and off -------------------------------------------------------------------

    def start(self) -> Recording:
        """Start recording in every process of the cluster (``with`` does it); returns
        the recording. Raises :class:`~nbrpc.NotInitializedError` when no cluster runs."""
        _group.require_active("nbrpc.record()")
        me = _process.name()
        others = [n for n in _group.member_names() if n != me]
        measure_clocks(others)
        self.processes = [me, *others]
        self._offsets = {name: offset_of(name) for name in self.processes}  # the kernel: 0
        self.t0 = recording.clock()
        self._everywhere(recording.start)
        self.recording = True
        _latest[:] = [self]
        return self

    def stop(self) -> Recording:
        """Stop recording everywhere and collect the rows (the ``with`` block's end does
        it); returns the recording. Raises nothing: a worker that does not answer is left
        out, and stopping a stopped recording does nothing."""
        if not self.recording:
            return self
        self.recording = False
        self.seconds = recording.clock() - self.t0
        self._take(self._everywhere(recording.stop))
        return self

    def refresh(self) -> bool:
        """Collect the rows finished so far (a live view calls this); whether any came.
        Raises nothing: a worker that does not answer is left out until the next time."""
        if not self.recording:
            return False
        before = len(self._rows)
        self._take(self._everywhere(recording.drain))
        return len(self._rows) != before

    def __enter__(self) -> Recording:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _everywhere(self, func: Any) -> dict[str, Any]:
        """``func(token)`` here, then on every worker of the recording at once; answers by
        name (a worker that does not answer is left out)."""
        here = {self.processes[0]: func(self.token)}
        return {**here, **census.ask_all(self.processes[1:], func, (self.token,), _ASK_TIMEOUT_S)}

    def _take(self, parts: dict[str, dict[str, Any]]) -> None:
        """Keep the rows and request sizes each process (by name) handed out."""
        with self._lock:
            for callee, part in parts.items():
                for row in part["rows"]:
                    self._rows[row["id"]] = {**row, "callee": callee}  # it ran there
                self._sent.update(part["sent"])

    # -- the rows ---------------------------------------------------------------------

    @property
    def calls(self) -> list[CallRow]:
        """Every call recorded, by start (seconds since the recording started)."""
        with self._lock:
            rows, sent = list(self._rows.values()), dict(self._sent)
        out = [self._row(r, sent.get(r["id"])) for r in rows]
        out.sort(key=lambda r: (r["start_s"], r["id"]))
        return out

    def _time(self, t: float, name: str) -> float:
        return t - self._offsets.get(name, 0.0) - self.t0

    def _row(self, r: dict, sent: dict | None) -> CallRow:
        callee = r["callee"]
        return {
            "id": r["id"],
            "parent": r["parent"],
            "caller": r["caller"],
            "callee": callee,
            "function": r["function"],
            "sent_s": self._time(r["sent"], r["caller"]),
            "start_s": self._time(r["start"], callee),
            "end_s": self._time(r["end"], callee),
            "bytes_in": sent["bytes"] if sent else None,
            "bytes_out": r["bytes_out"],
            "path_in": sent["path"] if sent else None,
            "path_out": r["path_out"],
            "route": r.get("route", "tensorpipe"),
            "ok": r["ok"],
            "error": r["error"],
            "thread": r["thread"],
        }

    # -- export -----------------------------------------------------------------------

    def trace_events(self) -> dict[str, Any]:
        """The recording in Chrome's trace event format (see :meth:`save`). Raises
        nothing."""
        return chrome_trace(self.calls, self.processes)

    def save(self, path: str | os.PathLike) -> str:
        """Write the recording as a Chrome trace (JSON) that Perfetto and
        chrome://tracing open, to ``path``; returns the path. Raises ``OSError`` when the
        file cannot be written."""
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump(self.trace_events(), f)
        return path

    def __repr__(self) -> str:
        return timeline_text(self.calls, self.processes, self.recording)


def chrome_trace(calls: list[CallRow], processes: list[str]) -> dict[str, Any]:
    """Chrome's trace event format: ``pid`` is the process's place in ``processes``, a
    call's complete event (``ph: X``) is on its callee, the caller's wait on the caller
    (``tid`` 0, "calls made"), and a flow (``ph: s`` / ``f``) joins the two."""
    names = list(processes)
    for row in calls:
        for name in (row["caller"], row["callee"]):
            if name not in names:
                names.append(name)
    pid = {name: i + 1 for i, name in enumerate(names)}
    events: list[dict[str, Any]] = []
    for name, p in pid.items():
        events.append({"ph": "M", "pid": p, "name": "process_name", "args": {"name": name}})
        order = {"sort_index": p}
        events.append({"ph": "M", "pid": p, "name": "process_sort_index", "args": order})
        events.append(
            {"ph": "M", "pid": p, "tid": 0, "name": "thread_name", "args": {"name": "calls made"}}
        )
    for row in calls:
        us = 1e6
        plain: dict[str, Any] = dict(row)
        args = {k: plain[k] for k in CALL_ARGS}
        run = {
            "ph": "X",
            "name": row["function"],
            "cat": "call" if row["ok"] else "call,error",
            "pid": pid[row["callee"]],
            "tid": row["thread"] % 1_000_000,
            "ts": row["start_s"] * us,
            "dur": max(row["end_s"] - row["start_s"], 0.0) * us,
            "args": args,
        }
        wait = {
            "ph": "X",
            "name": f"{row['function']} on {row['callee']}",
            "cat": "sent",
            "pid": pid[row["caller"]],
            "tid": 0,
            "ts": row["sent_s"] * us,
            "dur": max(row["end_s"] - row["sent_s"], 0.0) * us,
            "args": {"id": row["id"]},
        }
        flow = {"name": "rpc", "cat": "rpc", "id": row["id"], "bp": "e"}
        events += [
            wait,
            run,
            {**flow, "ph": "s", "pid": wait["pid"], "tid": 0, "ts": wait["ts"]},
            {**flow, "ph": "f", "pid": run["pid"], "tid": run["tid"], "ts": run["ts"]},
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


#: the row's keys a trace event carries in ``args``
CALL_ARGS = (
    "id",
    "parent",
    "caller",
    "callee",
    "sent_s",
    "bytes_in",
    "bytes_out",
    "path_in",
    "path_out",
    "route",
    "ok",
    "error",
)


_latest: list[Recording] = []  # the last recording started in this kernel


def latest() -> Recording | None:
    """The recording this kernel started last (the cluster panel draws it), or None."""
    return _latest[0] if _latest else None


def record() -> Recording:
    """Record every call the cluster's processes make: ``with nbrpc.record() as rec:``.

    ``rec.calls`` lists them (caller, callee, function, times on one clock, bytes each
    way, the tensors' path, the exception's type, the parent call), ``rec.save(path)``
    writes a Chrome trace, ``nbrpc.widgets.TimelineView(rec)`` draws it. Returns the
    :class:`Recording`, not started: entering the ``with`` block raises
    :class:`~nbrpc.NotInitializedError` when no cluster runs.
    """
    return Recording()
