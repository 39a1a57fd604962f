"""Small calls between processes of one host: Unix-socket lanes beside TensorPipe.

A small Python call through TensorPipe costs about 0.7 ms here, of which the work (pickle
the call, run it, pickle the reply) is about 30 µs and a pipe ping-pong between two
processes 52 µs. A *lane* is a Unix socket between two processes of a local cluster that
carries such calls with nbrpc's own pickler, so a small round trip costs about what the
pipe and the pickling cost. TensorPipe stays the data plane for everything else.

What takes a lane (decided per call by the caller, :func:`request`; anything else goes
through TensorPipe as before, unchanged):

* ``rpc_sync`` / ``rpc_async`` of a Python function or builtin, from a process of a local
  cluster started with lanes on (``--no-fast-calls`` turns them off);
* whose arguments pickle with no RRef (torch must fork it), no tensor that is not a plain
  dense CPU tensor without ``requires_grad``, and tensor storages of
  :data:`MAX_TENSOR_BYTES` together at most (larger ones take the shared-memory arena);
* not made inside a distributed autograd context (torch records the send and receive
  functions of the backward pass on each RPC), not while torch's profiler records (it
  records the RPC), not from a thread that serves a call (a nested call waits holding its
  thread: on torch's pool :mod:`nbrpc._calls.deadlock` watches such waits), and not of a function
  decorated ``@rpc.functions.async_execution`` (torch completes its future).

The callee runs the call in :func:`nbrpc._wire.callee.run_function`, as TensorPipe's
calls are run: the same output forwarding, failures with their traceback, recording,
stack labels and counts. A reply that cannot take the lane (it holds an RRef, a CUDA or
large tensor, or does not pickle) is kept by the callee and fetched by the caller through
TensorPipe (:func:`take`): torch's own path, with torch's behaviour. A request the callee
cannot unpickle (a function it cannot import) is sent again through TensorPipe, unrun, so
its error is the one TensorPipe gives.

Two kinds of lane: the main thread's ``rpc_sync`` writes on a lane of its own per peer and
reads the answer there itself (no thread in between on either side: the callee runs the
call on the lane's own thread); every other call shares one lane per peer, whose calls
leave through an outbox thread (:class:`~nbrpc._wire.frames.Outbox`) and whose replies a
reader thread completes, and the callee runs those on a pool of up to
``num_worker_threads`` threads (:mod:`.pool`: calls that wait on each other behave as on
torch's pool). A notebook function that does not change between calls is pickled once
(:mod:`.sent_functions`). An idle lane blocks in ``recv``: no CPU.

Who may connect: the sockets live in a directory of mode 0700 made by the kernel, and a
listener admits a peer only if ``SO_PEERCRED`` says it runs as the same user.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import os
import pickle
import shutil
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nbrpc import _process, _torch

from . import callee, pickling, recording, shm
from .frames import FRAME, Frames, Outbox
from .pool import Pool

#: tensor storage bytes one message may carry on a lane (more: TensorPipe, or the arena)
MAX_TENSOR_BYTES = 1 << 16
INLINE, POOLED, VALUE, FETCH, RETRY = 1, 2, 3, 4, 5  # a frame's kind, on the wire
LOST = 6  # here only: the lane closed before the reply came
_PEERCRED = struct.Struct("3i")
#: seconds one read of the main thread's lane waits (then it looks at signals and prompts)
MAIN_SLICE_S = 0.1
_MAIN_SLICE = struct.pack("ll", 0, int(MAIN_SLICE_S * 1e6))  # a struct timeval


class NotLane(Exception):
    """A message that must go through TensorPipe (raised while pickling it)."""


class LaneLost(ConnectionError):
    """The peer's end of a lane closed: its process is gone (or the cluster closed)."""


# -- pickling --------------------------------------------------------------------------------


def _tensor(dtype: torch.dtype, data: bytes, offset: int, size: tuple, stride: tuple) -> Any:
    """Unpickling side of :func:`_reduce_tensor`: the tensor, on a storage of its own."""
    storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else None
    made = torch.empty(0, dtype=dtype)
    return made.set_(storage, offset, size, stride) if storage is not None else made.resize_(size)


def _reduce_tensor(t: torch.Tensor) -> Any:
    """A small dense CPU tensor, in the pickle: its whole storage, offset, size and stride
    (what TensorPipe sends too, so a view arrives as the same view)."""
    if (
        not t.is_cpu
        or t.requires_grad
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        raise NotLane
    storage = t.untyped_storage()
    nbytes, address = storage.nbytes(), storage.data_ptr()
    counted = _pickled.bytes + nbytes
    if counted > MAX_TENSOR_BYTES or (nbytes and address in _pickled.storages):
        raise NotLane  # too large, or two tensors share it (TensorPipe keeps them sharing)
    _pickled.bytes = counted
    if nbytes:
        _pickled.storages.add(address)
    data = ctypes.string_at(address, nbytes) if nbytes else b""
    return _tensor, (t.dtype, data, t.storage_offset(), tuple(t.shape), t.stride())


def _refuse(obj: Any) -> Any:
    raise NotLane


class _Pickled(threading.local):
    bytes = 0
    storages: set[int]

    def __init__(self) -> None:
        self.storages = set()


_pickled = _Pickled()
_tables: dict[bool, dict] = {}


def reducers(recording_on: bool) -> dict:
    """The lane pickler's reducers: tensors in the pickle, RRefs and torch's special
    classes refused (``recording_on``: tensor bytes counted for the timeline)."""
    table = _tables.get(recording_on)
    if table is None:
        tensor = recording.counted(_reduce_tensor, "lane") if recording_on else _reduce_tensor
        table = {torch.Tensor: tensor, _torch.PyRRef: _refuse, torch.distributed.rpc.RRef: _refuse}
        table.update(dict.fromkeys(_torch.custom_reducer_classes(), _refuse))
        table = _tables[recording_on] = pickling.over_base_table(table)
    return table


_PLAIN_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_TABLE: dict[Any, Any] = {torch.Tensor: _reduce_tensor}


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` holds only numbers, strings, bytes, None, plain tensors, and small
    tuples, lists and dicts of these: what the standard library's C pickler pickles as
    nbrpc's would (no class or function in it, by value or not)."""
    kind = type(obj)
    if kind in _PLAIN_ATOMS or kind is torch.Tensor:
        return True
    if depth > 3 or kind not in (tuple, list, dict) or len(obj) > 32:
        return False
    if kind is dict:
        return all(type(k) in _PLAIN_ATOMS and _plain(v, depth + 1) for k, v in obj.items())
    return all(_plain(item, depth + 1) for item in obj)


def dumps(obj: Any) -> bytes:
    """``obj`` (a reply) pickled for a lane (nbrpc's pickler: notebook code by value);
    raises when it cannot take one (:class:`NotLane`, or any pickling error). A plain
    value, not recorded, takes the C pickler alone (12 -> 3 µs for a small tensor)."""
    out = _message()
    recording_on = recording.active() is not None
    if not recording_on and _plain(obj):
        plain = pickle.Pickler(out, protocol=5)
        plain.dispatch_table = _PLAIN_TABLE
        plain.dump(obj)
    else:
        pickling.LanePickler(out, reducers(recording_on)).dump(obj)
    return out.getvalue()


def _message() -> io.BytesIO:
    """A new message's buffer; the tensors :func:`_reduce_tensor` counted are forgotten."""
    _pickled.bytes = 0
    _pickled.storages.clear()
    return io.BytesIO()


# -- this process's lanes --------------------------------------------------------------------


@dataclass
class _Lanes:
    """This process's side: where the sockets are (None: lanes off), its listener, the
    lanes it opened, and what its callee side keeps."""

    directory: str | None = None
    listener: socket.socket | None = None
    unreachable: set[int] = field(default_factory=set)  # peer ranks with no lane
    main: dict[int, _Lane] = field(default_factory=dict)  # the main thread's, by rank
    shared: dict[int, _Lane] = field(default_factory=dict)  # everyone else's, by rank
    served: set[socket.socket] = field(default_factory=set)  # connections from peers
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[int, Any] = field(default_factory=dict)  # replies kept for take()
    held_ids: Any = field(default_factory=lambda: itertools.count(1))
    pool: Pool | None = None
    made_directory: bool = False  # the kernel's: it removes it at close
    paused: bool = False  # this process sends its calls through TensorPipe for now


_lanes = _Lanes()
#: .lane: set on a lane's reader thread. A call a future's callback makes there (torch's
#: ``fut.then(...)`` runs it on the thread that completes the future) goes through
#: TensorPipe: waiting for its answer on a lane would wait for this very thread to read it
_reading = threading.local()


def socket_path(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.sock")


def make_directory(prefix: str) -> str | None:
    """The kernel's directory for the cluster's sockets (mode 0700), or None if none can
    be made (lanes stay off)."""
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"{prefix}-lanes")
    try:
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, 0o700)
    except OSError:
        return None
    if len(socket_path(path, "x" * 40)) > 100:  # sun_path holds 108 bytes
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path


def open_here(directory: str, threads: int, made: bool = False) -> bool:
    """Listen for lanes in ``directory`` under this process's name; False if it cannot
    (then calls to it go through TensorPipe)."""
    close()
    path = socket_path(directory, _process.name())
    if len(path) > 100 or not os.path.isdir(directory):
        return False
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)  # a restarted worker's predecessor's
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(64)
    except OSError:
        listener.close()
        return False
    _lanes.directory, _lanes.listener = directory, listener
    _lanes.made_directory = made
    _lanes.pool = Pool(threads, _run)  # runs pooled calls: torch's num_worker_threads
    threading.Thread(target=_accept, args=(listener,), name="nbrpc-lanes", daemon=True).start()
    return True


def set_up(prefix: str, workers: list[str], threads: int) -> bool:
    """On the kernel, for a local cluster: lanes between every process of the group
    (``workers``: those that joined now; the kernel's lanes are opened once per cluster,
    and a restart's new workers join them). Returns whether the kernel's are open."""
    directory = _lanes.directory
    if directory is None:
        directory = make_directory(prefix)
        if directory is None or not open_here(directory, threads, made=True):
            return False
    shm.on_each(workers, open_here, directory, threads)  # one that cannot: TensorPipe
    return True


def directory() -> str | None:
    """Where this process's lanes are (None: off)."""
    return _lanes.directory


def pause(paused: bool) -> None:
    """Send this process's calls through TensorPipe (``True``) or on lanes again; its
    lanes stay open (a benchmark compares the two routes in the same processes)."""
    _lanes.paused = paused


def close() -> None:
    """Lanes off in this process: the listener, every lane and connection closed (a
    caller waiting on one gets :class:`LaneLost`), the socket file removed."""
    listener, directory = _lanes.listener, _lanes.directory
    _lanes.directory = _lanes.listener = None
    _lanes.paused = False
    if listener is not None:
        _shut(listener)
        if directory is not None:
            with contextlib.suppress(OSError):
                os.unlink(socket_path(directory, _process.name()))
    with _lanes.lock:
        lanes = [*_lanes.main.values(), *_lanes.shared.values()]
        served = list(_lanes.served)
        _lanes.main.clear()
        _lanes.shared.clear()
        _lanes.served.clear()
        _lanes.unreachable.clear()
        _lanes.held.clear()
    for lane in lanes:
        lane.close()
    for conn in served:
        _shut(conn)
    if _lanes.pool is not None:
        _lanes.pool.stop()
        _lanes.pool = None
    if _lanes.made_directory and directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        _lanes.made_directory = False


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def in_flight() -> int:
    """Calls this process started on lanes that have not finished."""
    with _lanes.lock:
        return sum(len(lane.pending) for lane in _lanes.shared.values()) + sum(
            1 for lane in _lanes.main.values() if lane.busy
        )


# -- the caller's side -------------------------------------------------------------------------


def request(dest: Any, func: Any, args: tuple, kwargs: dict | None) -> bytes | None:
    """The call, pickled for a lane to worker ``dest`` (a WorkerInfo), or None when it
    goes through TensorPipe (see the module's docstring for why a call would)."""
    if (
        _lanes.directory is None
        or _lanes.paused
        or dest.id in _lanes.unreachable
        or callee.serving()
        or getattr(_reading, "lane", None) is not None
        or getattr(func, "_wrapped_async_rpc_function", None) is not None
        or _torch.profiler_enabled()
        or _torch.in_autograd_context()
    ):
        return None
    if _torch.is_builtin(func):
        func, args, kwargs = callee.call_builtin, (func, args, kwargs), None
    try:
        return _call_bytes(func, args, kwargs or {})
    except Exception:  # NotLane, or what TensorPipe's pickling will report in its words
        return None


def _call_bytes(func: Any, args: tuple, kwargs: dict) -> bytes:
    """A call pickled for a lane: ``(func, args, kwargs, header)``, the header
    (:mod:`.recording`) beside the call, not wrapped around torch's call record."""
    out = _message()
    pickler = pickling.LanePickler(out, reducers(recording.active() is not None))
    header, message = (
        recording.header_for(_process.name(), False, True)
        if callee.is_user_call(func)
        else (None, None)
    )
    pickler.dump_as_is((func, args, kwargs, header))
    if message is not None:
        recording.pickled(message, out.tell())
    return out.getvalue()


class _Lane:
    """One connection to a peer. ``main``: the main thread's (it reads its own answer),
    else shared, with a reader thread that completes each call's future."""

    def __init__(self, sock: socket.socket, dest: str, main: bool) -> None:
        self.sock, self.dest, self.main = sock, dest, main
        self.frames = Frames(sock)
        if main:  # its reads return after a slice, for the main thread to look around
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _MAIN_SLICE)
        self.write_lock = threading.Lock()
        self.ids = itertools.count(1)
        self.pending: dict[int, Callable[[int, Any], None]] = {}  # call id -> on_reply
        self.busy = False
        self.closed = False
        self.outbox: Outbox | None = None
        if not main:  # calls leave through an outbox; a reader thread completes them
            self.outbox = Outbox(sock, f"nbrpc-lane-out-{dest}", self.write_lock, self._lost)
            threading.Thread(target=self._read, name=f"nbrpc-lane-{dest}", daemon=True).start()

    def send(self, payload: bytes, on_reply: Callable[[int, Any], None] | None = None) -> int:
        call = next(self.ids)
        if on_reply is not None:
            self.pending[call] = on_reply
        frame = FRAME.pack(call, len(payload), INLINE if self.main else POOLED) + payload
        try:
            if self.outbox is not None:
                if not self.outbox.put(frame):
                    raise OSError("closed")
            else:
                with self.write_lock:
                    self.sock.sendall(frame)
        except OSError as exc:
            self.pending.pop(call, None)
            self.close()
            raise LaneLost(f"the lane to {self.dest} closed: {exc}") from None
        return call

    def _lost(self, exc: Any) -> None:
        self.close()  # the reader sees the end, and fails the calls waiting

    def answer(self) -> tuple[int, Any] | None:
        """The main thread's lane: the answer ``(kind, value)`` if it comes within
        :data:`MAIN_SLICE_S`, else None (a read that times out: the main thread then
        looks at signals, prompts and its clock, and reads again); raises :class:`LaneLost`.
        One ``recv`` where a ``poll`` and a ``recv`` were (about 10 µs a call, measured)."""
        try:
            return self.receive()[1]
        except BlockingIOError:  # SO_RCVTIMEO passed: nothing yet
            return None

    def receive(self) -> tuple[int, Any]:
        """The next reply on this lane: ``(kind, value)``; raises :class:`LaneLost`."""
        try:
            frame = self.frames.next()
        except BlockingIOError:
            raise  # the main lane's read timed out (answer())
        except OSError as exc:  # ECONNRESET: the peer died with bytes unread
            self.close()
            raise LaneLost(f"{self.dest} closed its end of the lane ({exc})") from None
        if frame is None or frame[1] not in (VALUE, FETCH, RETRY):
            self.close()
            raise LaneLost(f"{self.dest} closed its end of the lane (its process exited)")
        call, kind, payload = frame
        return call, _reply(kind, payload)

    def _read(self) -> None:
        _reading.lane = self  # futures complete here, and run their callbacks here
        lost: LaneLost | None = None
        try:
            while True:
                call, reply = self.receive()
                on_reply = self.pending.pop(call, None)
                if on_reply is not None:
                    on_reply(*reply)
        except LaneLost as exc:
            lost = exc
        except Exception as exc:  # a reply that does not unpickle here: the lane is unusable
            lost = LaneLost(f"the lane to {self.dest} broke: {type(exc).__name__}: {exc}")
        finally:
            self.close()
            pending = list(self.pending.values())
            self.pending.clear()
            for on_reply in pending:
                on_reply(LOST, lost)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outbox is not None:
            self.outbox.close()
        _shut(self.sock)
        with _lanes.lock:
            for table in (_lanes.main, _lanes.shared):
                for rank, lane in list(table.items()):
                    if lane is self:
                        del table[rank]


def _reply(kind: int, payload: bytes) -> tuple[int, Any]:
    if kind == VALUE:
        return VALUE, pickle.loads(payload)
    if kind == FETCH:
        return FETCH, int.from_bytes(payload, "little")
    return RETRY, None


def lane_to(dest: Any, main: bool) -> _Lane | None:
    """This process's lane to ``dest`` (a WorkerInfo), opened on first use; None if the
    peer has none (its calls go through TensorPipe from then on)."""
    table = _lanes.main if main else _lanes.shared
    lane = table.get(dest.id)
    if lane is not None and not lane.closed:
        return lane
    directory = _lanes.directory
    if directory is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path(directory, dest.name))
    except OSError:
        sock.close()
        _lanes.unreachable.add(dest.id)
        return None
    lane = _Lane(sock, dest.name, main)
    with _lanes.lock:
        if _lanes.directory is None:  # closed meanwhile
            lane.close()
            return None
        table[dest.id] = lane
    return lane


# -- the callee's side ---------------------------------------------------------------------------


def _accept(listener: socket.socket) -> None:
    uid = os.getuid()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed
        try:
            _, peer_uid, _ = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
        except OSError:
            peer_uid = -1
        if peer_uid != uid:  # the directory's mode admits no one else; this checks it
            _shut(conn)
            continue
        with _lanes.lock:
            _lanes.served.add(conn)
        threading.Thread(target=_serve, args=(conn,), name="nbrpc-lane", daemon=True).start()


def _serve(conn: socket.socket) -> None:
    """Read a peer's calls: the main thread's run here, the others on the pool."""
    callee.serve_lanes_here()
    frames = Frames(conn)
    write_lock = threading.Lock()
    outbox: Outbox | None = None

    def answer(frame: bytes) -> None:
        try:
            with write_lock:
                conn.sendall(frame)
        except OSError:
            pass  # the caller went away (its stop button, a timeout): nothing waits for it

    try:
        while True:
            frame = frames.next()
            if frame is None or frame[1] not in (INLINE, POOLED):
                return  # closed, or not a peer speaking this protocol: drop it
            call, kind, payload = frame
            if kind == INLINE:
                _run(answer, call, payload)
            elif _lanes.pool is not None:
                if outbox is None:  # pooled calls' replies leave through an outbox
                    outbox = Outbox(conn, "nbrpc-lane-replies", write_lock, _ignore)
                _lanes.pool.put((outbox.put, call, payload))
    except Exception:  # bytes from outside never take the process down
        return
    finally:
        if outbox is not None:
            outbox.close()
        with _lanes.lock:
            _lanes.served.discard(conn)
        _shut(conn)


def _run(answer: Callable[[bytes], Any], call: int, payload: bytes) -> None:
    """Run one call and ``answer`` it (a frame sent, or put in the connection's outbox)."""
    try:
        func, args, kwargs, header = pickle.loads(payload)
    except Exception:  # e.g. a function this process cannot import: TensorPipe says it
        answer(FRAME.pack(call, 0, RETRY))
        return
    udf = _torch.PythonUDF(func, args, kwargs)
    if header is not None:  # a user's call: its header, and the row says it came this way
        udf = recording.arrived(header, udf)
        udf.lane = True
    del func, args, kwargs
    result = callee.run_function(udf)
    row = recording.reply_row(result)
    try:
        reply = dumps(result)
        kind = VALUE
    except Exception:  # an RRef, a CUDA or large tensor, or no pickle: TensorPipe takes it
        with _lanes.lock:
            key = next(_lanes.held_ids)
            _lanes.held[key] = result, row
        reply, kind = key.to_bytes(8, "little"), FETCH
    del result, udf
    answer(FRAME.pack(call, len(reply), kind) + reply)


def _ignore(exc: Any) -> None:
    """A reply could not be sent: the caller went away, nothing waits for it."""


def take(key: int) -> Any:
    """Called through TensorPipe by a caller: a reply kept because it could not take the
    lane (:func:`_run`), sent now with torch's pickling."""
    with _lanes.lock:
        result, row = _lanes.held.pop(key)
    recording.reply_here(result, row)  # a recorded call's row counts the reply's bytes
    return result
