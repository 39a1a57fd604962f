"""A worker's tqdm bar drawn in the kernel, in a notebook: one row of widgets (label,
progress, tqdm's figures) per bar, updated in place (:func:`nbrpc._wire.output.show_bar`
brings each state; a terminal gets text there instead).

ipywidgets keeps every widget until it is closed, and a bar is 11 of them (4, their
layouts and styles): 30 KB a bar in the kernel (1,000 bars: 29.8 MB), held for the
kernel's life, so that a day of training loops on workers grew the kernel without bound.
A finished bar stays live among the newest :data:`LIVE_FINISHED_BARS`; an older one is
drawn once more as static HTML (its text bar as text/plain, what nbval and nbconvert
keep) and its widgets are closed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from html import escape
from typing import Any

from nbrpc._views import Retiring, retire, widget_bundle

#: Finished bars kept as live widgets, the newest; an older one is drawn once more as
#: static HTML and its widgets closed. ipywidgets keeps every widget until it is closed:
#: 11 a bar, with layouts and styles (1,000 bars: 29.8 MB), for the kernel's life.
LIVE_FINISHED_BARS = 32


@dataclass
class _Bars:
    """The bars shown in the kernel, by (worker, bar id), until they close; then the
    newest finished ones, oldest first, still live."""

    shown: dict[tuple[str, int], Any] = field(default_factory=dict)
    finished: Retiring = field(default_factory=lambda: Retiring(LIVE_FINISHED_BARS))
    lock: threading.Lock = field(default_factory=threading.Lock)


_bars = _Bars()


class _Row:
    """One worker's bar in a notebook: label, progress, tqdm's figures; one display."""

    def __init__(self, worker: str, state: dict[str, Any]) -> None:
        import ipywidgets as w
        from IPython.display import display

        self.worker = worker
        self.label = w.HTML(layout={"width": "auto"})
        self.progress = w.IntProgress(min=0, max=max(state["total"], 1))
        self.figures = w.HTML()
        self.box = w.HBox([self.label, self.progress, self.figures])
        self.handle = display(self._bundle(state), raw=True, display_id=True)
        self.update(state)

    def _bundle(self, state: dict[str, Any]) -> dict[str, Any]:
        return widget_bundle(self.box, f"[{self.worker}] {state['text']}")

    def update(self, state: dict[str, Any]) -> None:
        desc = state["desc"].rstrip(": ")
        self.label.value = f"<code>[{escape(self.worker)}]</code> {escape(desc)}".rstrip()
        if state["total"]:
            self.progress.max = state["total"]
            self.progress.value = min(state["n"], state["total"])
        else:  # unknown total: a full bar that fills as the count says
            self.progress.value = self.progress.max
        meter = state["text"]  # tqdm's figures: what follows its bar
        self.figures.value = f"<code>{escape(meter.split('|')[-1].strip())}</code>"
        if state["closed"]:
            done = not state["total"] or state["n"] >= state["total"]
            self.progress.bar_style = "success" if done else "danger"
            final = self._bundle(state)
            self.handle.update(final, raw=True)  # the text bar, final
            self.final_text = final["text/plain"]

    def retire(self) -> None:
        """Draw the finished bar once more as static HTML, from its widgets' last values
        (its text bar as text/plain), then close its widgets: the cell keeps showing it,
        the kernel holds nothing."""
        bar = f'<progress value="{self.progress.value}" max="{self.progress.max}"></progress>'
        html = f"<div>{self.label.value} {bar} {self.figures.value}</div>"
        retire(self.handle, html, self.final_text, self.box)


def draw(worker: str, state: dict[str, Any]) -> None:
    """One bar's new state (``state["id"]``: the bar, on ``worker``), in the cell."""
    key = (worker, state["id"])
    with _bars.lock:
        row = _bars.shown.get(key)
        if row is None:
            _bars.shown[key] = row = _Row(worker, state)
        else:
            row.update(state)
        if state["closed"]:
            del _bars.shown[key]
            _bars.finished.add(row)
