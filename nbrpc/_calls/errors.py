"""A call's errors: torch's failures (and a route's: a lost lane) as nbrpc's errors, which
name the call, its worker and the fix.

:func:`translate` is the one translation; the call facade (:mod:`.facade`) applies it once
to what a route (:mod:`.routes`) reports as its own failure, for ``rpc_sync`` and
``rpc_async`` alike, and :mod:`.rrefs` to what torch's RRef methods raise. A worker's own
exception is never translated: it arrives as it was raised there. :class:`Sent` is what a
call keeps to say its errors (and its deadline, to say its timeout). Apart from the facade
so that the routes and the RRef methods say the same words without importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.rpc as rpc

from nbrpc import _states, _torch
from nbrpc._errors import (
    CallCancelledError,
    ClusterClosedError,
    ConnectionLost,
    RpcTimeoutError,
    SerializationError,
    WorkerDiedError,
)


@dataclass
class Known:
    """What the errors say beyond torch's words, set by the facade from the cluster layer:
    ``cancelled`` from the moment a non-graceful shutdown starts, so calls it cuts off say
    so instead of "worker died"; ``last_output``: what a dead worker printed last, by
    name, for its WorkerDiedError; ``leaving``: workers nbrpc makes leave at a scale ->
    why (a call they cut off says so)."""

    cancelled: bool = False
    last_output: Callable[[str], str] | None = None
    leaving: dict[str, str] = field(default_factory=dict)


known = Known()


def name_of(func: Any) -> str:
    """A called function's name, as errors say it."""
    return getattr(func, "__qualname__", None) or type(func).__name__


class Sent:
    """A call on its way: the limit in seconds nbrpc keeps, and the errors that name the
    call and its worker. Not its future, nor its arguments: a deadline holds ``expired``
    for the length of the timeout, and must not keep a finished call's result alive.
    ``sync``: started as torch's ``rpc_sync`` (its profiler's event says so)."""

    __slots__ = ("dest", "func", "limit", "sync", "timeout")

    def __init__(
        self, dest: str, func: Any, limit: float, timeout: float | None, sync: bool = False
    ) -> None:
        self.dest = dest
        self.func = func
        self.limit = limit
        self.timeout = timeout
        self.sync = sync

    @property
    def what(self) -> str:
        """The call, as its errors name it (made only for an error)."""
        return f"call of {name_of(self.func)}"

    def translate(self, exc: BaseException) -> Any:
        """``exc`` (torch's, or a route's) as this call's error (:func:`translate`)."""
        return translate(exc, self.what, self.dest, self.timeout)

    def expired(self) -> RpcTimeoutError:
        """The call's error when its time ran out."""
        return timeout_error(None, self.what, self.dest, self.timeout)


def timeout_error(
    exc: BaseException | None, what: str, dest: str, timeout: float | None
) -> RpcTimeoutError:
    """The timeout of ``what`` on ``dest``, in nbrpc's words and torch's (``exc``: what
    torch said, if it said it)."""
    seconds = rpc.get_rpc_timeout() if timeout is None else timeout
    limit = f"{seconds:g} s" + (" (default)" if timeout is None else "")
    return RpcTimeoutError(  # torch's own words too, which code written for torch matches
        f"{what} on {dest} timed out after {limit} (RPC ran for more than the set timeout, "
        f"{seconds * 1000:.0f} ms); it may still be running there. Pass "
        "timeout=SECONDS (0 waits forever) or start the cluster with a larger --timeout."
        + (f" torch said: {exc}" if exc is not None else "")
    )


def translate(exc: BaseException, what: str, dest: str, timeout: float | None) -> Any:
    """torch's error for ``what`` (``"call of f"``) on worker ``dest``, as the nbrpc error
    that names the problem and the fix; other errors are returned as they are. A lost
    connection is torch's (its words) or a route's own
    (:class:`~nbrpc._errors.ConnectionLost`: a lane's)."""
    if _torch.is_timeout(exc):
        return timeout_error(exc, what, dest, timeout)
    here = _torch.missing_module_here(exc)
    if here:
        return SerializationError(
            f"this process cannot import module {here!r}, which the reply to the {what} "
            f"on {dest} needs: {dest} returned an object of a class from that module, and a "
            f"class from an importable module travels by reference. Install {here} here "
            "too, or return plain values (numbers, lists, dicts, tensors) from the function."
        )
    missing = _torch.missing_module(exc)
    if missing:
        return SerializationError(
            f"{dest} cannot import module {missing!r}, which the {what} needs: code from "
            f"an importable module travels by reference. Install {missing} on the workers, "
            "or send it by value with "
            f"nbrpc.register_by_value({missing.split('.')[0]}) before the call."
        )
    undefined = _torch.undefined_script_function(exc)
    if undefined and not any("%%rpc" in note for note in getattr(exc, "__notes__", ())):
        exc.add_note(  # torch's error as it is (its type and words), and nbrpc's fix
            f"nbrpc: {dest} does not know the TorchScript function {undefined}. A function "
            "compiled with @torch.jit.script in this kernel is compiled here only: run its "
            "cell on the workers too (%%rpc as the cell's first line, the imports it needs "
            "in it), then call it."
        )
        return exc
    unsent = _torch.serialization_failure(exc)
    if unsent:
        return SerializationError(f"{unsent} (the {what} on {dest})")
    if _torch.is_connection_loss(exc) or isinstance(exc, ConnectionLost):
        if known.cancelled:
            return ClusterClosedError(
                f"{what} on {dest} was cancelled: the cluster was "
                "shut down with graceful=False while it ran. Use a graceful shutdown "
                "(the default) to let calls in flight finish."
            )
        if dest in known.leaving:  # a forced scale's leaver, whose call could not stop
            return CallCancelledError(dest, what, True, known.leaving[dest])
        detail = f"its connection closed; torch said: {str(exc).splitlines()[0]}"
        _states.mark_dead(dest, detail)  # the owner of its state: calls to it now fail at once
        return WorkerDiedError(dest, detail, last_output(dest))
    return exc


def last_output(dest: str) -> str:
    """What worker ``dest`` printed last, for its WorkerDiedError ("" if nothing is known)."""
    said = known.last_output
    try:
        return said(dest) if said is not None else ""
    except Exception:  # an error message must not fail while it is being written
        return ""
