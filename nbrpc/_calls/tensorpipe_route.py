"""TensorPipe's route: torch's own send, for every call no other route takes (the last
route asked: it takes every call) and for every ``remote()`` (torch makes the RRef).

What the call keeps of torch's: its profiler's event (``rpc_sync`` or ``rpc_async``), its
device maps and CUDA-aware futures, its pickling with nbrpc's pickler inside, large CPU
tensors through the sender's arena where the cluster shares memory (``shm.sending_to``:
which tensors, the table in :mod:`.routes`), builtins as TorchScript operators where a
schema takes them (:func:`python_call`). Torch's timeout is none: nbrpc's clock keeps it
(:mod:`nbrpc._debugger.deadlines`). The lanes' route sends here what a lane hands over
(:func:`waited`, :func:`started`).
"""

from __future__ import annotations

from types import FunctionType, MethodType
from typing import Any

import torch
from torch.distributed.rpc import RRef, WorkerInfo

from nbrpc import _ledger, _torch, _trace
from nbrpc._debugger import prompts
from nbrpc._wire import callee, failures, pickling, recording, shm

from . import scripts
from .errors import Sent
from .routes import Done, Outcome, Route


class TensorPipeRoute(Route):
    """torch's send (the module's docstring)."""

    name = "tensorpipe"

    def take(
        self, dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, main: bool
    ) -> Any:
        return True  # every call: it needs nothing more than the call

    def wait(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent) -> Outcome:
        return waited(dest, sent, call)

    def start(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent, done: Done) -> None:
        started(dest, sent, done, sync=call.sync)

    def in_flight(self) -> int:
        metrics = _torch.agent().get_metrics()
        return int(metrics.get("agent.client_active_calls", 0))


def waited(dest: WorkerInfo, sent: tuple, call: Sent) -> Outcome:
    """Send ``sent`` as torch's ``rpc_sync`` and wait for its outcome on the main thread
    (:meth:`Route.wait`)."""
    raw = send(dest, sent, sync=True)
    if not prompts.wait_on_main_thread(raw, call.limit):
        return None, call.expired(), None
    return outcome(raw)


def started(dest: WorkerInfo, sent: tuple, done: Done, sync: bool = False) -> None:
    """Send ``sent`` (``sync``: as torch's ``rpc_sync``); ``done`` gets its outcome."""
    raw = send(dest, sent, sync=sync)
    _torch.on_done(raw, lambda finished: _settle(finished, done))


def send(dest: WorkerInfo, sent: tuple, sync: bool = False) -> torch.futures.Future:
    """Start the call with torch: its raw future (torch's errors); ``sync``: as torch's
    ``rpc_sync`` starts it (its profiler's event says so)."""
    func, args, kwargs = _prepared(dest, *sent)
    sender = _torch.rpc_sync_started if sync else _torch.rpc_async
    # torch's timeout: none (nbrpc's clock keeps it); the stop button waits for torch's
    # send itself (cancelling.sends_held: an RRef pickled into it is a fork torch counts)
    with shm.sending_to(dest.name):
        return sender(dest, func, args, kwargs, 0)


def remote(dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, limit: float) -> Outcome:
    """``remote()`` of ``func`` on ``dest``: ``(the RRef, None, None)``, or the failure
    torch raised as it sent it (a lost connection); ``limit``: torch's timeout on the
    creation (0: none)."""
    sent, args, kwargs = _prepared(dest, func, args, kwargs)
    try:
        with shm.sending_to(dest.name, "remote"):  # (the stop waits for the send, as above)
            rref: RRef = _torch.remote(dest, sent, args=args, kwargs=kwargs, timeout=limit)
    except Exception as exc:
        return None, None, exc
    if sent is not func:  # a builtin sent as a Python call: the ownership view names it
        _ledger.label(rref, dest, func)
    return rref, None, None


def _prepared(dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """The call as torch sends it (:func:`python_call`), noted for the hang check's shape
    and a notebook's TorchScript function compiled on ``dest`` first."""
    _trace.note_call(dest.id, func, args, kwargs)  # what the hang check's shape remembers
    prepared = python_call(func, tuple(args), kwargs)
    scripts.ensure_on(dest.name, func)  # a notebook's TorchScript function: compiled there
    return prepared


def outcome(raw: torch.futures.Future) -> Outcome:
    """The outcome of torch's finished future ``raw``: its value, the callee's exception
    as it was raised there, or torch's own error as the route's failure."""
    try:
        return raw.wait(), None, None
    except BaseException as exc:
        callees = failures.received(exc, _not_the_callees)
        return (None, None, exc) if callees is None else (None, callees, None)


def _not_the_callees(exc: BaseException) -> None:
    """(For :func:`failures.received`: torch's own error, not the callee's.)"""
    return None


def _settle(raw: torch.futures.Future, done: Done) -> None:
    """``done`` with the outcome of torch's finished future ``raw``. With CUDA devices,
    ``raw`` is CUDA-aware: this callback runs on streams that wait for the reply's
    copies, and the future ``done`` completes is CUDA-aware too
    (:func:`nbrpc._calls.facade.new_future`): it records its event on these streams, so
    a waiter's stream waits for the copies, and nothing here blocks on them."""
    done(outcome(raw))


def python_call(func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """What works locally works remotely: a builtin goes as torch sends it where it can,
    else as the Python call it is.

    torch sends builtins (``torch.add``, ``torch.ones``, Python's ``dict``) as TorchScript
    operators matched against a schema on the callee, and ``remote()`` of one makes a typed
    ``RRef[Tensor]`` that TorchScript code takes. Where no schema takes the arguments
    (``torch.ones(3)``, ``dict(k=1)``: "failed to match any schema", although they work
    locally), nbrpc sends a Python call instead, checked here first; and so it does where a
    large tensor would take the shared-memory fast path, or while a timeline records (the
    Python call is what names the row). A CUDA argument the kernel refuses
    (:func:`nbrpc._wire.pickling.refuse_devices`) is refused here for what does not go
    through nbrpc's pickler: builtins sent as TorchScript operators, TorchScript functions.
    """
    if isinstance(func, FunctionType | MethodType):
        return func, args, kwargs  # nbrpc's pickler sees all it sends
    arguments = (*args, *(kwargs or {}).values())
    pickling.refuse_here(arguments)  # a builtin's or TorchScript's arguments: not pickled
    if not _torch.is_builtin(func):
        return func, args, kwargs
    native = (
        recording.active() is None
        and not shm.carries_any(arguments)
        and _torch.builtin_accepts(func, args, kwargs)
    )
    if native:
        return func, args, kwargs
    return callee.as_python_call(func, args, kwargs)
