"""``%rpc_debug`` / :func:`nbrpc.post_mortem`: pdb on the worker frame that raised.

The kernel remembers the last failure a call brought back (worker, failure id); that
worker keeps the exception with its traceback, frames and locals, until its next failure
or its end (:mod:`nbrpc._remote`). This opens pdb there, through the same channel as a
worker's ``breakpoint()`` (:mod:`nbrpc._debugger`): ``up``, ``down``, ``p``, ``l`` walk
and read the worker's frames; ``c`` or ``q`` leaves.
"""

from __future__ import annotations

import sys

from . import _agent, _debugger, _remote

__all__ = ["post_mortem"]


def post_mortem() -> str | None:
    """Open pdb on the worker frame that raised the last remote exception.

    Returns that exception's summary (``"ZeroDivisionError: division by zero"``), or None
    when there is nothing to debug or nobody can type (the reason is printed).
    """
    _agent._require("%rpc_debug")
    seen = _remote.last_seen_failure()
    if seen is None:
        print(
            "No remote exception to debug: %rpc_debug opens the worker frame that raised "
            "the last exception a call brought back, and none has since the cluster started."
        )
        return None
    reason = _debugger.no_input_reason()
    if reason:
        print(f"%rpc_debug cannot open pdb on {seen['worker']}: {reason}.", file=sys.stderr)
        return None
    return _agent.rpc_sync(
        seen["worker"], _debugger.open_post_mortem, args=(seen["id"],), timeout=0
    )
