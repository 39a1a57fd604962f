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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import same_user

_BACKLOG = 16
_MESSAGE_BYTES = 1 << 20  # a question or an answer, at most


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
    # peers are served on threads of their own: the kernel keeps its connection open, so
    # a question finds a thread blocked in ``recv`` and takes the GIL once before its
    # answer is made (an ``accept`` would take it once more)
    same_user.listen(listener, _answer, "nbrpc-side-door")


def close() -> None:
    listener, path = _door.listener, _door.path
    _door.listener = _door.path = None
    if listener is not None:
        same_user.stop_listening(listener)
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _answer(conn: socket.socket) -> None:
    with conn:
        while True:
            try:
                message = conn.recv(_MESSAGE_BYTES)
                if not message:
                    return  # the asker closed it
                question, args = pickle.loads(message)
                conn.sendall(pickle.dumps(_door.questions[question](*args)))
            except OSError:
                return
            except Exception:  # bytes from outside never take the process down
                return


@dataclass
class _Kept:
    """The asker's open connections, by door path, each with the lock of its one question
    in flight (a second asker at the same time opens one of its own)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    conns: dict[str, tuple[socket.socket, threading.Lock]] = field(default_factory=dict)


_kept = _Kept()


def _connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def keep_open(paths: list[str], timeout: float = 2.0, renew: list[str] | None = None) -> None:
    """Connect to these doors now, while the processes behind them are idle, and keep the
    connections for :func:`ask` (the others are dropped: a restart's old processes;
    ``renew``: doors a new process opened at the same path)."""
    with _kept.lock:
        for path in (set(_kept.conns) - set(paths)) | set(renew or ()):
            if path in _kept.conns:
                _kept.conns.pop(path)[0].close()
        for path in paths:
            if path not in _kept.conns:
                with contextlib.suppress(OSError):
                    _kept.conns[path] = (_connect(path, timeout), threading.Lock())


def forget_kept() -> None:
    """Close every kept connection (the cluster is gone)."""
    keep_open([])


def _take(path: str, timeout: float) -> tuple[socket.socket, threading.Lock | None]:
    """A connection to ``path`` for one question: the kept one if free (its lock taken),
    else a new one (no lock: closed after)."""
    with _kept.lock:
        kept = _kept.conns.get(path)
    if kept is not None and kept[1].acquire(blocking=False):
        return kept[0], kept[1]
    return _connect(path, timeout), None


def _give_back(path: str, sock: socket.socket, lock: threading.Lock | None, ok: bool) -> None:
    """A question's connection after its answer (``ok``) or none: a kept one stays kept
    if it answered (a late answer would be read as the next question's); a new one that
    answered is kept where none is."""
    with _kept.lock:
        kept = _kept.conns.get(path)
        if lock is None:  # a new connection
            if ok and kept is None:
                _kept.conns[path] = (sock, threading.Lock())
            else:
                sock.close()
            return
        if not ok:
            if kept is not None and kept[0] is sock:
                del _kept.conns[path]
            sock.close()
    lock.release()


def ask(doors: dict[str, str], question: str, args: tuple, timeout: float) -> dict[str, Any]:
    """``question`` asked at the side doors ``doors`` (name -> path) all at once: the
    answers by name; a process whose door did not answer within ``timeout`` is left out."""
    message = pickle.dumps((question, args))
    sent: dict[str, tuple[str, socket.socket, threading.Lock | None]] = {}
    answers: dict[str, Any] = {}
    try:
        for name, path in doors.items():
            for _ in range(2):  # a kept connection to a process that is gone: once more
                try:
                    sock, lock = _take(path, timeout)
                except OSError:
                    break
                try:
                    sock.sendall(message)
                except OSError:
                    _give_back(path, sock, lock, ok=False)
                    continue
                sent[name] = (path, sock, lock)
                break
        deadline = time.monotonic() + timeout
        for name in list(sent):
            path, sock, lock = sent[name]
            ok = False
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                reply = sock.recv(_MESSAGE_BYTES)
                if reply:
                    answers[name] = pickle.loads(reply)
                    ok = True
            except Exception:  # no answer in time, or not one: that connection goes
                pass
            finally:
                del sent[name]
                _give_back(path, sock, lock, ok)
    finally:  # interrupted (the stop button pressed again): every connection given back
        for path, sock, lock in sent.values():
            _give_back(path, sock, lock, ok=False)
    return answers
