"""What a boot found and made, which its cluster keeps whole or half made (:class:`Booted`):
the roster, the boot's phases, device maps, the fast path's reach, the process group, and
the joins still on their way. Read by the restart, the scale and the leave; written by
:mod:`.boot` and, for the roster, by :mod:`nbrpc._states`."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _setup, _states

from . import collective

#: how long a stopped boot waits for the joins it asked (:meth:`Booted.let_joins_end`)
ABANDON_JOIN_WAIT_S = 15.0


@dataclass
class Booted:
    """What a boot found and made (the cluster keeps it, whole or half made)."""

    #: every process of the group, the kernel first, and the engines of those joining
    #: (written by :mod:`nbrpc._states`, their one owner)
    roster: _states.Roster = field(default_factory=_states.Roster)
    #: where the boot's time went, in seconds from its start: "controller" (connected;
    #: 0 when kept from the last cluster), "engines" (all registered), "torch import"
    #: (the zygote's imports, 0 when it ran before), "join" (its own length), "total"
    seconds: dict[str, float] = field(default_factory=dict)
    device_maps: dict = field(default_factory=dict)  # every process's maps
    fast_path: bool = False  # large CPU tensors through shared memory
    lanes: bool = False  # small calls through Unix sockets (nbrpc._wire.lanes)
    #: TensorPipe's transports the workers join with (empty: the default), chosen at
    #: the boot (:func:`nbrpc._network.transports_for`); a restart's or a scale's too
    transports: list[str] = field(default_factory=list)
    #: across hosts: each process's peers that see its /dev/shm (the fast path's reach)
    shm_peers: dict[str, list[str]] = field(default_factory=dict)
    process_group: collective.ProcessGroupInfo | None = None
    #: the joins asked and not answered yet (name -> ipyparallel's AsyncResult): a boot
    #: stopped meanwhile lets them end before the group forgets their names
    #: (:meth:`let_joins_end`)
    asked: dict[str, Any] = field(default_factory=dict)

    def let_joins_end(self, timeout: float = ABANDON_JOIN_WAIT_S) -> None:
        """A boot stopped while its workers joined: wait (at most ``timeout`` s; a second
        stop ends the wait) for the joins already on their way. A join goes on in its
        engine after the kernel stopped waiting, and one that listed its name, or took
        torch's join token, after the group forgot them made the next cluster's worker
        of that name wait 90 s and then fail, "RPC worker name worker1 is not unique"
        (the soak, docs/soak.md)."""
        asked, self.asked = list(self.asked.values()), {}
        deadline = time.monotonic() + timeout
        try:
            for ar in asked:
                with contextlib.suppress(Exception):
                    ar.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:  # pressed again: the cleanup goes on without waiting
            pass

    def devices_back(self, ready: list[str]) -> None:
        """torch's dynamic group drops every member's CUDA devices and reply maps at each
        join and each leave: the kernel and the ``ready`` workers get them back
        (:func:`nbrpc._setup.device_replies`; nothing without device maps). The one call
        after a join (:meth:`.boot.Joining.after_join`), a scale's leave and a restart's."""
        _setup.device_replies(self.device_maps, ready)
