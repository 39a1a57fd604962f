"""``%rpc_debug`` / :func:`nbrpc.post_mortem`: pdb on the worker frame that raised.

The kernel remembers the last failure a call brought back (worker, failure id); that
worker keeps the exception with its traceback, frames and locals, until its next failure
or its end (:mod:`nbrpc._wire.failures`). This opens pdb there, through the same channel
as a worker's ``breakpoint()`` (:mod:`.remote_pdb`): ``up``, ``down``, ``p``, ``l`` walk
and read the worker's frames; ``c`` or ``q`` leaves.
"""

from __future__ import annotations

import sys

from nbrpc import _group, _torch
from nbrpc._errors import UnknownWorkerError, WorkerDiedError
from nbrpc._wire import failures

from . import prompts, remote_pdb


def post_mortem() -> str | None:
    """Open pdb on the worker frame that raised the last remote exception.

    Returns that exception's summary (``"ZeroDivisionError: division by zero"``), or None
    when there is nothing to debug or nobody can type (the reason is printed). Raises
    :class:`~nbrpc.NotInitializedError` when no cluster runs.
    """
    _group.require_active("%rpc_debug")
    seen = failures.last_seen_failure()
    if seen is None:
        print(
            "No remote exception to debug: %rpc_debug opens the worker frame that raised "
            "the last exception a call brought back, and none has since the cluster started."
        )
        return None
    reason = prompts.no_input_reason()
    if reason:
        print(f"%rpc_debug cannot open pdb on {seen['worker']}: {reason}.", file=sys.stderr)
        return None
    worker = seen["worker"]
    if worker not in _group.member_names():
        raise UnknownWorkerError(worker, _group.member_names())
    raw = _torch.rpc_async(worker, remote_pdb.open_post_mortem, args=(seen["id"],), timeout=0)
    prompts.wait_on_main_thread(raw)  # the stop button and the worker's prompts, served here

    def lost(exc: BaseException) -> BaseException:
        if _torch.is_connection_loss(exc):
            return WorkerDiedError(worker, f"torch said: {str(exc).splitlines()[0]}")
        return exc

    value, error = failures.outcome(raw, lost)
    if error is not None:
        raise error
    return value
