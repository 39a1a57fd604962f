"""The same-host fast path: large CPU tensors travel through shared memory, not a socket.

TensorPipe moves a tensor between two processes of one host through a transport and a
channel (here: "uv" sockets and "cma", one copy straight into freshly allocated memory):
measured here, a 64 MB round trip took 74 ms, most of it the OS handing out and zeroing
new pages. When every process of the group is on one host (a
local cluster: its store is a private file, so it must be; across hosts, the processes
that share one ``/dev/shm``, see :func:`configure`), nbrpc's pickler sends a large
CPU tensor as a name instead: the sender copies the tensor's storage once into shared
memory under ``/dev/shm`` (owner-only), the receiver uses that memory as the tensor's own.
One copy in all.

Where it goes: first a slot of the sender's **arena** (:mod:`nbrpc._wire.arena`), a file mapped
once in each process and kept mapped, so neither side pays for mapping, unmapping or page
faults per message (64 MB round trip: 26 ms with a segment per message, see
docs/benchmarks.md for the arena's). The slot is the received tensor's memory until the
receiver frees it. A message that does not fit in the arena takes a **segment**: a
file of its own, mapped by the receiver for that message. Fresh shared memory is slow to
write (the OS allocates and zeroes every page first: measured 40–90 ms for 64 MB here,
against 10 ms into pages that exist), so segments are recycled: when the receiver's tensor
is freed, its segment is renamed into a pool (``...-pool-<bytes>-...``, bounded by
:data:`POOL_BYTES`), and the next sender of a storage of that size claims it with an atomic
rename. A pooled segment is mapped by nobody, so reusing it cannot alias a live tensor.

What the receiver sees does not change: a tensor with the same values, dtype, shape,
strides and storage offset, backed by memory of its own (a slot or segment per message,
so nothing aliases the sender's tensor; tensors of one message that shared a storage still
share it). Tensors that require grad keep torch's path, because distributed autograd
attaches its send/recv functions to the tensors torch itself transports; so do CUDA,
sparse and quantized tensors, tensor subclasses, and anything below the threshold.

Arenas and segments are named ``nbrpc-<kernel pid>-...``. A segment whose message never
arrived (the receiver died), and every arena, are removed when the cluster shuts down, or
by the kernel's watchdog if the kernel dies (:func:`nbrpc._engines.watchdog.sweep_segments`).

Which processes share a ``/dev/shm`` is found once a cluster forms, by the kernel
(:mod:`.shm_setup`); this module is the path each message takes.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import arena as _arena

#: Tensors whose storage is at least this large take the fast path (bytes). Measured here
#: with the arena (round trips, fast path vs TensorPipe's uv transport + cma channel, medians
#: of 20): 0.25 MB 1.8 vs 1.5 ms, 1 MB 2.6-3.1 vs 2.6 ms, 4 MB 2.7-3.7 vs 4.8-5.1 ms, 16 MB
#: 6.0-6.8 vs 11.9-13.2 ms, 64 MB 16.4-17.6 vs 106-109 ms. (Segments alone, before the
#: arena, won only from 32 MB.)
DEFAULT_THRESHOLD = 1 << 20
SHM_DIR = "/dev/shm"
#: Most bytes kept in recycled segments, all processes of a cluster together.
POOL_BYTES = 1 << 30


@dataclass
class _FastPath:
    """This process's side of the fast path."""

    threshold: int | None = None  # bytes; None: off
    prefix: str = ""  # the cluster's name prefix under /dev/shm
    exported: int = 0  # storages copied into shared memory (arena slots or segments)
    #: None when every peer sees this /dev/shm (a local cluster), else the names of those
    #: that do (a cluster across hosts)
    peers: frozenset[str] | None = None
    arena: _arena.Arena | None = None  # made at this process's first large message
    use_arena: bool = True  # False once an arena could not be made: segments only


_state = _FastPath()
#: Where the message this thread is pickling goes, when only some peers share memory:
#: .dest (a call being sent), .pickling (the destination of the message being pickled now).
_route = threading.local()
#: thread id -> (result, caller): the reply a call expects. Not a threading.local: torch
#: pickles the reply under a new acquisition of the GIL on its own thread, and pybind11
#: gives a foreign thread a fresh Python thread state (and fresh thread-locals) each time.
_replies: dict[int, tuple[Any, str]] = {}
_counter = itertools.count()
_opened: weakref.WeakValueDictionary[str, mmap.mmap] = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def configure(prefix: str, threshold: int | None, peers: list[str] | None = None) -> None:
    """Turn the fast path on in this process (``threshold`` in bytes) or off (``None``).

    ``peers``: the processes that see this process's ``/dev/shm`` (``None``: all of them).
    Then a large tensor takes shared memory only in a message known to go to one of them:
    a call sent through nbrpc (:func:`sending_to`) or the reply to a call from one of them
    (:func:`expect_reply`); anything else goes through TensorPipe, which reaches everyone.
    """
    usable = threshold is not None and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    _state.threshold = int(threshold) if usable and threshold is not None else None
    _state.prefix = prefix
    _state.peers = None if peers is None else frozenset(peers)
    arena = _state.arena
    if arena is not None and not arena.usable(prefix):
        arena.close()  # a new cluster, whose start swept the old file (off: kept, warm)
        _state.arena = None
    _arena.forget_mappings()
    _replies.clear()


def forget_swept() -> None:
    """The cluster's shared-memory files are gone (its shutdown swept them): this process
    keeps no mapping of them (each holds a file descriptor) but those its received tensors
    still use, and its own arena goes. They were kept until the next cluster's start: the
    soak counted up to 7 held after a shutdown, once lanes sent tensors over 64 KB this way.

    The fast path is off until the next cluster sets it up: with no peer left, a tensor
    pickled after the shutdown made an arena that no sweep removed (a /dev/shm file left
    at the process's end)."""
    _state.threshold = None
    _state.peers = None
    arena = _state.arena
    if arena is not None and not arena.usable(_state.prefix):
        _state.arena = None
    _arena.forget_mappings()


def restricted() -> bool:
    """Shared memory reaches some peers only (a cluster across hosts)."""
    return _state.threshold is not None and _state.peers is not None


#: What :func:`sending_to` and :func:`pickling` return when every peer shares memory (a
#: local cluster): nothing to track, so every message's path stays as cheap as before
#: (tracking costs about 6 µs a call, measured).
_UNROUTED = contextlib.nullcontext()


def sending_to(dest: str, kind: str = "call") -> contextlib.AbstractContextManager:
    """A call to ``dest`` is being sent on this thread (its pickling happens inside).

    ``kind``: ``"call"`` (a reply comes back) or ``"remote"`` (the value stays there).
    """
    return _sending_to(dest, kind) if restricted() else _UNROUTED


@contextlib.contextmanager
def _sending_to(dest: str, kind: str) -> Any:
    previous = getattr(_route, "dest", None), getattr(_route, "kind", None)
    _route.dest, _route.kind = dest, kind
    try:
        yield
    finally:
        _route.dest, _route.kind = previous


def sending() -> str | None:
    """The kind of call being sent on this thread (see :func:`sending_to`), if any."""
    return getattr(_route, "kind", None) if getattr(_route, "dest", None) else None


def expect_reply(result: Any, caller: str | None) -> None:
    """``result`` of a call from ``caller`` is about to be pickled as the reply here."""
    if caller is None:
        _replies.pop(threading.get_ident(), None)
    else:
        _replies[threading.get_ident()] = (result, caller)


def pickling(obj: Any) -> contextlib.AbstractContextManager:
    """While ``obj`` is pickled on this thread: where it goes, if known."""
    return _pickling(obj) if restricted() else _UNROUTED


@contextlib.contextmanager
def _pickling(obj: Any) -> Any:
    dest: str | None
    reply = _replies.get(threading.get_ident())
    if reply is not None and reply[0] is obj:
        del _replies[threading.get_ident()]
        dest = reply[1]
    else:
        dest = getattr(_route, "dest", None)
    previous = getattr(_route, "pickling", None)
    _route.pickling = dest
    try:
        yield
    finally:
        _route.pickling = previous


def _reaches(dest: str | None) -> bool:
    peers = _state.peers
    return peers is None or (dest is not None and dest in peers)


def enabled() -> bool:
    return _state.threshold is not None


def carries_any(values: tuple) -> bool:
    """Whether a tensor among ``values`` (a call's arguments, not nested) would take
    shared memory now."""
    threshold = _state.threshold
    return threshold is not None and any(
        isinstance(v, torch.Tensor) and _eligible(v, threshold) for v in values
    )


def _eligible(t: torch.Tensor, threshold: int) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and t.untyped_storage().nbytes() >= threshold
    )


def _pool_prefix(prefix: str, nbytes: int) -> str:
    return f"{prefix}-pool-{nbytes}-"


def _claim(prefix: str, name: str, nbytes: int) -> bool:
    """Rename a pooled segment of exactly ``nbytes`` to ``name``; False if none is free."""
    wanted = _pool_prefix(prefix, nbytes)
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(wanted):
            try:
                os.rename(os.path.join(SHM_DIR, entry), os.path.join(SHM_DIR, name))
                return True
            except FileNotFoundError:  # another sender claimed it first
                continue
    return False


def _recycle(path: str, nbytes: int) -> None:
    """A received tensor was freed (its mapping is gone): pool its segment, or drop it.

    The pool is the segment's cluster's: its name is ``<prefix>-<pid>-<n>-<id>``."""
    prefix = os.path.basename(path).rsplit("-", 3)[0]
    pooled = 0
    pool = f"{prefix}-pool-"
    try:
        for entry in os.listdir(SHM_DIR):
            if entry.startswith(pool):
                pooled += int(entry[len(pool) :].split("-", 1)[0])
        if pooled + nbytes <= POOL_BYTES:
            os.rename(
                path, os.path.join(SHM_DIR, _pool_prefix(prefix, nbytes) + uuid.uuid4().hex[:12])
            )
        else:
            os.unlink(path)
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(path)


def export(storage: torch.UntypedStorage) -> str | tuple[str, int, int]:
    """Copy a storage where the receiver will find it: a slot of this process's arena,
    ``(arena name, record, offset)``; else (no room) a segment, by name."""
    _state.exported += 1
    arena = _arena_here()
    if arena is not None:
        slot = arena.put(storage)
        if slot is not None:
            return (arena.name, *slot)
    return export_segment(storage)


def _arena_here() -> _arena.Arena | None:
    arena = _state.arena
    if arena is None and _state.use_arena:
        try:
            arena = _state.arena = _arena.Arena(_state.prefix)
        except OSError:  # no room for the file: segments only
            _state.use_arena = False
    return arena


def export_segment(storage: torch.UntypedStorage, prefix: str | None = None) -> str:
    """Copy a storage into an owner-only segment (a recycled one if free); return its name
    (``prefix``: the name's, default the cluster's)."""
    nbytes = storage.nbytes()
    prefix = prefix or _state.prefix
    name = f"{prefix}-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(SHM_DIR, name)
    populate = _POPULATE  # a recycled segment's pages exist: map them all at once
    if _claim(prefix, name, nbytes):
        fd = os.open(path, os.O_RDWR)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
        populate = 0  # fresh: the copy faults each page in once (populating zeroes them first)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
    finally:
        os.close(fd)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        _arena.copy(dst.data_ptr(), storage.data_ptr(), nbytes)  # as into a slot
        del dst
    finally:
        mm.close()
    return name


def import_tensor(
    where: str | tuple, nbytes: int, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int
) -> torch.Tensor:
    """Unpickling side: the tensor over an arena slot, or over a segment (mapped once per
    message; when the last tensor on it is freed, the mapping goes, then :func:`_recycle`
    runs: ``mmap`` unmaps before it calls its finalizers)."""
    if isinstance(where, tuple):
        arena_name, record, slot_offset = where
        storage = _arena.attach(arena_name, record, slot_offset, nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    name = where
    with _opened_lock:
        mm = _opened.get(name)
        if mm is None:
            path = os.path.join(SHM_DIR, name)
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
            weakref.finalize(mm, _recycle, path, nbytes).atexit = False  # swept instead
            _opened[name] = mm
    storage = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def make_reducer(torch_reducer: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """The tensor reducer of one pickled message: the fast path, else torch's own."""
    # storage address -> where it went, so storages shared in the message stay shared
    exported: dict[int, str | tuple[str, int, int]] = {}

    def reduce(t: torch.Tensor) -> Any:
        threshold = _state.threshold
        if threshold is None or not _eligible(t, threshold):
            return torch_reducer(t)
        if not _reaches(getattr(_route, "pickling", None)):  # another host, or unknown
            return torch_reducer(t)
        return _shared(t, exported)

    return reduce


def lend(t: torch.Tensor, exported: dict[int, Any]) -> tuple | None:
    """A tensor of a lane's message (:mod:`nbrpc._wire.lanes`) larger than a lane frame
    carries in its bytes: copied into shared memory as a TensorPipe message's would be,
    its reduction returned (storages already in ``exported``, the message's, are not
    copied again). None where the fast path does not take it: off, a cluster across
    hosts (a lane's peer shares this host, but which memory it sees is not tracked
    here), or not a plain dense CPU tensor. What a message that is never sent exported
    goes back with :func:`take_back`."""
    if _state.threshold is None or _state.peers is not None or not _eligible(t, 0):
        return None
    return _shared(t, exported)


def _shared(t: torch.Tensor, exported: dict[int, Any]) -> tuple:
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if key not in exported:
        exported[key] = export(storage)
    return (
        import_tensor,
        (
            exported[key],
            storage.nbytes(),
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
        ),
    )


def take_back(exported: dict[int, Any]) -> None:
    """The storages a message exported (:func:`lend`) that was never sent: their arena
    slots are free again, their segments removed (nobody will map them)."""
    arena = _state.arena
    for where in exported.values():
        if isinstance(where, tuple):
            if arena is not None and where[0] == arena.name:
                arena.release(where[1])
        else:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, where))
    exported.clear()


# -- what tests and the status card read ----------------------------------------------


def exported() -> int:
    """How many storages this process has copied into shared memory so far."""
    return _state.exported


def prefix() -> str:
    """The name prefix of this cluster's files under ``/dev/shm``."""
    return _state.prefix


def arena() -> _arena.Arena | None:
    """This process's arena, once its first large message made it."""
    return _state.arena


def describe(threshold: int | None, fast_path: bool, peers: dict[str, list[str]]) -> str:
    """How CPU tensors travel in this cluster, in a line for its summary."""
    size = f"{(threshold or 0) / 2**20:g} MB"
    shared = sorted({n for names in peers.values() for n in names})
    if peers and shared:
        return (
            f"CPU tensors of {size} and more travel through shared memory between processes "
            f"of one host ({', '.join(shared)}), through TensorPipe between hosts"
        )
    if fast_path:
        return f"CPU tensors of {size} and more travel through shared memory"
    return "CPU tensors travel through TensorPipe only"
