"""What a forked child resets, registered in one place.

Workers are forked from the zygote (:mod:`nbrpc._engines.zygote`), which has imported
nbrpc: each module whose state is its process's own (an identity token, a name, the
main thread's id, threads that did not survive the fork, caches of the parent's calls)
gives :func:`in_child` the function that resets it. One ``os.register_at_fork`` runs
them all, in the order they were given (the order modules import in, the lowest layer
first), after Python's own handlers: ``threading``'s has made the forking thread the
child's main thread by then.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

_hooks: list[Callable[[], None]] = []


def in_child(reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every child forked from now on, right after the fork (once,
    however often it is given)."""
    if reset not in _hooks:
        _hooks.append(reset)


def _run_in_child() -> None:
    for reset in _hooks:
        try:
            reset()
        except Exception:  # one module's reset must not leave the others' undone
            log.exception("nbrpc: resetting %s after a fork failed", reset)


os.register_at_fork(after_in_child=_run_in_child)
