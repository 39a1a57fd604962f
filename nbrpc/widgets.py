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
import time
from typing import Any

import anywidget
import traitlets

from . import _process, _states, _timers, _views
from ._errors import NbrpcError
from ._gather import census, timeline
from ._lifecycle import actions, api as lifecycle
from ._rows import Trace

__all__ = ["BackwardView", "ClusterPanel", "ClusterView", "OwnershipView", "TimelineView", "panel"]

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

    def freeze(self) -> None:
        """Stop live updates; the widget stays, showing its last state."""
        self._stop.set()
        self._wake.set()
        _states.unlisten(self._on_worker_change)

    def close(self) -> None:
        """Stop live updates and close the widget, and its layout (a widget too)."""
        self.freeze()
        super().close()
        self.layout.close()

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


def _cluster_now() -> dict[str, Any]:
    """The cluster's state and every process's status row (closed: none), as
    :class:`ClusterView` and :class:`ClusterPanel` draw them."""
    try:
        cluster = lifecycle.current()
        return {
            "state": cluster.state.value,
            "workers": cluster.status(POLL_TIMEOUT_S, ask_ipyparallel=False),
        }
    except NbrpcError:  # none, or it closed meanwhile
        return {"state": "closed", "workers": []}


def _ownership_now() -> dict[str, Any]:
    """The group's members and every live RRef, as :class:`OwnershipView` and
    :class:`ClusterPanel` draw them."""
    try:
        return {"workers": lifecycle.workers(), "rrefs": census.ownership(POLL_TIMEOUT_S)}
    except NbrpcError:
        return {"workers": [], "rrefs": []}


def _recording_now(rec: timeline.Recording) -> dict[str, Any]:
    """A recording's calls and processes, as :class:`TimelineView` and
    :class:`ClusterPanel` draw them."""
    return {"calls": rec.calls, "processes": rec.processes, "recording": rec.recording}


class ClusterView(_LiveView):
    """One card per process: state, pid@host, devices, calls running/done, RRefs.

    ``%rpc_status`` shows one. ``live=True`` redraws every ``interval`` seconds.
    """

    def _compute(self) -> dict[str, Any]:
        return _cluster_now()

    def _render(self, data: dict[str, Any]) -> str:
        return _views.cluster_html(data["workers"], data["state"])

    def _text(self, data: dict[str, Any] | None) -> str:
        data = data or {"state": "closed", "workers": []}
        return _views.cluster_text(data["workers"], data["state"])


#: the views ``%rpc_status`` showed: the newest stays live (:func:`show_status`)
_status_shown = _views.Retiring(1)
#: the timelines ``%%rpc_timeline`` showed: the newest stay live (:func:`show_timeline`)
LIVE_TIMELINES = 8
_timelines_shown = _views.Retiring(LIVE_TIMELINES)


class _Shown:
    """A view nbrpc showed by itself, and its display."""

    def __init__(self, view: _View, handle: Any) -> None:
        self.view, self.handle = view, handle

    def retire(self) -> None:
        """Stop its updates, draw its last state once more as static HTML, and close it."""
        self.view.freeze()
        _views.retire(self.handle, self.view.html, repr(self.view), self.view)


def show_status() -> ClusterView:
    """Display a live :class:`ClusterView` for ``%rpc_status``, and return it. The one it
    showed before stops updating, and is drawn once more as static HTML of its last state,
    its widget closed. Each one asked every process for its figures every second, on a
    thread of its own, and none ever stopped: a notebook that ran ``%rpc_status`` 20
    times asked each worker 20 times a second, across shutdowns; and each one's widget
    stayed in the kernel for its life (the soak, docs/soak.md)."""
    from IPython.display import display

    view = ClusterView()
    _status_shown.add(_Shown(view, display(view, display_id=True)))
    return view


class OwnershipView(_LiveView):
    """Every live RRef drawn inside its owner's lane, with an edge to each holder.

    Redraws when RRefs are created or released (``live=True``: it asks every ``interval``
    seconds), from ``nbrpc.ownership()``.
    """

    def _compute(self) -> dict[str, Any]:
        return _ownership_now()

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
        """Collect the recording's new rows (while it records) and redraw if they changed;
        returns whether they did. Raises nothing a redraw's caller must handle: the live
        redraws log what fails and try again."""
        if self.rec.recording:
            self.rec.refresh()
        elif self._thread is not None:
            self._stop.set()  # the recording ended: this is the last redraw
        return super().refresh()

    def _compute(self) -> dict[str, Any]:
        return _recording_now(self.rec)

    def _render(self, data: dict[str, Any]) -> str:
        return _views.timeline_html(data["calls"], data["processes"], data["recording"])

    def _text(self, data: dict[str, Any] | None) -> str:
        if not data:
            return "TimelineView()"
        return _views.timeline_text(data["calls"], data["processes"], data["recording"])


def show_timeline(rec: timeline.Recording) -> tuple[TimelineView, Any]:
    """Display a :class:`TimelineView` of ``rec`` for ``%%rpc_timeline``; returns it and
    its display handle. The newest :data:`LIVE_TIMELINES` stay live widgets; an older one
    is drawn once more as static HTML (its SVG, the calls' tooltips kept) and closed: each
    held its widget and its drawing for the kernel's life (the soak, docs/soak.md)."""
    from IPython.display import display

    view = TimelineView(rec)
    handle = display(view, display_id=True)
    _timelines_shown.add(_Shown(view, handle))
    return view, handle


class ClusterPanel(_View):
    """The cluster beside the notebook (``%rpc_panel``, :func:`panel`): the card of every
    process, the ownership view and the last recording's timeline in one live view, with
    buttons that restart a worker, show stacks or shut the cluster down.

    It redraws as :class:`ClusterView` does (every ``interval`` seconds, at once on a
    worker's change), follows the cluster through shutdowns, inits and restarts, and says
    when there is none. Each button asks first in the panel, then sends its action to
    the kernel, which runs the same code as the magic (:mod:`nbrpc._lifecycle.actions`)
    when it reads the message: a kernel reads no widget message while a cell runs, so an
    action waits for the cell to end, and the panel says so. ``live=False``: drawn once,
    no redraws. ``status`` is what the last
    action said, ``output`` the stacks it showed; ``rendered`` turns true once a front end
    drew the panel. A panel whose front end closed stops asking the workers.
    """

    _esm = pathlib.Path(__file__).parent / "static" / "panel.js"

    status = traitlets.Unicode("", help="what the last action said").tag(sync=True)
    output = traitlets.Unicode("", help="the stacks an action showed").tag(sync=True)
    rendered = traitlets.Bool(False, help="a front end drew the panel").tag(sync=True)

    def __init__(self, *, interval: float = 1.0, live: bool = True) -> None:
        super().__init__()
        self.side: Any = None  # the side bar's widget it is shown in (panel())
        self.fallback: Any = None  # the cell's widget the card goes to if it is not drawn
        self.fallback_shown: Any = None  # its display
        self.card: ClusterView | None = None  # the card put there (it stops with the panel)
        self.on_msg(self._on_action)
        self.refresh()
        if live:
            self._start(interval)

    def _compute(self) -> dict[str, Any]:
        owned = _ownership_now()
        rec = timeline.latest()
        if rec is not None and rec.recording:
            rec.refresh()
        cluster = _cluster_now()
        if cluster["state"] == "closed":  # says there is none (ClusterView: the last rows)
            cluster["workers"] = []
        return {
            **cluster,
            "members": owned["workers"],
            "rrefs": owned["rrefs"],
            "timeline": None if rec is None else _recording_now(rec),
        }

    def _render(self, data: dict[str, Any]) -> str:
        return _views.panel_html(data)

    def _text(self, data: dict[str, Any] | None) -> str:
        if not data:
            return "ClusterPanel()"
        return _views.panel_text(data)

    def act(self, action: str, target: str = "") -> str:
        """Run one of the panel's actions as its button does, and say what came of it in
        the panel (``status``); returns that text. ``action``: ``"restart"`` (the worker
        ``target``), ``"stacks"`` (of ``target``, or of every process when it is ``""``) or
        ``"shutdown"``. Raises nothing: an action's error is said in the panel, as the
        magic's cell would show it."""
        started = time.monotonic()
        try:
            if action == "restart":
                said = actions.restart(target)
            elif action == "stacks":
                self.output = actions.stacks(*([target] if target else []))
                said = f"nbrpc: the stacks of {target or 'every process'} are below"
            elif action == "shutdown":
                said = actions.shut_down()
            else:
                said = f"nbrpc: the panel has no action {action!r}"
        except Exception as exc:  # said in the panel, as the magic's cell would show it
            said = f"nbrpc: {action} {target}: {type(exc).__name__}: {exc}".replace("  ", " ")
        self.status = f"{said} ({time.monotonic() - started:.1f} s)"
        self._wake.set()  # redraw now, not at the interval's end
        return said

    def close(self) -> None:
        """Stop asking the workers, and close the side bar's panel it is shown in; the
        card shown in the cell instead stops updating, and is drawn there once more as
        static HTML of its last state, its widget closed. Raises nothing."""
        super().close()
        if self.side is not None:
            _views.close_widget(self.side)
        if self.card is not None:
            self.card.freeze()
        if self.fallback is not None:
            card = self.card
            html, text = (card.html, repr(card)) if card is not None else ("", "")
            _views.retire(self.fallback_shown, html, text, self.fallback)
        if self.card is not None:
            _views.close_widget(self.card)

    def _on_action(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        action, target = content.get("action", ""), content.get("target", "")
        if action == "closed":  # its front end went: nothing asks the workers any more
            self._stop.set()
            self._wake.set()
            return
        self.act(action, target)


#: where the panel works (``%rpc_panel`` always says it: a kernel cannot tell its front end)
PANEL_WHERE = (
    "nbrpc: the cluster panel opens in JupyterLab's right side bar (the jupyterlab-sidecar "
    "extension, installed with nbrpc); where it cannot, the card is shown here instead"
)
#: how long the panel's front end has to say it drew the panel before the card is shown
CONFIRM_S = 2.0
_open: list[ClusterPanel] = []


def panel(*, interval: float = 1.0) -> None:
    """Open the cluster panel (:class:`ClusterPanel`) in JupyterLab's side bar
    (``%rpc_panel``). Always prints where it works; in a front end that does not draw it
    within ``CONFIRM_S`` seconds (2; classic Notebook, VS Code), the card is shown in
    the cell; in a script, the cluster's table is printed. A panel opened before closes.
    ``interval``: seconds between the panel's redraws. Raises nothing: without a cluster
    the panel says there is none, and follows the next one."""
    print(PANEL_WHERE)
    for old in _open:
        old.close()
    _open.clear()
    if not _process.in_notebook():
        cluster = lifecycle.running()
        print(cluster.summary() if cluster is not None else "nbrpc: no cluster is running")
        return
    import ipywidgets
    from IPython.display import display

    try:
        from sidecar import Sidecar
    except ImportError:
        print("nbrpc: the panel is unavailable here (no sidecar package: pip install sidecar)")
        display(ClusterView())
        return
    view = ClusterPanel(interval=interval)
    _open.append(view)
    side = view.side = Sidecar(title="nbrpc cluster", anchor="right")
    with side:
        display(view)
    here = view.fallback = ipywidgets.Output()
    view.fallback_shown = display(here, display_id=True)

    def card_unless_drawn() -> None:
        if not view.rendered and not view._stop.is_set():
            view.card = ClusterView()
            here.append_display_data(view.card)

    _timers.after(CONFIRM_S, card_unless_drawn)
