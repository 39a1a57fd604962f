"""The accept loop the lanes and side doors share (nbrpc/_wire/same_user.py): a moment
out of descriptors does not end it; a closed listener does."""

from __future__ import annotations

import errno
import socket
import threading

from nbrpc._wire import same_user


class _Listener:
    """A listener whose first ``accept`` fails as a process out of descriptors does, then
    admits one real peer of this user, then is closed."""

    def __init__(self, conn: socket.socket) -> None:
        self.answers = [
            OSError(errno.EMFILE, "Too many open files"),
            conn,
            OSError(errno.EBADF, "Bad file descriptor"),
        ]

    def accept(self):
        answer = self.answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer, ""


def test_accept_goes_on_after_running_out_of_descriptors_and_ends_when_closed():
    mine, peer = socket.socketpair()
    served = []
    done = threading.Event()

    def serve(conn: socket.socket) -> None:
        served.append(conn.recv(5))
        done.set()

    peer.sendall(b"hello")
    with mine, peer:
        listener = _Listener(mine)
        same_user.accept(listener, serve, "test-accept")  # returns once it is closed
        assert done.wait(5)
    assert served == [b"hello"]
    assert listener.answers == []
