"""A side door into each process on this host: questions answered while every RPC
thread is busy (the stop button's cancel, ``%rpc_status``'s figures).

A worker whose threads all run Python hands its GIL to another thread about every
5 ms, and to a given one of N busy threads about every N * 5 ms: a question sent by RPC
waits behind the calls queued before it, and one through ipyparallel's engine, which
takes the GIL tens of times on its way in and out, took 1.5-3.5 s to reach a worker
running 16 busy calls (measured). The side door is a socket in the lanes' directory
(:mod:`nbrpc._wire.lanes`; mode 0700, each peer's uid checked, as the lanes do) with a
thread of its own blocked on it: a question takes the GIL about twice there.

Questions are registered by name (:func:`answer`) by the modules that answer them; a
question and its answer travel pickled, as a lane's calls do (same user, same trust).
Workers on other hosts are asked through their engines instead (the lifecycle's
``_ask_aside``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_BACKLOG = 16
_MESSAGE_BYTES = 1 << 20  # a question or an answer, at most
_PEERCRED = struct.Struct("3i")


@dataclass
class _Door:
    listener: socket.socket | None = None
    path: str | None = None
    questions: dict[str, Callable[..., Any]] = field(default_factory=dict)


_door = _Door()


def answer(question: str, func: Callable[..., Any]) -> None:
    """``func(*args)`` answers ``question`` at this process's side door."""
    _door.questions[question] = func


def path_of(directory: str, name: str) -> str:
    """Where process ``name``'s side door is, in the lanes' ``directory``."""
    return os.path.join(directory, f"{name}.door")


def open_here(directory: str, name: str) -> None:
    """Open this process's side door (beside its lanes)."""
    close()
    path = path_of(directory, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a restarted worker's predecessor's
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(_BACKLOG)
    except OSError:
        listener.close()
        return
    _door.listener, _door.path = listener, path
    threading.Thread(target=_serve, args=(listener,), name="nbrpc-side-door", daemon=True).start()


def close() -> None:
    listener, path = _door.listener, _door.path
    _door.listener = _door.path = None
    if listener is not None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _serve(listener: socket.socket) -> None:
    uid = os.getuid()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed
        with conn:
            try:
                _, peer_uid, _ = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
                if peer_uid != uid:  # the directory's mode admits no one else; this checks it
                    continue
                conn.settimeout(5.0)
                question, args = pickle.loads(conn.recv(_MESSAGE_BYTES))
                conn.sendall(pickle.dumps(_door.questions[question](*args)))
            except Exception:  # bytes from outside never take the process down
                continue


def ask(doors: dict[str, str], question: str, args: tuple, timeout: float) -> dict[str, Any]:
    """``question`` asked at the side doors ``doors`` (name -> path) all at once: the
    answers by name; a process whose door did not answer within ``timeout`` is left out."""
    message = pickle.dumps((question, args))
    opened: dict[str, socket.socket] = {}
    for name, path in doors.items():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(message)
        except OSError:
            sock.close()
            continue
        opened[name] = sock
    deadline = time.monotonic() + timeout
    answers = {}
    for name, sock in opened.items():
        with sock:
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                answers[name] = pickle.loads(sock.recv(_MESSAGE_BYTES))
            except (OSError, pickle.UnpicklingError, EOFError):
                continue
    return answers
