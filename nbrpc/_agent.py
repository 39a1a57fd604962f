"""The notebook-facing facade over ``torch.distributed.rpc`` calls.

Each function is torch's own (same arguments, same return types: a ``torch.futures.Future``,
a torch ``RRef``) with what a notebook needs in front: a clear error before init, an
unknown worker named together with the known ones, ``timeout=None`` for "the cluster's
default", and timeouts raised as :class:`~nbrpc.RpcTimeoutError` naming the call and the
worker. Notebook-defined code travels because :mod:`nbrpc._pickling` is installed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from torch.distributed.rpc import RRef, WorkerInfo
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
from torch.jit._builtins import _find_builtin

from . import _group, _ledger, _remote, _shm
from ._errors import (
    ClusterClosedError,
    NotInitializedError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
    WorkerDiedError,
)

__all__ = [
    "get_worker_info",
    "ownership",
    "remote",
    "rpc_async",
    "rpc_sync",
    "snapshots",
    "workers",
]

T = TypeVar("T")

# Set by the cluster layer: "active" while a cluster is up; "cancelled" from the moment a
# non-graceful shutdown starts, so calls it cuts off say so instead of "worker died".
_session = {"active": False, "cancelled": False}


class Future(torch.futures.Future):
    """torch's Future, whose ``wait()`` the notebook's stop button can interrupt.

    torch's own ``wait()`` blocks in C++, where Python cannot deliver SIGINT: a
    KeyboardInterrupt would only arrive when the remote call ends. On the main thread
    this waits on a ``threading.Event`` instead, which Python interrupts at once. The
    remote call itself goes on; its result is dropped.
    """

    def wait(self) -> Any:
        if not self.done() and threading.current_thread() is threading.main_thread():
            finished = threading.Event()
            self.add_done_callback(lambda _: finished.set())
            finished.wait()
        return super().wait()


def set_active(active: bool) -> None:
    _session["active"] = active
    if active:
        _session["cancelled"] = False


def cancel_calls_in_flight() -> None:
    """A non-graceful shutdown begins: calls it cuts off fail as cancelled."""
    _session["cancelled"] = True


def calls_in_flight() -> int:
    """Calls this process started that have not finished (torch's own count)."""
    metrics = rpc_api._get_current_rpc_agent().get_metrics()
    return int(metrics.get("agent.client_active_calls", 0))


def _require(what: str) -> None:
    if not _session["active"]:
        raise NotInitializedError(what)


def workers() -> list[str]:
    """Names of the live processes in the group, the kernel first."""
    _require("nbrpc.workers()")
    return _group.member_names()


def _destination(to: str | WorkerInfo | int, what: str) -> WorkerInfo:
    _require(what)
    if isinstance(to, WorkerInfo):
        return to
    if isinstance(to, str):
        try:  # one lookup in the agent's table; the full list only for the error
            return rpc_api._get_current_rpc_agent().get_worker_info(to)
        except RuntimeError:
            pass
    raise UnknownWorkerError(to, _group.member_names())


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """torch's ``WorkerInfo`` (name and id) of a worker, or of this process."""
    if worker_name is None:
        _require("nbrpc.get_worker_info()")
        return rpc.get_worker_info()
    return _destination(worker_name, "nbrpc.get_worker_info()")


def _timeout(timeout: float | None) -> float:
    return UNSET_RPC_TIMEOUT if timeout is None else float(timeout)


def _name_of(func: Any) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("timeout" in text.lower() or "timed out" in text)


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def _missing_module(exc: BaseException) -> str | None:
    """The module a worker failed to import while unpickling a call (torch's wording)."""
    if not isinstance(exc, RuntimeError) or "deserialize" not in str(exc):
        return None
    match = _NO_MODULE.search(str(exc))
    return match.group(1) if match else None


def _timeout_error(
    exc: BaseException, func: Any, to: Any, timeout: float | None
) -> RpcTimeoutError:
    limit = f"{timeout:g} s" if timeout is not None else f"{rpc.get_rpc_timeout():g} s (default)"
    dest = to.name if isinstance(to, WorkerInfo) else to
    return RpcTimeoutError(
        f"call of {_name_of(func)} on {dest} timed out after {limit}; it may still be running "
        f"there. Pass timeout=SECONDS (0 waits forever) or start the cluster with a larger "
        f"--timeout. torch said: {exc}"
    )


def rpc_sync(
    to: str | WorkerInfo,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    An exception raised there is raised here with its own type (see ``nbrpc._remote``).
    """
    return _start("rpc_sync", to, func, args, kwargs, timeout).wait()


def rpc_async(
    to: str | WorkerInfo,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> torch.futures.Future[T]:
    """Start ``func(*args, **kwargs)`` on worker ``to``; return a ``torch.futures.Future``."""
    return _start("rpc_async", to, func, args, kwargs, timeout)


def _start(
    what: str, to: Any, func: Any, args: tuple, kwargs: dict | None, timeout: float | None
) -> torch.futures.Future:
    dest = _destination(to, what)
    sent, args, kwargs = _fast_builtin(func, tuple(args), kwargs)
    raw = rpc.rpc_async(dest, sent, args=args, kwargs=kwargs, timeout=_timeout(timeout))
    out = Future()

    def translate(exc: BaseException) -> BaseException:
        if _is_timeout(exc):
            return _timeout_error(exc, func, dest, timeout)
        missing = _missing_module(exc)
        if missing:
            return SerializationError(
                f"{dest.name} cannot import module {missing!r}, which the call of "
                f"{_name_of(func)} needs: code from an importable module travels by "
                f"reference. Install {missing} on the workers, or send it by value with "
                f"nbrpc.register_by_value({missing.split('.')[0]}) before the call."
            )
        if _remote.is_connection_loss(exc):
            if _session["cancelled"]:
                return ClusterClosedError(
                    f"call of {_name_of(func)} on {dest.name} was cancelled: the cluster was "
                    "shut down with graceful=False while it ran. Use a graceful shutdown "
                    "(the default) to let calls in flight finish."
                )
            return WorkerDiedError(dest.name, str(exc).splitlines()[0])
        return exc

    raw.add_done_callback(lambda done: _remote.settle(done, out, translate))
    return out


def _fast_builtin(func: Any, args: tuple, kwargs: dict | None) -> tuple:
    """torch sends builtin operators (``torch.add``) through TorchScript's pickler, around
    nbrpc's: wrap one in a Python call when a large tensor could take the fast path."""
    if not _shm.enabled() or _find_builtin(func) is None:
        return func, args, kwargs
    values = [*args, *(kwargs or {}).values()]
    if not any(isinstance(v, torch.Tensor) and _shm.eligible(v) for v in values):
        return func, args, kwargs
    return _remote.call_builtin, (func, args, kwargs), None


def remote(
    to: str | WorkerInfo,
    func: Callable[..., T],
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> RRef[T]:
    """Run ``func`` on ``to`` and keep the result there; return an ``RRef`` to it."""
    dest = _destination(to, "remote")
    return rpc.remote(dest, func, args=tuple(args), kwargs=kwargs, timeout=_timeout(timeout))


SNAPSHOT_TIMEOUT_S = 5.0


def snapshots(
    timeout: float = SNAPSHOT_TIMEOUT_S, skip: set[str] | frozenset = frozenset()
) -> dict:
    """Every live process's ledger snapshot (see :mod:`nbrpc._ledger`), by process name.

    Asked of all processes at once. A process that does not answer within ``timeout``
    (or is in ``skip``, e.g. known dead) is left out: its RRefs are unknown, not absent.
    """
    _require("nbrpc.ownership()")
    me = rpc.get_worker_info().name
    asked = {
        name: _start("ownership", name, _ledger.snapshot, (), None, timeout)
        for name in _group.member_names()
        if name != me and name not in skip
    }
    found = {me: _ledger.snapshot()}
    for name, fut in asked.items():
        try:
            found[name] = fut.wait()
        except (RpcTimeoutError, WorkerDiedError, RuntimeError):
            continue
    return found


def ownership(timeout: float = SNAPSHOT_TIMEOUT_S) -> list[dict[str, Any]]:
    """One dict per live RRef in the cluster, whoever made it.

    Keys: ``id`` (torch's RRef id, ``"creator_rank:n"``), ``owner``, ``holders`` (processes
    holding a user reference), ``owner_holds``, ``type`` (of the value), ``created_by``
    (e.g. ``"remote(worker1, ParameterServer)"``) and ``handles`` (Python handles in all).
    An RRef dropped everywhere and garbage-collected is gone from the list.
    """
    return _ledger.merge(list(snapshots(timeout).values()))
