"""tqdm on a worker: a live progress widget in the calling cell, labelled with the worker.

``from tqdm.auto import tqdm`` (or ``tqdm.notebook``) gives the widget bar in a notebook's
kernel; on a worker it gave the text bar, in the engine's log or (since lines updated in
place are forwarded, :mod:`.output`) as text. Once a worker forwards its output, importing
those modules there gives :class:`RemoteTqdm` instead (:func:`install`, an import hook:
nothing is imported before the user does). Its updates are tqdm's own refreshes, at most
one per :data:`MIN_INTERVAL_S` per bar; each travels with the call's output (in order,
before its result) as a ``("bar", state)`` chunk, and the kernel draws it
(:func:`nbrpc._wire.output.show_bar`):

- in a notebook, a row per bar: ``[worker1] desc``, an ``IntProgress``, tqdm's own
  figures; green when the bar completes, red when it closes short. The display also holds
  the text bar as ``text/plain``, updated when the bar ends: where widgets do not render
  (nbval, nbconvert) the cell keeps the final text bar;
- elsewhere (a script), the text bar, rewritten in place.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import sys
import time
from typing import Any

from . import output

#: at most one update per bar per this many seconds crosses the wire (tqdm's own default)
MIN_INTERVAL_S = 0.1
PATCHED = ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")
_ids = itertools.count(1)


# -- the worker's side -------------------------------------------------------------------


class _Discard:
    """The text bar's file: the widget replaces it."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def remote_tqdm_class() -> type:
    """The tqdm class a worker's ``tqdm.auto`` / ``tqdm.notebook`` give (built on first use:
    tqdm is imported only where the user imports it)."""
    from tqdm.asyncio import tqdm_asyncio  # type: ignore[import-untyped]

    class RemoteTqdm(tqdm_asyncio):
        """tqdm whose bar is drawn in the calling cell (see nbrpc._wire.bars)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = _Discard()
            kwargs.setdefault("mininterval", MIN_INTERVAL_S)
            self._nbrpc_id = next(_ids)
            self._nbrpc_sent = 0.0
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            now = time.monotonic()
            if now - self._nbrpc_sent >= MIN_INTERVAL_S:
                self._nbrpc_sent = now
                send(self._nbrpc_state(closed=False))
            return True

        def close(self) -> None:
            if getattr(self, "disable", True):
                return
            super().close()
            send(self._nbrpc_state(closed=True))

        def _nbrpc_state(self, closed: bool) -> dict[str, Any]:
            d = self.format_dict
            d["ncols"] = 80
            return {
                "id": self._nbrpc_id,
                "n": int(d.get("n") or 0),
                "total": int(d["total"]) if d.get("total") else 0,
                "desc": str(d.get("prefix") or ""),
                "text": self.format_meter(**d),
                "closed": closed,
            }

    return RemoteTqdm


def send(state: dict[str, Any]) -> None:
    """A bar's state to the kernel: with the running call's output (in order, before its
    result), else on its own."""
    call = output.call_here()
    if call is not None:
        call.write_bar(state)
        return
    kernel = output.kernel_name()
    if kernel is not None:
        from nbrpc import _torch

        _torch.rpc_async(kernel, output.show_bars, args=(output.worker_name(), [state]), timeout=10)


def _patch(module: Any) -> None:
    cls = remote_tqdm_class()
    module.tqdm = cls
    if hasattr(module, "trange"):
        module.trange = lambda *args, **kwargs: cls(range(*args), **kwargs)
    if hasattr(module, "tqdm_notebook"):
        module.tqdm_notebook = cls


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches tqdm's notebook-facing modules as they are imported on this worker."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """On a worker that forwards its output: tqdm's notebook bars become RemoteTqdm."""
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchOnImport())
    for name in PATCHED:
        if name in sys.modules:
            _patch(sys.modules[name])
