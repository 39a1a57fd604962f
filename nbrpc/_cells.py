"""``%%rpc`` cells: notebook code that runs *on* the workers, in a namespace that stays.

A ``%%rpc`` cell runs in the worker's own namespace: the worker process's ``__main__``
module, so ``x = 1`` in one cell is there in the next, and a class defined there pickles by
reference on that worker, as in a notebook's kernel. Notebook functions sent with
``rpc_sync`` run in the same namespace (:mod:`nbrpc._wire.namespace`): one per worker.
(On a worker, ``__main__`` is nbrpc's engine module; nbrpc's own names there start with
``_``.)

This module holds both sides:

* worker side (run by RPC): :func:`run_cell`, :func:`push_values`, :func:`pull_value`,
  :func:`worker_namespace`;
* kernel side: :func:`run`, which the magic calls, and :func:`push` / :func:`pull`.

A cell's output is forwarded like any call's (:mod:`nbrpc._wire.output`): live, line by line,
marked ``[worker1]``. The value of its last expression comes back and is shown once per
worker as ``Out[worker1]:``.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import linecache
import time
from collections.abc import Iterable, Sequence
from typing import Any

from . import _group
from ._calls import facade as calls
from ._errors import ConfigError, NbrpcError, short_traceback
from ._lifecycle import ranks
from ._placement import not_workers
from ._wire import cancelling, namespace

INTERRUPT_GRACE_S = 2.0  # how long the kernel waits for interrupted cells to stop

# -- worker side -------------------------------------------------------------------------


def worker_namespace() -> dict[str, Any]:
    """This worker's persistent namespace (its ``__main__``), which ``%%rpc`` cells use.

    Notebook functions sent with ``rpc_sync`` run with it as their globals too, so their
    ``global`` assignments land here (:mod:`nbrpc._wire.namespace`). Called in the
    kernel, it is the kernel's ``__main__`` (the notebook's names). Raises nothing.
    """
    return namespace.namespace()


def run_cell(cell_id: int, filename: str, source: str) -> Any:
    """Runs on a worker: execute ``source`` in :func:`worker_namespace`; return the value
    of its last expression (``None`` when it ends with a statement)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    namespace = worker_namespace()
    # the stop button cancels it as any call the cell made (nbrpc._wire.cancelling)
    exec(compile(tree, filename, "exec"), namespace)
    return eval(compile(last, filename, "eval"), namespace) if last is not None else None


run_cell.user_call = True  # type: ignore[attr-defined]  # counted in status() as user calls


def push_values(values: dict[str, Any]) -> list[str]:
    worker_namespace().update(values)
    return sorted(values)


_MISSING = object()


def pull_value(name: str) -> Any:
    value = worker_namespace().get(name, _MISSING)
    if value is _MISSING:
        raise NameError(f"name {name!r} is not defined on this worker")
    return value


# -- kernel side -------------------------------------------------------------------------


class CellResults(dict):
    """``{worker: value}`` of a ``%%rpc`` cell, shown as one ``Out[worker]:`` per worker
    (nothing when every value is ``None``, as after a cell that ends with a statement)."""

    def _lines(self) -> list[str]:
        return [f"Out[{w}]: {v!r}" for w, v in self.items() if v is not None]

    def _ipython_display_(self) -> None:
        lines = self._lines()
        if lines:
            print("\n".join(lines))

    def __repr__(self) -> str:
        return "\n".join(self._lines()) or f"CellResults({dict(self)!r})"


class RpcCellError(NbrpcError, RuntimeError):
    """Several workers failed in one ``%%rpc`` cell: ``exceptions`` holds one exception per
    worker, each with its own type, ``.worker`` and remote traceback; ``results`` the
    values of the workers that succeeded.

    Not an ``ExceptionGroup``: IPython (9.x) formats exception groups with the standard
    library, ignores their ``_render_traceback_`` and sends the notebook no error at all
    (nbval and papermill then pass a failed cell). ``group()`` is one, for ``except*``.
    """

    def __init__(self, message: str, exceptions: Sequence[BaseException]) -> None:
        super().__init__(message)
        self._init_args = (message, list(exceptions))
        self.exceptions = tuple(exceptions)
        self.results = CellResults()

    def group(self) -> ExceptionGroup:
        """The workers' exceptions as an ``ExceptionGroup`` (``except* KeyError:``)."""
        return ExceptionGroup(str(self), [e for e in self.exceptions if isinstance(e, Exception)])

    def _render_traceback_(self) -> list[str]:
        """IPython shows each worker's traceback and error, not nbrpc's frames."""
        lines = [f"{type(self).__name__}: {self}"]
        for exc in self.exceptions:
            lines.extend(["", *short_traceback(exc)])
        return lines


_cell_ids = itertools.count(1)


def _targets(spec: str | Iterable[str] | None, what: str = "%%rpc") -> list[str]:
    """The workers ``spec`` names ("all", "worker1,worker2" or a list); ``what`` names the
    caller in the error for a name that is not a worker."""
    _group.require_active(what)  # NotInitializedError before %rpc_init
    kernel, *workers = ranks.members()  # a dead one too: its call says so, and how to restart it
    if spec is None or spec == "all" or spec == ["all"]:
        return workers
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in workers]
    if unknown or not names:
        said = not_workers(unknown, kernel) if unknown else "no worker is named"
        raise ConfigError(
            f"{what} targets {', '.join(unknown) or '(none)'}: {said}. "
            f"Its workers: {', '.join(workers)} (or 'all'; the kernel is not a target)."
        )
    return names


def run(source: str, targets: str | Iterable[str] | None = "all") -> CellResults:
    """Run ``source`` on each target concurrently; ``{worker: last expression's value}``.

    One failure is raised with its own type (``.results``: the other workers' values);
    several are raised together as :class:`RpcCellError`. The stop button interrupts the
    cell on every target (as it cancels any call a cell made: :mod:`nbrpc._calls.cancel`).
    """
    if not source.strip():
        raise ConfigError("the %%rpc cell is empty: write the code to run on the workers")
    workers = _targets(targets)
    cell_id = next(_cell_ids)
    filename = f"<rpc-cell-{cell_id}>"
    compile(source, filename, "exec")  # a syntax error stops it here, before any worker runs
    # the kernel formats the workers' tracebacks with its own linecache
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    futures = {
        w: calls.rpc_async(w, run_cell, args=(cell_id, filename, source), timeout=0)
        for w in workers
    }
    try:
        for fut in futures.values():
            with contextlib.suppress(Exception):  # collected below, once all are done
                fut.wait()
    except KeyboardInterrupt:  # cancelled on every worker as the wait ended: let them end
        cancelling.stopped()  # (here too: the stop may land between two waits)
        _let_end(futures)
        raise
    return _collect(futures)


def _let_end(futures: dict[str, Any]) -> None:
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while time.monotonic() < deadline and not all(f.done() for f in futures.values()):
        time.sleep(0.02)


def _collect(futures: dict[str, Any]) -> CellResults:
    results = CellResults()
    errors: list[Exception] = []
    for worker, fut in futures.items():
        try:
            results[worker] = fut.wait()
        except Exception as exc:
            if getattr(exc, "worker", None) is None:
                exc.worker = worker  # type: ignore[attr-defined]
            errors.append(exc)
    if len(errors) == 1:
        errors[0].results = results  # type: ignore[attr-defined]
        raise errors[0]
    if errors:
        failed = ", ".join(getattr(e, "worker", "?") for e in errors)
        group = RpcCellError(f"%%rpc failed on {failed}", errors)
        group.results = results
        raise group
    return results


def push(values: dict[str, Any], workers: str | Iterable[str] | None = "all") -> None:
    """Set names in each worker's namespace (what ``%%rpc`` cells and
    :func:`worker_namespace` see): ``nbrpc.push({"lr": 0.1, "data": tensor})``.

    ``values``: ``{name: value}``, sent to every worker at once. ``workers``: ``"all"``
    (every worker, not the kernel; also ``None``), names separated by commas, or a list
    of names. Raises :class:`~nbrpc.NotInitializedError` before a cluster runs,
    :class:`~nbrpc.ConfigError` for a name that is not a worker, and the errors of
    :func:`nbrpc.rpc_sync` (a value that cannot travel: a
    :class:`~nbrpc.SerializationError`)."""
    names = _targets(workers, "nbrpc.push")
    futures = [calls.rpc_async(w, push_values, args=(dict(values),)) for w in names]
    for fut in futures:
        fut.wait()


def pull(name: str, workers: str | Iterable[str] | None = "all") -> dict[str, Any]:
    """``{worker: value}`` of ``name`` in each worker's namespace.

    ``workers``: ``"all"`` (every worker, not the kernel; also ``None``), names separated
    by commas, or a list of names. Raises :class:`~nbrpc.NotInitializedError` before a
    cluster runs, :class:`~nbrpc.ConfigError` for a name that is not a worker,
    ``NameError`` for a ``name`` a worker does not have, and the errors of
    :func:`nbrpc.rpc_sync`."""
    names = _targets(workers, "nbrpc.pull")
    futures = {w: calls.rpc_async(w, pull_value, args=(name,)) for w in names}
    return {w: fut.wait() for w, fut in futures.items()}
