"""Distributed autograd from a notebook: torch's engine, with errors that say what to do.

A training step::

    with nbrpc.autograd.context() as context_id:
        loss = model(x).sum()
        nbrpc.autograd.backward(context_id, [loss])      # or seed 001's backward([loss])
        grads = nbrpc.autograd.get_gradients(context_id)

Plain ``torch.distributed.autograd`` keeps working alongside.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd

from . import _torch, _trace
from ._errors import AutogradContextError, show_short
from ._rows import Trace

__all__ = [
    "AutogradContextError",
    "backward",
    "context",
    "current_context_id",
    "get_gradients",
    "trace_backward",
]

context = dist_autograd.context
#: ``backward(..., check=EVERY_PASS)``: the whole check on every pass, not once per shape
EVERY_PASS = "every pass"


def current_context_id() -> int:
    """The id of the innermost ``with context()`` block on this thread. Raises
    :class:`~nbrpc.AutogradContextError` outside of one."""
    try:
        return _torch.current_autograd_context_id()
    except RuntimeError:
        raise AutogradContextError(
            "no distributed autograd context is active on this thread. Wrap the forward "
            "and backward pass in `with nbrpc.autograd.context() as context_id:`."
        ) from None


def check_context(context_id: int, what: str) -> None:
    try:
        _torch.validate_autograd_context(context_id)
    except RuntimeError:
        raise AutogradContextError(
            f"{what}: distributed autograd context {context_id} does not exist here any more "
            "(its `with` block has ended, which frees its gradients on every worker). "
            "Read gradients and step the optimizer inside the block."
        ) from None


def backward(
    context_id: int | Sequence[torch.Tensor] | torch.Tensor,
    roots: Sequence[torch.Tensor] | torch.Tensor | None = None,
    retain_graph: bool = False,
    *,
    timed: bool = False,
    check: bool | str = True,
) -> None:
    """Run the backward pass across workers from scalar ``roots``.

    ``backward(context_id, roots)`` as in current torch, or ``backward(roots)`` inside a
    ``with context()`` block as in seed 001. ``timed=True`` first puts timing hooks on
    every node of every worker taking part (one RPC round), so that
    :func:`nbrpc.trace_backward` reports when each function ran.

    ``check=True`` (default) refuses, with the reason, a backward pass that torch would
    never finish: one where a tensor sent by RPC inside the context (an argument or a
    result) does not lead to the loss. It looks at the graph on every worker taking part
    (one RPC round per hop distance) the first time a graph of its shape comes; a later
    pass whose part in this process has the same shape (the same autograd functions and
    edges, messages from the same workers, the same calls sent: the same functions to
    the same workers with the same numbers, strings and RRefs among their arguments) is
    let through without that round. What that assumes: a worker's part of the graph
    follows from what this process sent it, as in a training loop; a worker whose part
    changes from pass to pass on its own (a branch on its own state that leaves a
    result unused) is checked on every pass with ``check="every pass"``. ``check=False``
    checks nothing. ``retain_graph``: keep the graph for another backward pass, as in
    torch.

    ``context_id``: the context's id, or the roots themselves (then the innermost
    context on this thread is used). Raises :class:`~nbrpc.AutogradContextError` outside
    of (or after) its context and for a pass the check refuses (it says why),
    ``ValueError`` for another ``check``, and torch's errors of the pass itself (a
    worker's, rebuilt here as from :func:`nbrpc.rpc_sync`).
    """
    if roots is None:
        roots, context_id = context_id, current_context_id()  # type: ignore[assignment]
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    context_id = int(context_id)  # type: ignore[arg-type]
    check_context(context_id, "backward")
    roots = list(roots)  # type: ignore[arg-type]
    _trace.remember_roots(context_id, roots)
    if check not in (True, False, EVERY_PASS):
        raise ValueError(f"check={check!r}: write True, False or {EVERY_PASS!r}")
    if check:
        _refuse_hang(context_id, every_pass=check == EVERY_PASS)
    if timed:
        _trace.instrument_all(context_id)
    _torch.dist_backward(context_id, roots, retain_graph)


def _torchs_backward(context_id: int, roots: list, retain_graph: bool = False) -> None:
    """``torch.distributed.autograd.backward`` in a process of an nbrpc cluster: torch's,
    after the check :func:`backward` makes (``check=True``), so code written for torch
    gets the same refusal of a graph torch would never finish (it waits for ever, or until
    the RPC timeout ends it as a RuntimeError). Any other graph goes to torch as it came:
    where the check itself cannot run (a context torch does not know, a worker gone),
    torch's backward runs and gives torch's own error."""
    try:
        roots = list(roots)
        _trace.remember_roots(int(context_id), roots)
        _refuse_hang(int(context_id))
    except AutogradContextError:
        raise
    except Exception:  # torch's own call says what is wrong, in its words
        pass
    _torch.dist_backward(context_id, roots, retain_graph)


#: graph shapes (:func:`nbrpc._trace.local_shape`) whose whole check found no hang
_passed: dict[tuple, None] = {}
_SHAPES_KEPT = 64
_passed_lock = threading.Lock()


def _refuse_hang(context_id: int, every_pass: bool = False) -> None:
    """Refuse a backward pass torch would never finish (see :func:`backward`). The whole
    check asks every worker taking part for its part of the graph (one RPC round per hop
    distance); a pass whose part here has the shape of one that passed it before is let
    through without asking (``every_pass``: ask anyway)."""
    shape = None if every_pass else _trace.local_shape(context_id)
    if shape is not None and shape in _passed:
        return
    trace = _trace.trace_backward(context_id)
    stuck = _trace.never_reached(trace)
    if not stuck:
        if shape is not None:
            with _passed_lock:
                _passed[shape] = None
                while len(_passed) > _SHAPES_KEPT:
                    del _passed[next(iter(_passed))]
        return
    receiver = {e["dst"]: e["src"].split("/")[0] for e in trace["edges"] if e["kind"] == "rpc"}
    pairs = ", ".join(
        f"{n['worker']} -> {receiver.get(n['id'], '?')} (message {n['message_id']})" for n in stuck
    )
    raise AutogradContextError(
        "this backward pass would wait forever: torch's distributed autograd expects a "
        "gradient for every tensor sent by RPC inside the context, and these sends would "
        f"never get one: {pairs}. Usually an RPC result that requires grad is not used by "
        "the loss. Make that call outside the `with context()` block, or under "
        "torch.no_grad() on the worker, or add its result to the loss multiplied by 0."
    )


def trace_backward(context_id: int | None = None) -> Trace:
    """The backward pass of ``context_id`` as it crossed the workers (see ``nbrpc._trace``).

    Call it inside the ``with context()`` block, after ``backward``: leaving the block
    frees the graph on every worker. ``context_id``: the context (default: the innermost
    one on this thread). Returns a :class:`~nbrpc.Trace` (``context_id``, ``workers``,
    ``nodes``, ``edges``). Raises :class:`~nbrpc.AutogradContextError` outside of (or
    after) the context.
    """
    if context_id is None:
        context_id = current_context_id()
    check_context(context_id, "trace_backward")
    return _trace.trace_backward(context_id)


def _local_backward(*args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.backward`` (``loss.backward()``), with torch's internal assertion
    for a graph that crossed workers turned into the fix. The stop button's
    KeyboardInterrupt shows short in a notebook, the cell's lines, as in nbrpc's calls:
    not this function's frames, which torch's own ``loss.backward()`` does not have.
    torch's errors keep torch's whole display (their chained causes too)."""
    try:
        return _torch.local_backward(*args, **kwargs)
    except KeyboardInterrupt as stop:
        show_short(stop)
        raise
    except RuntimeError as exc:
        if _torch.LOCAL_BACKWARD_ACROSS_WORKERS not in str(exc):
            raise
        raise AutogradContextError(
            "loss.backward() runs torch's local autograd engine, which cannot follow a graph "
            "that crossed workers (tensors sent by RPC inside a distributed autograd "
            "context). Run the backward pass with nbrpc.autograd.backward(context_id, "
            "[loss]) inside the `with context() as context_id:` block (torch's spelling: "
            "dist_autograd.backward), and read the gradients with "
            "nbrpc.autograd.get_gradients(context_id)."
        ) from None


def install() -> None:
    """``loss.backward()`` on a graph that crossed workers says what to use instead, and
    torch's spelling of the distributed backward refuses a graph that would never finish."""
    _torch.route_local_backward(_local_backward)
    _torch.route_dist_backward(_torchs_backward)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Gradients accumulated in this process for ``context_id``: {tensor: grad}.
    Raises :class:`~nbrpc.AutogradContextError` when the context has ended (read them
    inside the ``with context()`` block)."""
    check_context(context_id, "get_gradients")
    return dist_autograd.get_gradients(context_id)
