"""The distributed optimizer: torch's, plus ``step()`` inside a ``with context()`` block."""

from __future__ import annotations

import traceback
from typing import Any

from . import _torch

_torch.quiet_internal_deprecations()  # before torch.distributed.optim scripts its interface

from torch.distributed.optim import DistributedOptimizer as _TorchDistributedOptimizer  # noqa: E402

from ._errors import WorkerDiedError  # noqa: E402
from ._torch import is_connection_loss  # noqa: E402
from .autograd import check_context, current_context_id  # noqa: E402

_torch.quiet_optimizer_notice_if_loaded()

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(_TorchDistributedOptimizer):
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    Runs ``optimizer_class`` (torch's or one defined in the notebook) on each worker that
    owns parameters. ``params_rref``: RRefs to the parameters to optimize, on any
    workers; ``args`` and ``kwargs``: the arguments of ``optimizer_class`` besides the
    parameters (``lr=0.05``). ``step(context_id)``; or ``step()`` inside a
    ``with context()``. Raises :class:`~nbrpc.WorkerDiedError`, naming the owners, when a
    worker that owns parameters is gone.
    """

    def __init__(self, optimizer_class: Any, params_rref: list, *args: Any, **kwargs: Any):
        self._owners = sorted({r.owner().name for r in params_rref})
        try:
            super().__init__(optimizer_class, params_rref, *args, **kwargs)
        except (RuntimeError, WorkerDiedError) as exc:
            raise self._dead_owner(exc) from None

    def step(self, context_id: int | None = None) -> None:
        """Apply the gradients of ``context_id`` (default: the innermost ``with
        context()`` block's) on every worker that owns parameters, at once.

        Raises :class:`~nbrpc.AutogradContextError` outside of (or after) the context,
        and :class:`~nbrpc.WorkerDiedError`, naming the owners, when one of them is gone.
        """
        if context_id is None:
            context_id = current_context_id()
        check_context(context_id, "DistributedOptimizer.step")
        try:
            super().step(context_id)
        except (RuntimeError, WorkerDiedError) as exc:
            raise self._dead_owner(exc) from None

    def _dead_owner(self, exc: Exception) -> BaseException:
        """torch's lost connection (or nbrpc's WorkerDiedError, torch's calls being routed
        through nbrpc's): the optimizer names the workers that own its parameters.

        ``exc``'s finished frames are cleared first: a failed future holds its exception
        from C++, where the garbage collector cannot see it, and torch's frames under it
        hold the other owners' futures and the optimizer RRefs they returned (a test once
        found one such RRef left, now and then, depending on which owner answered first).
        """
        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, WorkerDiedError):
            detail = f"{exc.worker} is gone"
        elif is_connection_loss(exc):
            detail = f"torch said: {str(exc).splitlines()[0]}"
        else:
            return exc
        return WorkerDiedError(
            f"a worker owning parameters of this optimizer ({', '.join(self._owners)})", detail
        )
