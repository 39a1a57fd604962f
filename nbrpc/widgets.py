"""Widgets that show the cluster, who owns which RRef, and how a backward pass crossed workers.

Each view is an anywidget whose front end (``static/views.js``, bundled: no CDN) draws the
HTML/SVG that :mod:`nbrpc._views` computes in Python from plain data. The data is kept on
the widget as ``.data``, so tests check it without a browser, and every view has a
text/HTML repr for front ends without widgets (nbconvert, a terminal).

:class:`ClusterView` and :class:`OwnershipView` are live: a daemon thread asks the workers
for their figures every ``interval`` seconds and redraws when something changed; a change
of a worker's state (:mod:`nbrpc._states`, which the views listen to) asks at once. It
runs beside the kernel's main thread, so the views update while a cell is busy too. It
never touches the ipyparallel client (which is not thread-safe); dead workers show up
through their pids and failed calls. ``close()`` stops it.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from typing import Any

import anywidget
import traitlets

from . import _states, _views
from ._calls import facade as calls
from ._errors import NbrpcError
from ._gather import census, timeline
from ._lifecycle import cluster as lifecycle
from ._rows import Trace

__all__ = ["BackwardView", "ClusterView", "OwnershipView", "TimelineView"]

log = logging.getLogger("nbrpc")

POLL_TIMEOUT_S = 2.0


class _View(anywidget.AnyWidget):
    _esm = pathlib.Path(__file__).parent / "static" / "views.js"

    html = traitlets.Unicode("", help="the view's HTML/SVG, computed by nbrpc._views").tag(
        sync=True
    )
    version = traitlets.Int(0, help="how many times the view was redrawn").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data: Any = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a worker's state changed, or the view closes
        self._thread: threading.Thread | None = None

    # -- drawing ------------------------------------------------------------------------

    def _compute(self) -> Any:
        raise NotImplementedError

    def _render(self, data: Any) -> str:
        raise NotImplementedError

    def _text(self, data: Any) -> str:
        raise NotImplementedError

    def refresh(self) -> bool:
        """Fetch the data now and redraw if it changed; returns whether it changed."""
        data = self._compute()
        if data == self.data:
            return False
        self.data = data
        self.html = self._render(data)
        self.version += 1
        return True

    # -- live updates -------------------------------------------------------------------

    def _start(self, interval: float) -> None:
        self.interval = interval
        self._thread = threading.Thread(
            target=self._poll, name=f"nbrpc-{type(self).__name__}", daemon=True
        )
        _states.listen(self._on_worker_change)
        self._thread.start()

    def _on_worker_change(self, change: _states.WorkerChange) -> None:
        """A listener of :mod:`nbrpc._states`: the next redraw comes now, not at the
        interval's end (on the view's own thread: this one made the change)."""
        self._wake.set()

    def _poll(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception as exc:  # a worker mid-shutdown, a closed comm: try again later
                log.debug("%s refresh failed: %s", type(self).__name__, exc)

    @property
    def live(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        """Stop live updates and close the widget."""
        self._stop.set()
        self._wake.set()
        _states.unlisten(self._on_worker_change)
        super().close()

    # -- front ends without widgets -----------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
        data = dict(data or {})
        data["text/plain"] = self._text(self.data)
        data["text/html"] = self.html
        return (data, meta) if isinstance(bundle, tuple) else data

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self._text(self.data) if self.data is not None else type(self).__name__ + "()"


class _LiveView(_View):
    """A view that redraws by itself every ``interval`` seconds while ``live``."""

    def __init__(self, *, live: bool = True, interval: float = 1.0) -> None:
        super().__init__()
        self.refresh()
        if live:
            self._start(interval)


class ClusterView(_LiveView):
    """One card per process: state, pid@host, devices, calls running/done, RRefs.

    ``%rpc_status`` shows one. ``live=True`` redraws every ``interval`` seconds.
    """

    def _compute(self) -> dict[str, Any]:
        try:
            cluster = lifecycle.current()
        except NbrpcError:
            return {"state": "closed", "workers": []}
        return {
            "state": cluster.state.value,
            "workers": cluster.status(POLL_TIMEOUT_S, ask_ipyparallel=False),
        }

    def _render(self, data: dict[str, Any]) -> str:
        return _views.cluster_html(data["workers"], data["state"])

    def _text(self, data: dict[str, Any] | None) -> str:
        data = data or {"state": "closed", "workers": []}
        return _views.cluster_text(data["workers"], data["state"])


class OwnershipView(_LiveView):
    """Every live RRef drawn inside its owner's lane, with an edge to each holder.

    Redraws when RRefs are created or released (``live=True``), from ``nbrpc.ownership()``.
    """

    def _compute(self) -> dict[str, Any]:
        try:
            workers = calls.workers()
            rrefs = census.ownership(POLL_TIMEOUT_S)
        except NbrpcError:
            return {"workers": [], "rrefs": []}
        return {"workers": workers, "rrefs": rrefs}

    def _render(self, data: dict[str, Any]) -> str:
        return _views.ownership_svg(data["workers"], data["rrefs"])

    def _text(self, data: dict[str, Any] | None) -> str:
        return _views.ownership_text((data or {}).get("rrefs", []))


class BackwardView(_View):
    """The cross-worker backward graph of one distributed autograd context.

    ``trace`` is what ``nbrpc.trace_backward(context_id)`` returned, or the context id
    itself. One lane per worker; send→recv hops are drawn across lanes in orange; per-node
    and per-worker times appear when the backward ran with ``timed=True``.
    """

    def __init__(self, trace: Trace | int) -> None:
        super().__init__()
        if isinstance(trace, int):
            from .autograd import trace_backward

            trace = trace_backward(trace)
        self._trace: Trace = trace
        self.refresh()

    def _compute(self) -> Trace:
        return self._trace

    def _render(self, data: dict[str, Any]) -> str:
        return _views.backward_svg(data)

    def _text(self, data: dict[str, Any] | None) -> str:
        return _views.backward_text(data) if data else "BackwardView()"


class TimelineView(_View):
    """The calls of a recording (``nbrpc.record()``): one lane per process, a bar per call
    on the process that ran it (calls made inside a call a step lower), an arrow from the
    caller at the moment it sent, the row as the bar's tooltip.

    While ``rec`` records, the view collects and redraws every ``interval`` seconds, and
    once more when the recording stops.
    """

    def __init__(self, rec: timeline.Recording, *, interval: float = 0.5) -> None:
        super().__init__()
        self.rec = rec
        self.refresh()
        if rec.recording:
            self._start(interval)

    def refresh(self) -> bool:
        if self.rec.recording:
            self.rec.refresh()
        elif self._thread is not None:
            self._stop.set()  # the recording ended: this is the last redraw
        return super().refresh()

    def _compute(self) -> dict[str, Any]:
        return {
            "calls": self.rec.calls,
            "processes": self.rec.processes,
            "recording": self.rec.recording,
        }

    def _render(self, data: dict[str, Any]) -> str:
        return _views.timeline_html(data["calls"], data["processes"], data["recording"])

    def _text(self, data: dict[str, Any] | None) -> str:
        if not data:
            return "TimelineView()"
        return _views.timeline_text(data["calls"], data["processes"], data["recording"])
