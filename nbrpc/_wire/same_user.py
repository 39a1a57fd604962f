"""Unix sockets that admit processes of this user only: the accept loop the lanes
(:mod:`nbrpc._wire.lanes`) and the side doors (:mod:`nbrpc._wire.side_door`) share.

Their sockets live in a directory of mode 0700 that no other user can enter; each peer's
uid is checked too (``SO_PEERCRED``), and a peer of another user is closed unread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: errors of one ``accept`` that leave the listener open: the process was out of
#: descriptors or memory for a moment, or the peer left before it was accepted. The loop
#: waits :data:`ACCEPT_AGAIN_S` and accepts again; it ended on them, and every later lane
#: or side door to this live process waited unserved.
ACCEPT_AGAIN = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EINTR}
)
ACCEPT_AGAIN_S = 0.1


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of ``conn`` (-1 if it cannot be read)."""
    try:
        _, uid, _ = PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        )
    except OSError:
        return -1
    return uid


def accept(
    listener: socket.socket,
    serve: Callable[[socket.socket], None],
    thread_name: str,
    admitted: Callable[[socket.socket], None] | None = None,
) -> None:
    """Admit peers on ``listener`` until it closes (run on a thread of its own): each
    peer of this user is ``admitted`` and then served by ``serve(conn)`` on a thread of
    its own; any other is closed."""
    uid = os.getuid()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if exc.errno in ACCEPT_AGAIN:  # e.g. out of descriptors a moment: not closed
                time.sleep(ACCEPT_AGAIN_S)
                continue
            return  # closed
        if peer_uid(conn) != uid:  # the directory's mode admits no one else; this checks it
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
            continue
        if admitted is not None:
            admitted(conn)
        threading.Thread(target=serve, args=(conn,), name=thread_name, daemon=True).start()
