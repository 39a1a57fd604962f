"""The ipyparallel controller's process, as nbrpc starts it: ipyparallel's own controller,
with an engine counted as registered at its heart's first answer.

ipyparallel's heart monitor pings every engine once a period (``HeartMonitor.period``:
:data:`.controller.HEARTBEAT_MS`) and looks at the answers at the next ping: a new
engine's heart, started as it registers, answered the first ping it saw, and its
registration was completed at the ping after, one to two periods after it started (0.5-1 s
of a cold boot's, a restart's and a grow's wait, with 500 ms). Here the first answer of a
heart the monitor does not know tells the hub at once, as the next ping would have
(``HeartMonitor.handle_new_hearts``); the next ping finds it known and beating. Nothing
else changes: the ping's period, and how a silent heart is declared dead.

The controller runs this file by its path (``python .../controller_process.py ARGS``,
:meth:`.controller.Controller._start_controller`), not with ``-m``, which would import
the ``nbrpc`` package and torch with it (1.8 s); it imports ipyparallel alone.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def registered_at_first_answer(heart_monitor: Any) -> None:
    """Patch ``heart_monitor`` (ipyparallel's ``HeartMonitor`` class) as the module doc
    says; a version of ipyparallel without the names it needs is left as it is."""
    answered = getattr(heart_monitor, "handle_pong", None)
    if answered is None or not hasattr(heart_monitor, "handle_new_hearts"):
        return

    def handle_pong(self: Any, msg: list) -> None:
        answered(self, msg)
        heart = msg[0] if msg else None
        if heart in self.responses and heart not in self.hearts:
            self.handle_new_hearts({heart})

    heart_monitor.handle_pong = handle_pong


def main() -> None:
    """Run ipyparallel's controller (its command line), patched."""
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # this package's modules must not shadow others by name
    from ipyparallel.controller import heartmonitor
    from ipyparallel.controller.app import main as controller_main

    registered_at_first_answer(heartmonitor.HeartMonitor)
    controller_main()


if __name__ == "__main__":
    main()
