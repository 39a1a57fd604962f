"""A persistent shared-memory arena per sending process: a large tensor costs one copy.

The first fast path (:mod:`.shm`'s segments) mapped a segment per message in the
receiver and unmapped it when the tensor was freed: for 64 MB, 1.7 ms to map, 2 ms to
unmap, plus the page faults of fresh mappings, on top of the copy. An arena is mapped
once per pair of processes and stays mapped, so its pages stay in both page tables:

* The **sender** owns one arena file, ``/dev/shm/<prefix>-arena-<pid>-<id>`` (owner-only,
  :data:`CAPACITY` bytes of address space; tmpfs pages exist only once written). A large
  tensor is copied into a free, page-aligned slot; the message carries the arena's name,
  the slot's record and offset.
* The **receiver** maps the arena on first use and keeps the mapping. The received tensor
  *is* the slot (no second copy): its storage holds a small buffer object over the slot,
  and when the last tensor on it is freed, a finalizer marks the slot's record free in
  the arena's header.
* The header is :data:`RECORDS` bytes, one per slot in use (1) or free (0), written by
  the sender when it fills a slot and by the receiver when it lets go. The sender reuses
  a slot only after its record reads 0, so a live tensor is never overwritten.

Safety as for segments: owner-only files under the cluster's prefix, bounded (one arena
per process, :data:`CAPACITY` each; a message that does not fit takes the segment path),
removed at shutdown and by the watchdog with the cluster's other segments. A receiver that
dies holding slots leaves them marked in use: they are lost to that arena (bounded) until
the cluster ends, never reused under a live tensor. A sender that dies leaves its arena to
the sweep; tensors already received keep their pages (a mapping outlives the file).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import uuid
import weakref
from typing import Any

import torch

from nbrpc import _fork

HEADER = 4096  # bytes before the data: the slot records
RECORDS = 1024  # slots in use at once, at most
ALIGN = 4096  # slots start on page boundaries
CAPACITY = 512 << 20  # data bytes per arena (address space; pages exist once written)
SHM_DIR = "/dev/shm"


class Arena:
    """This process's arena, on the sending side (see the module doc)."""

    def __init__(self, prefix: str, capacity: int = CAPACITY) -> None:
        self.name = f"{prefix}-arena-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.capacity = capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + capacity)
            self._mm = mmap.mmap(fd, HEADER + capacity, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._live: dict[int, tuple[int, int]] = {}  # record -> (offset, size) in use
        self._lock = threading.Lock()

    def put(self, storage: torch.UntypedStorage) -> tuple[int, int] | None:
        """Copy ``storage`` into a free slot; ``(record, offset)``, or None if none fits."""
        nbytes = storage.nbytes()
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for released in [r for r in self._live if self._mm[r] == 0]:
                del self._live[released]
            offset = self._fit(size)
            record = next((r for r in range(RECORDS) if r not in self._live), None)
            if offset is None or record is None:
                return None
            self._live[record] = (offset, size)
            self._mm[record] = 1
        try:
            copy(self._data.data_ptr() + HEADER + offset, storage.data_ptr(), nbytes)
        except BaseException:  # a stop or a cancel: the slot goes back, sent to nobody
            self._mm[record] = 0
            raise
        return record, offset

    def release(self, record: int) -> None:
        """A slot whose message was never sent: free again (no receiver will let it go)."""
        with self._lock:
            self._mm[record] = 0

    def _fit(self, size: int) -> int | None:
        """The lowest offset with ``size`` free bytes (first fit keeps used pages warm)."""
        position = 0
        for offset, used in sorted(self._live.values()):
            if offset - position >= size:
                return position
            position = max(position, offset + used)
        return position if position + size <= self.capacity else None

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def usable(self, prefix: str) -> bool:
        """Still this cluster's (same prefix, file not swept): keep it, pages warm."""
        return self.name.startswith(prefix + "-arena-") and os.path.exists(self.path)

    def close(self) -> None:
        """Remove the file; slots still in use keep their pages (mappings outlive it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def in_use(self) -> int:
        """Slots whose receiver has not let go yet."""
        with self._lock:
            return sum(1 for r in self._live if self._mm[r] != 0)


# -- the copy ---------------------------------------------------------------------------

#: At most this many threads copy one message (this one and helpers): a copy is bound by
#: memory bandwidth, which a few threads already saturate.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Below this size one thread copies alone: waking a helper costs more than it saves.
SPLIT_BYTES = 4 << 20


class _Copier:
    """Copies a message into shared memory (an arena slot, or a segment when the arena is
    full) with this thread and idle helper threads, each a part, with ``memmove`` (ctypes
    releases the GIL around it).

    Not torch's ``copy_``: its OpenMP threads spin for milliseconds after each parallel
    region, and the processes of a cluster share this host's cores. Measured in a 64 MB
    round trip on 2 cores: the worker's copy took 9.5 ms while the kernel's copy threads
    were still spinning, 6.5 ms without them; two memmoves take 5.9 ms against copy_'s
    5.7 ms alone, and leave nothing spinning behind.

    A copy returns, or raises, only once every part is copied. The stop button raises
    ``KeyboardInterrupt`` in the kernel's thread, and a cancel raises in a worker's RPC
    thread, at any bytecode, the wait for the helpers included. A first version counted
    finished parts on a semaphore: a wait the stop ended left its part's count behind, and
    the next copy's wait took it and returned while its own part was still being copied:
    the tensor arrived with a part of the one before it (the soak found a wrong 4 MB result,
    tests/test_cancel.py a wrong 16 MB one). Now each part has a number and the wait reads
    the helper's last finished number, a state that an interrupted wait cannot consume.
    """

    def __init__(self, threads: int) -> None:
        self._busy = threading.Lock()  # one split copy at a time; others copy alone
        self._helpers = [_Helper() for _ in range(threads - 1)]

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes < SPLIT_BYTES or not self._helpers or not self._busy.acquire(blocking=False):
            ctypes.memmove(dst, src, nbytes)
            return
        try:
            part = -(-nbytes // (len(self._helpers) + 1) // ALIGN) * ALIGN
            for helper, start in zip(self._helpers, range(part, nbytes, part), strict=False):
                helper.start(dst + start, src + start, min(part, nbytes - start))
            ctypes.memmove(dst, src, min(part, nbytes))
        finally:
            _wait_for(self._helpers)
            self._busy.release()


def _wait_for(helpers: list[_Helper]) -> None:
    """Until every helper's part is copied, whatever is raised here meanwhile (a stop, a
    cancel): the memory is the caller's again only then. What was raised is raised after."""
    raised: BaseException | None = None
    while True:
        try:
            for helper in helpers:
                helper.join()
            break
        except BaseException as error:  # raised below, once the parts are done
            raised = raised or error
    if raised is not None:
        raise raised


class _Helper:
    """One thread that waits (blocked, no CPU) for a part of a copy.

    Its state is two numbers: the last part given (``_given``, with the part) and the last
    part finished (``_finished``). Both only grow, so waking and waiting are repeatable: a
    wait or a wake-up cut short by an exception is simply done again.

    The wake-ups are two plain locks used as binary semaphores (``_go``: a part may be
    waiting; ``_done``: a part was finished), each taken or given back in one call into C.
    ``threading.Event`` was used first: its ``wait`` and ``set`` take a ``Condition``,
    whose ``__enter__`` is Python, and an exception raised just after its lock was taken
    (the stop button's in the kernel, a cancel's in a worker's RPC thread) left that lock
    held for good. The helper then blocked in ``set`` and the next split copy waited for
    it forever (a fresh clone's run hung 300 s in ``unit/test_arena_copy``). A lock taken
    or given here and an exception after it leave a state the numbers read right."""

    def __init__(self) -> None:
        self._given: tuple[int, int, int, int] = (0, 0, 0, 0)  # (number, dst, src, nbytes)
        self._finished = 0
        self._go = threading.Lock()  # held: nothing to do; given back: a part may be waiting
        self._go.acquire()
        self._done = threading.Lock()  # given back: a part was finished since the last look
        self._done.acquire()
        threading.Thread(target=self._run, name="nbrpc-copy", daemon=True).start()

    def start(self, dst: int, src: int, nbytes: int) -> None:
        self._given = (self._given[0] + 1, dst, src, nbytes)  # one assignment: whole or not
        _give(self._go)

    def join(self) -> None:
        number = self._given[0]
        if self._finished < number:
            _give(self._go)  # again: a start cut short between its two steps
        while self._finished < number:
            self._done.acquire(timeout=0.05)

    def _run(self) -> None:
        while True:
            self._go.acquire()
            number, dst, src, nbytes = self._given
            if number > self._finished:
                ctypes.memmove(dst, src, nbytes)
                self._finished = number
                _give(self._done)


def _give(lock: threading.Lock) -> None:
    """Give ``lock`` back if it is held (a binary semaphore: given twice is given once)."""
    with contextlib.suppress(RuntimeError):  # not held: already given
        lock.release()


class _Copiers:
    """This process's copier, made on first use; a forked child makes its own (helper
    threads do not survive a fork)."""

    def __init__(self) -> None:
        self.copier: _Copier | None = None
        self.lock = threading.Lock()

    def forget(self) -> None:
        self.copier = None


_copiers = _Copiers()
_fork.in_child(_copiers.forget)


def copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` ``nbytes`` from address ``src`` to ``dst``, split over threads."""
    copier = _copiers.copier
    if copier is None:
        with _copiers.lock:
            if _copiers.copier is None:
                _copiers.copier = _Copier(COPY_THREADS)
            copier = _copiers.copier
    copier.copy(dst, src, nbytes)


# -- receiving side -------------------------------------------------------------------------

_mapped: dict[str, mmap.mmap] = {}  # arena name -> this process's mapping of it
_holders: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def _release(mm: mmap.mmap, record: int) -> None:
    with contextlib.suppress(ValueError, IndexError):  # the mapping is already closed
        mm[record] = 0


def attach(name: str, record: int, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The storage of a slot in another process's arena (mapped here once, kept)."""
    key = (name, record, offset)
    with _lock:
        holder = _holders.get(key)  # one message naming the same slot twice: one storage
        if holder is None:
            mm = _mapped.get(name)
            if mm is None:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
                finally:
                    os.close(fd)
                _mapped[name] = mm
            holder = (ctypes.c_ubyte * nbytes).from_buffer(mm, HEADER + offset)
            weakref.finalize(holder, _release, mm, record).atexit = False
            _holders[key] = holder
    return torch.frombuffer(holder, dtype=torch.uint8).untyped_storage()


def forget_mappings() -> None:
    """Arenas whose file is gone (their cluster ended, or their sender reconfigured) are
    no longer kept mapped here; each mapping goes once no received tensor uses it."""
    with _lock:
        for name in [n for n in _mapped if not os.path.exists(os.path.join(SHM_DIR, n))]:
            del _mapped[name]
