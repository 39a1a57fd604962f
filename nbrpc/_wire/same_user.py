"""Unix sockets that admit processes of this user only: the one accept loop of a process,
which the lanes (:mod:`nbrpc._wire.lanes`) and the side doors (:mod:`nbrpc._wire.side_door`)
share.

Their sockets live in a directory of mode 0700 that no other user can enter; each peer's
uid is checked too (``SO_PEERCRED``), and a peer of another user is closed unread. One
thread, ``nbrpc-accept``, started at the first :func:`listen`, waits on every listener of
the process at once (a selector) and admits each peer; a listener is given up with
:func:`stop_listening` before it is closed (the loop must never wait on a closed
descriptor, whose number the next socket may take). In a forked child the loop starts
again at its first listener.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbrpc import _fork

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


Serve = Callable[[socket.socket], None]


@dataclass
class _Loop:
    """The process's accept loop: its selector (a key's data: what serves the listener's
    peers), the pair of sockets that wakes it for a new listener, its thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    selector: selectors.BaseSelector | None = None
    wake: tuple[socket.socket, socket.socket] | None = None
    thread: threading.Thread | None = None


_loop = _Loop()


def listen(
    listener: socket.socket, serve: Serve, thread_name: str, admitted: Serve | None = None
) -> None:
    """Admit peers on ``listener`` from now on, on the process's accept loop: each peer of
    this user is ``admitted`` and then served by ``serve(conn)`` on a thread of its own
    named ``thread_name``; any other is closed."""
    with _loop.lock:
        if _loop.selector is None:
            _loop.selector = selectors.DefaultSelector()
            _loop.wake = socket.socketpair()
            _loop.wake[0].setblocking(False)
            _loop.selector.register(_loop.wake[0], selectors.EVENT_READ, None)
            _loop.thread = threading.Thread(target=_run, name="nbrpc-accept", daemon=True)
            _loop.thread.start()
        listener.setblocking(False)  # a peer gone before its accept must not hold the loop
        _loop.selector.register(listener, selectors.EVENT_READ, (serve, thread_name, admitted))
        _wake()


def stop_listening(listener: socket.socket) -> None:
    """Before ``listener`` closes: the loop no longer waits on it. Raises nothing."""
    with _loop.lock:
        if _loop.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                _loop.selector.unregister(listener)
            _wake()


def _wake() -> None:
    if _loop.wake is not None:
        with contextlib.suppress(OSError):  # full: it wakes anyway
            _loop.wake[1].send(b"w")


def _run() -> None:
    selector, wake = _loop.selector, _loop.wake
    assert selector is not None
    assert wake is not None
    while True:
        for key, _ in selector.select():
            if key.data is None:  # a new or a given-up listener: select again
                with contextlib.suppress(OSError):
                    wake[0].recv(4096)
                continue
            listener: Any = key.fileobj
            if not accept_one(listener, *key.data):
                stop_listening(listener)  # closed


def accept_one(
    listener: Any, serve: Serve, thread_name: str, admitted: Serve | None = None
) -> bool:
    """Admit one peer waiting on ``listener`` (see :func:`listen`); False once it is
    closed. A moment out of descriptors waits :data:`ACCEPT_AGAIN_S` and says True."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True  # (the peer left before it was accepted)
    except OSError as exc:
        if exc.errno in ACCEPT_AGAIN:  # e.g. out of descriptors a moment: not closed
            time.sleep(ACCEPT_AGAIN_S)
            return True
        return False  # closed
    conn.setblocking(True)
    if peer_uid(conn) != os.getuid():  # the directory's mode admits no one else
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        return True
    if admitted is not None:
        admitted(conn)
    threading.Thread(target=serve, args=(conn,), name=thread_name, daemon=True).start()
    return True


def _after_fork_in_child() -> None:
    """The parent's loop thread is not the child's (nor, once it closes them, its
    listeners): the child's first :func:`listen` starts its own."""
    global _loop
    _loop = _Loop()


_fork.in_child(_after_fork_in_child)
