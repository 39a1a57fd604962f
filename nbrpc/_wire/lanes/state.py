"""What this process's lanes hold, and the words a lane speaks on the wire.

One record per process (:data:`here`): the caller's lanes (:mod:`.caller`), the callee's
connections and the replies it keeps (:mod:`.callee`), the socket directory and the
listener (:mod:`.setup`). The three modules share it; each changes only its own fields.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from nbrpc._errors import ConnectionLost

from .pool import Pool

#: a frame's kind, on the wire: a call the callee runs on the lane's thread (``INLINE``,
#: the main thread's lane) or on its pool (``POOLED``); a reply: the value (``VALUE``),
#: a key for the reply the callee kept (``FETCH``; ``ON_DEVICE``: kept because it holds a
#: tensor on a device, CUDA's, which TensorPipe's device maps place), or "send it again
#: through TensorPipe" (``RETRY``: the callee could not unpickle the call)
INLINE, POOLED, VALUE, FETCH, RETRY, ON_DEVICE = 1, 2, 3, 4, 5, 6
REPLIES = frozenset({VALUE, FETCH, RETRY, ON_DEVICE})
CALLS = frozenset({INLINE, POOLED})


class LaneLost(ConnectionLost):
    """The peer's end of a lane closed: its process is gone (or the cluster closed)."""


@dataclass
class Lanes:
    """This process's side: where the sockets are (None: lanes off), its listener, the
    lanes it opened (``main``, ``shared``: :class:`.lane.Lane`), and what its callee
    side keeps."""

    directory: str | None = None
    listener: socket.socket | None = None
    #: peer ranks with no lane to connect to (its socket is not here: another host, or
    #: lanes off there): TensorPipe takes their calls. Not ``_states.unreachable``, the
    #: workers whose calls fail at once
    laneless: set[int] = field(default_factory=set)
    main: dict[int, Any] = field(default_factory=dict)  # the main thread's, by rank
    shared: dict[int, Any] = field(default_factory=dict)  # everyone else's, by rank
    served: set[socket.socket] = field(default_factory=set)  # connections from peers
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[int, Any] = field(default_factory=dict)  # replies kept for take()
    held_ids: Any = field(default_factory=lambda: itertools.count(1))
    pool: Pool | None = None
    made_directory: bool = False  # the kernel's: it removes it at close
    paused: bool = False  # this process sends its calls through TensorPipe for now
    #: (peer rank, id(function)) -> the function, for calls whose reply from that peer
    #: held a tensor on a device: TensorPipe takes them from then on (caller.why_not)
    on_device: dict[tuple[int, int], Any] = field(default_factory=dict)

    def forget(self, lane: Any) -> None:
        """A lane closed: the next call to its peer opens another."""
        with self.lock:
            for table in (self.main, self.shared):
                for rank, kept in list(table.items()):
                    if kept is lane:
                        del table[rank]


here = Lanes()


#: ``.lane``: set on a lane's reader thread. A call a future's callback makes there
#: (torch's ``fut.then(...)`` runs it on the thread that completes the future) goes
#: through TensorPipe: waiting for its answer on a lane would wait for this very thread
class _Reading(threading.local):
    lane: Any = None


reading = _Reading()


def socket_path(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.sock")


def shut(sock: socket.socket) -> None:
    """Close ``sock`` both ways (a thread blocked reading it wakes up)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
