"""Distributed autograd's context internals, the local backward's routing, and the
notices torch's ``DistributedOptimizer`` prints about its own internals.
"""

from __future__ import annotations

import collections
import contextlib
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd

from .versions import OPTIMIZER_SCRIPTED


class _Contexts(threading.local):
    made = 0  # contexts this thread made and has not released (read on every lane call)


_contexts = _Contexts()


#: contexts whose block a stop or an error ended, kept to be looked at again at the next
#: shutdown (the newest this many: a block inside an ``except`` clause looks the same)
SUSPECTS_KEPT = 64


@dataclass
class _Held:
    """Every context this process made and has not released, by the thread that made it
    (its ident), and those :func:`release_leftover_contexts` released for their makers;
    and the released ones whose block an exception ended (``suspects``): a worker's late
    message about one (the stop ended the backward pass while gradients were on their
    way) makes torch create it again in this process, where nothing releases it."""

    live: dict[int, int] = field(default_factory=dict)
    let_go: set[int] = field(default_factory=set)
    suspects: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=SUSPECTS_KEPT)
    )


_held = _Held()


def track_autograd_contexts() -> None:
    """Count the distributed autograd contexts each thread makes (idempotent), so that
    :func:`in_autograd_context` costs one attribute read outside one. torch's
    ``context()`` calls the module's ``_new_context`` and ``_release_context``."""
    made, released = dist_autograd._new_context, dist_autograd._release_context
    if getattr(made, "nbrpc_counted", False):
        return

    def new_context() -> Any:
        context = made()
        _held.live[context._context_id()] = threading.get_ident()
        _contexts.made += 1
        return context

    def release_context(context_id: int) -> Any:
        _contexts.made = max(_contexts.made - 1, 0)
        _held.live.pop(context_id, None)
        if sys.exc_info()[0] is not None:  # the block ended by a stop or an error
            _held.suspects.append(context_id)
        if context_id in _held.let_go:  # released at a shutdown already
            _held.let_go.discard(context_id)
            return None
        return released(context_id)

    new_context.nbrpc_counted = True  # type: ignore[attr-defined]
    dist_autograd._new_context = new_context
    dist_autograd._release_context = release_context


def release_leftover_contexts() -> int:
    """Release the contexts this thread made and never released (at a shutdown, once its
    calls ended, while the workers that know them are still there); how many. A stop
    button pressed as torch's ``context()`` was entered or left can leave one: the soak
    (seed 20261129, step 1026, a stop 0.4 s into autograd steps) found one live in the
    kernel after a ``--release``, and the thread stayed "inside" it: every later ``with
    context()`` there failed. Its block's own release, if it still comes, does nothing."""
    me = threading.get_ident()
    # this thread's only: torch clears a thread's "current context" on that thread alone,
    # so another thread's (a training thread, an RPC thread) is left to its own block
    left = sorted(c for c, thread in list(_held.live.items()) if thread == me)
    for context_id in left:
        with contextlib.suppress(RuntimeError):  # (torch no longer holds it)
            dist_autograd._release_context(context_id)  # (this module's wrapper)
        _held.live.pop(context_id, None)
        _held.let_go.add(context_id)
    _contexts.made = 0
    # released, then made again by a worker's late message (the soak, seed 66, step 36:
    # one context live in the kernel after every later shutdown; reproduced by stopping
    # backward passes at random moments, 3 runs of 10 with 40 stops)
    again = []
    while _held.suspects:
        context_id = _held.suspects.popleft()
        with contextlib.suppress(RuntimeError):  # not there: nothing came late
            dist_autograd._retrieve_context(context_id)
            again.append(context_id)
    for context_id in again:
        with contextlib.suppress(RuntimeError):
            dist_autograd._release_context(context_id)
    return len(left) + len(again)


def in_autograd_context() -> bool:
    """Whether this thread is inside a distributed autograd context (its RPCs are part of
    the backward pass). Private: ``_current_context`` raises when there is none (a few
    µs), asked only on a thread that made a context (:func:`track_autograd_contexts`)."""
    if not _contexts.made:
        return False
    try:
        dist_autograd._current_context()
    except RuntimeError:
        return False
    return True


#: torch's deprecation notices about its own internals that public torch API triggers: the
#: functional optimizers ``DistributedOptimizer`` makes on each owner announce their
#: TorchScript support's end, and up to 2.13 (:data:`~.versions.OPTIMIZER_SCRIPTED`) it
#: also scripts them, which prints TorchScript's own two notices.
INTERNAL_DEPRECATIONS = ("`TorchScript` support for functional optimizers is deprecated",) + (
    ("`torch.jit.script` is deprecated", "`torch.jit.interface` is deprecated")
    if OPTIMIZER_SCRIPTED
    else ()
)


def quiet_internal_deprecations() -> None:
    """Hide :data:`INTERNAL_DEPRECATIONS` in this process: a notebook user cannot act on
    them (nbrpc's tests check that the optimizer's steps still equal torch's)."""
    for text in INTERNAL_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=DeprecationWarning)
    quiet_optimizer_notice_if_loaded()


#: the name of the notice function torch's functional optimizer modules call
OPTIMIZER_NOTICE = "_scripted_functional_optimizer_deprecation_warning"


class _Quieted:
    flag = False  # set once the optimizers call the stand-in (read before every call)


_notice_quieted = _Quieted()


@torch.jit.ignore
def no_optimizer_notice(stacklevel: int = 0) -> None:
    """Stands in for torch's notice, which forces itself past every warnings filter."""


def quiet_optimizer_notice_if_loaded() -> None:
    """torch's functional optimizers warn with ``simplefilter("always")`` from their
    ``__init__``; once ``torch.distributed.optim`` is loaded (1.5 s to import, so never
    just for this), their modules call a silent stand-in. Cheap to call before every call."""
    if _notice_quieted.flag or "torch.distributed.optim.utils" not in sys.modules:
        return
    from torch.distributed.optim.utils import functional_optim_map

    for cls in functional_optim_map.values():
        module = sys.modules[cls.__module__]
        if hasattr(module, OPTIMIZER_NOTICE):
            setattr(module, OPTIMIZER_NOTICE, no_optimizer_notice)
    _notice_quieted.flag = True


# -- distributed autograd -----------------------------------------------------------------


def current_autograd_context_id() -> int:
    """The innermost context on this thread; ``RuntimeError`` when there is none."""
    return dist_autograd._current_context()._context_id()


def validate_autograd_context(context_id: int) -> None:
    """Raises ``RuntimeError`` when this process does not know ``context_id`` (any more)."""
    dist_autograd._is_valid_context(context_id)


def autograd_messages(context_id: int) -> tuple[dict[int, Any], dict[int, Any]]:
    """The context's send and recv graph nodes in this process, by autograd message id
    (a send here and the recv on the peer share one id: the trace joins them by it)."""
    ctx = dist_autograd._retrieve_context(context_id)
    return ctx._send_functions(), ctx._recv_functions()


def autograd_known_workers(context_id: int) -> list[int]:
    """Ids of the workers this process's part of the context sent to or received from."""
    return sorted(dist_autograd._retrieve_context(context_id)._known_worker_ids())


#: torch's words when ``loss.backward()`` (the local engine) meets a graph that crossed
#: workers inside a distributed autograd context (torch 2.13: an internal assertion).
LOCAL_BACKWARD_ACROSS_WORKERS = "graphTask_ INTERNAL ASSERT FAILED"
_torch_backward = torch.autograd.backward


_dist_backward = dist_autograd.backward


def route_dist_backward(replacement: Callable[..., Any]) -> None:
    """Make ``torch.distributed.autograd.backward`` (torch's spelling of the distributed
    backward pass, a C++ function) ``replacement``. TorchScript code that calls it still
    compiles to torch's own operator (``aten::dist_backward``): TorchScript looks a
    builtin up by the function object, which is ``replacement`` now."""
    dist_autograd.backward = replacement
    torch.jit._builtins._register_builtin(replacement, "aten::dist_backward")


def dist_backward(context_id: int, roots: list, retain_graph: bool = False) -> None:
    """torch's own ``torch.distributed.autograd.backward``."""
    _dist_backward(context_id, roots, retain_graph)


def route_local_backward(replacement: Callable[..., Any]) -> None:
    """Make ``torch.autograd.backward`` (what ``Tensor.backward`` calls) ``replacement``."""
    torch.autograd.backward = replacement


def local_backward(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``torch.autograd.backward``."""
    return _torch_backward(*args, **kwargs)
