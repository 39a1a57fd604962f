"""Per-worker progress while a cluster boots, and the boot's phases with their times.

In a notebook: a line of phases (controller, engines, torch import, join) above one row
per worker (name, a progress bar, the current step), drawn with ipywidgets and updated in
place. Elsewhere (scripts, plain IPython): one line per step on stderr when asked for,
silent otherwise.

Only the newest boot's progress stays live: as another boot starts, the one before is
drawn once more as static HTML and its widgets (27 for two workers) are closed
(:class:`nbrpc._views.Retiring`); each boot's were kept for the kernel's life.
"""

from __future__ import annotations

import sys
import time

from nbrpc._views import Retiring, retire, widget_bundle

STEPS = ("waiting", "engine started", "joining RPC", "ready")
#: the line of phases before the first phase ended
NO_PHASE_YET = "starting the controller and engines"

#: the boots' progress shown in notebooks: the newest stays live
_shown = Retiring(1)


class BootProgress:
    """Shows each worker's boot step; ``mode`` is "widget", "text" or "off"."""

    def __init__(self, names: list[str], mode: str) -> None:
        self.names = list(names)
        self.mode = mode
        self.started = time.monotonic()
        self.steps = dict.fromkeys(self.names, 0)
        self.details = dict.fromkeys(self.names, "")
        self._rows: dict = {}
        self.phases: dict[str, str] = {}
        if mode == "widget":
            self._build_widgets()

    def _build_widgets(self) -> None:
        import ipywidgets as w
        from IPython.display import display

        self._phases = w.HTML(value=f"<small>{NO_PHASE_YET}</small>")
        rows = [self._phases]
        for name in self.names:
            bar = w.IntProgress(value=0, min=0, max=len(STEPS) - 1, layout={"width": "12em"})
            label = w.HTML(value=STEPS[0])
            rows.append(
                w.HBox([w.HTML(value=f"<code>{name}</code>", layout={"width": "8em"}), bar, label])
            )
            self._rows[name] = (bar, label)
        self._box = w.VBox(rows)
        # a front end without widgets shows text/plain: say what happens, not "VBox(...)"
        workers = "worker" if len(self.names) == 1 else "workers"
        text = f"nbrpc: starting {len(self.names)} {workers} ({', '.join(self.names[:8])}"
        text += ", ...)" if len(self.names) > 8 else ")"
        self._handle = display(widget_bundle(self._box, text), raw=True, display_id=True)
        _shown.add(self)

    def retire(self) -> None:
        """Draw the progress once more as static HTML, as its widgets show it now, and
        close them (a newer boot's progress is shown)."""
        html = [f"<div>{self._phases.value}</div>"]
        text = [" · ".join(self.phases.values()) or NO_PHASE_YET]
        for name, (bar, label) in self._rows.items():
            meter = f'<progress value="{bar.value}" max="{bar.max}"></progress>'
            html.append(f"<div><code>{name}</code> {meter} {label.value}</div>")
            text.append(f"  {name}: {label.value}")  # plain text: a step, or why it failed
        retire(self._handle, "".join(html), "\n".join(text), self._box)

    def update(self, name: str, step: int, detail: str = "") -> None:
        if self.steps.get(name) == step and self.details.get(name) == detail:
            return
        self.steps[name], self.details[name] = step, detail
        text = STEPS[step] + (f" ({detail})" if detail else "")
        if self.mode == "widget":
            bar, label = self._rows[name]
            bar.value = step
            bar.bar_style = "success" if step == len(STEPS) - 1 else ""
            label.value = text
        elif self.mode == "text":
            elapsed = time.monotonic() - self.started
            print(f"nbrpc [{elapsed:5.1f}s] {name}: {text}", file=sys.stderr, flush=True)

    def phase(self, name: str, seconds: float, note: str = "") -> None:
        """A boot phase ended: ``name`` took ``seconds`` (``note`` says more)."""
        self.phases[name] = f"{name} {seconds:.1f} s" + (f" ({note})" if note else "")
        if self.mode == "widget":
            self._phases.value = "<small>" + " · ".join(self.phases.values()) + "</small>"
        elif self.mode == "text":
            elapsed = time.monotonic() - self.started
            print(f"nbrpc [{elapsed:5.1f}s] {self.phases[name]}", file=sys.stderr, flush=True)

    def fail(self, name: str, reason: str) -> None:
        if self.mode == "widget" and name in self._rows:
            bar, label = self._rows[name]
            bar.bar_style = "danger"
            label.value = f"failed: {reason}"
        elif self.mode == "text":
            print(f"nbrpc {name}: failed: {reason}", file=sys.stderr, flush=True)
