"""The shapes of the plain data nbrpc returns: status rows, ownership rows, a trace, call
rows, stack rows; and a worker's states.

The rows are ``TypedDict``s: at run time ordinary dicts (they travel by RPC, print,
compare and serialise as such), for a type checker and an editor named, documented keys.
A cluster's own record of each process (:class:`WorkerRecord`) is a small dataclass, its
state a :class:`WorkerState`, which changes only in :mod:`nbrpc._states` (the one owner
of every worker's state, with the table of its moves).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict


class CudaMemory(TypedDict):
    """One CUDA device of a process (``StatusRow["cuda"]``)."""

    device: str  # "cuda:0"
    allocated: int  # bytes held by tensors (torch's caching allocator)
    reserved: int  # bytes the allocator holds from the device
    utilization: int | None  # % over NVML's last sample; None without NVML


class StatusRow(TypedDict):
    """One process of the cluster (``nbrpc.status()``)."""

    name: str
    rank: int  # nbrpc.rank(): 0 for the kernel, 1..N for the workers, kept for life
    #: torch's id (get_worker_info().id): the rank only in a kernel's first cluster, and
    #: new after a restart
    torch_id: int
    pid: int
    host: str
    role: str  # "kernel" or "engine N"
    devices: list[str]
    engine_id: int | None
    state: WorkerState  # a str: "ready", "dead", "restarting", "stopped"
    calls_in_flight: int | None  # None: not ready, or did not answer in time
    calls_done: int | None
    rrefs_owned: int | None
    rrefs_held: int | None
    #: % of one core since the previous status (or the join); None: no answer
    cpu_percent: float | None
    memory_rss: int | None  # resident memory, bytes
    cuda: list[CudaMemory] | None  # the devices the process uses (none: CPU only)
    device_maps: dict[str, dict[str, str]]


class OwnershipRow(TypedDict):
    """One live RRef (``nbrpc.ownership()``)."""

    id: str  # torch's "created_on:local_id"
    owner: str
    holders: list[str]  # processes holding a user reference (not the owner)
    owner_holds: bool  # whether the owner itself holds a Python handle
    type: str | None  # the value's type name, when known
    created_by: str | None  # e.g. "remote(worker1, ParameterServer)"
    creator: str | None  # the process whose code made it
    handles: int  # Python handles in all processes


class TraceWorker(TypedDict):
    name: str
    id: int
    host: str
    timing: dict[str, float] | None  # with backward(..., timed=True)


class TraceNode(TypedDict):
    id: str  # "worker1/3"
    worker: str
    name: str  # the autograd function, e.g. "TanhBackward0"
    kind: Literal["root", "function", "accumulate", "send", "recv"]
    message_id: int | None  # send/recv: the autograd message joining the two sides
    is_root: bool
    start_s: NotRequired[float]  # timed backward only
    duration_s: NotRequired[float]


class TraceEdge(TypedDict):
    src: str
    dst: str
    kind: Literal["local", "rpc"]
    message_id: NotRequired[int]  # rpc hops


class Trace(TypedDict):
    """A backward pass across the workers (``nbrpc.trace_backward(ctx)``)."""

    context_id: int
    workers: list[TraceWorker]
    nodes: list[TraceNode]
    edges: list[TraceEdge]


class CallRow(TypedDict):
    """One call recorded by ``nbrpc.record()`` (``rec.calls``). Times are seconds since the
    recording started, on the kernel's clock (each process's offset taken out)."""

    id: int  # unique in the cluster: the caller's torch id << 40 | its count
    parent: int | None  # the call this one was made inside (on the caller's thread)
    caller: str
    callee: str
    function: str  # a notebook function by its name; RRef proxy calls as "Type.method"
    sent_s: float  # when the caller pickled it
    start_s: float  # when the callee began running it
    end_s: float  # when it returned (or raised) there
    bytes_in: int | None  # the request: pickle and tensors (None: the caller's part lost)
    bytes_out: int  # the reply (0: none sent, as for remote())
    path_in: str | None  # its tensors' path: "tensorpipe", "arena", "segment", "cuda"
    path_out: str  # ("" without tensors; "arena+tensorpipe" when they took two)
    route: str  # the call's own way: "lane" (nbrpc._wire.lanes) or "tensorpipe"
    ok: bool
    error: str | None  # the exception's type name
    thread: int  # the callee's thread that ran it


class StackFrame(TypedDict):
    file: str
    line: int
    function: str


class ThreadStack(TypedDict):
    """One thread of a process (``nbrpc.stacks()``)."""

    thread: int  # Python's thread id (threading.get_ident())
    name: str | None  # its Python name, when it could be read
    current: bool  # the thread that wrote the dump (a signal handler's, not the program's)
    frames: list[StackFrame]  # innermost last, as a traceback prints
    serving: str | None  # the call this thread runs: "train_step from kernel (call 3)"


class StackRow(TypedDict):
    """The Python stacks of one process (``nbrpc.stacks()``)."""

    name: str
    pid: int
    host: str
    how: str  # "thread" (its stack thread), "signal" (faulthandler), "rpc", "this process"
    threads: list[ThreadStack]
    error: str | None  # why no stacks came (then ``threads`` is empty)


class WorkerState(enum.StrEnum):
    """Where one process of the cluster stands (a ``str``: rows print and compare as text)."""

    READY = "ready"
    DEAD = "dead"  # its process is gone; %rpc_restart replaces it
    RESTARTING = "restarting"  # a fresh process is being made for its name
    STOPPED = "stopped"  # it left at a shutdown
    LEFT = "left"  # it left at a scale (%rpc_scale): the cluster goes on without it

    def __repr__(self) -> str:
        return repr(self.value)  # a list of states prints as it did when they were strings


@dataclass
class WorkerRecord:
    """One process of the group, as the notebook shows it (``cluster.records``). Its
    ``state`` changes only in :mod:`nbrpc._states`, its owner, along the owner's table of
    a worker's transitions.

    ``name`` and ``rank`` (torch's id) in the RPC group, ``pid`` and ``host`` of its
    process, ``role`` (``"kernel"`` or ``"engine N"``), its ``devices``, its ipyparallel
    ``engine_id`` (None for the kernel), ``local`` (on the kernel's host: its pid is this
    host's) and ``order``: its ``nbrpc.rank()``, 0 for the kernel and 1..N for the
    workers as a script numbers them, kept for the worker's life.
    """

    name: str
    rank: int
    pid: int
    host: str
    role: str  # "kernel" or "engine N"
    devices: list[str] = field(default_factory=list)
    engine_id: int | None = None
    state: WorkerState = WorkerState.READY
    local: bool = True  # on the kernel's host: its pid is this host's
    #: ``nbrpc.rank()``: 0 for the kernel, 1..N for the workers as a script numbers them;
    #: kept for the worker's life (a restart and a scale keep it; a grow fills the lowest
    #: free one)
    order: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict, a key per field. Raises nothing."""
        return dict(self.__dict__)
