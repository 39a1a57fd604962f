"""The accept loop the lanes and side doors share (nbrpc/_wire/same_user.py): one thread
for every listener of a process; a moment out of descriptors does not end a listener's
admissions, a closed listener does."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
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
        assert same_user.accept_one(listener, serve, "test-accept")  # out of descriptors
        assert same_user.accept_one(listener, serve, "test-accept")  # the peer
        assert not same_user.accept_one(listener, serve, "test-accept")  # closed
        assert done.wait(5)
    assert served == [b"hello"]
    assert listener.answers == []


def test_one_thread_admits_the_peers_of_every_listener_until_each_is_given_up():
    got: list[tuple[str, bytes]] = []
    both = threading.Semaphore(0)

    def server(kind: int, what: str) -> tuple[socket.socket, str]:
        path = os.path.join(folder, f"{what}.sock")
        listener = socket.socket(socket.AF_UNIX, kind)
        listener.bind(path)
        listener.listen(4)

        def serve(conn: socket.socket) -> None:
            with conn:
                got.append((what, conn.recv(16)))
            both.release()

        same_user.listen(listener, serve, f"test-{what}")
        return listener, path

    with tempfile.TemporaryDirectory() as folder:
        lanes, lane_path = server(socket.SOCK_STREAM, "lane")
        door, door_path = server(socket.SOCK_SEQPACKET, "door")
        for kind, path in ((socket.SOCK_STREAM, lane_path), (socket.SOCK_SEQPACKET, door_path)):
            with socket.socket(socket.AF_UNIX, kind) as peer:
                peer.connect(path)
                peer.sendall(b"hi")
                assert both.acquire(timeout=5), f"nobody admitted the peer of {path}"
        assert sorted(got) == [("door", b"hi"), ("lane", b"hi")]
        loops = [t for t in threading.enumerate() if t.name == "nbrpc-accept"]
        assert len(loops) == 1
        for listener in (lanes, door):
            same_user.stop_listening(listener)
            listener.close()
        # a socket that takes a given-up listener's descriptor number is admitted anew
        again, _ = server(socket.SOCK_STREAM, "again")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.connect(os.path.join(folder, "again.sock"))
            peer.sendall(b"again")
            assert both.acquire(timeout=5)
        assert got[-1] == ("again", b"again")
        same_user.stop_listening(again)
        again.close()
