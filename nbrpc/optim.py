"""The distributed optimizer: torch's, plus ``step()`` inside a ``with context()`` block."""

from __future__ import annotations

from torch.distributed.optim import DistributedOptimizer as _TorchDistributedOptimizer

from .autograd import _check_valid, current_context_id

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(_TorchDistributedOptimizer):
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    Runs ``optimizer_class`` (torch's or one defined in the notebook) on each worker that
    owns parameters. ``step(context_id)``; or ``step()`` inside a ``with context()``.
    """

    def step(self, context_id: int | None = None) -> None:
        if context_id is None:
            context_id = current_context_id()
        _check_valid(context_id, "DistributedOptimizer.step")
        super().step(context_id)
