"""Who this process is: its name in the RPC group, its id token, whether a notebook runs it.

Facts that modules of every layer ask about the process they run in (a failure names the
worker that raised it, a code key and a failure id must be unique to their process, the
boot shows widgets only in a notebook), kept at the bottom so that any of them may ask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed.rpc as rpc


def name() -> str:
    """This process's name in the group, or ``"?"`` outside one."""
    try:
        return rpc.get_worker_info().name
    except Exception:
        return "?"


@dataclass
class _Identity:
    token: str = ""

    def renew(self) -> None:
        self.token = f"{os.getpid()}.{os.urandom(4).hex()}"


_identity = _Identity()
_identity.renew()
os.register_at_fork(after_in_child=_identity.renew)  # workers are forked from the zygote


def token() -> str:
    """This process's own prefix for ids it hands out (failure ids, code keys): unique to
    it, also among processes forked from one parent, which get a new one at the fork."""
    return _identity.token


def in_notebook() -> bool:
    """Whether a Jupyter kernel runs this process (widgets can be shown)."""
    import sys

    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
