"""torch's spelling of the calls, routed to nbrpc's: ``torch.distributed.rpc.rpc_sync``,
``rpc_async``, ``remote`` and ``torch.futures.wait_all`` as a notebook writes them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from nbrpc import _torch
from nbrpc._debugger import prompts

from . import facade, routes


def _in_torchs_spelling(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (:func:`rpc_sync`, :func:`rpc_async` or :func:`remote`) with torch's
    signature and defaults: ``args=None``, ``timeout=UNSET_RPC_TIMEOUT``."""

    def routed(
        to: Any,
        func: Callable[..., Any],
        args: tuple | None = None,
        kwargs: dict | None = None,
        timeout: float = _torch.UNSET_RPC_TIMEOUT,
    ) -> Any:
        return call(to, func, tuple(args or ()), kwargs, facade.given(timeout))

    routed.__name__ = routed.__qualname__ = call.__name__
    routed.__doc__ = f"``torch.distributed.rpc.{call.__name__}``, routed to nbrpc's."
    return routed


def wait_all(futures: list) -> list:
    """``torch.futures.wait_all``, routed: every future's value, or the first error as soon
    as one fails (torch's documented behaviour; its ``collect_all`` waits for them all).
    On the main thread the wait can be interrupted (the stop button) and serves a worker's
    debugger, as :class:`Future` waits do."""
    if not futures:
        return []
    settled: torch.futures.Future[None] = torch.futures.Future()
    state: dict[str, Any] = {"left": len(futures), "failed": None}
    lock = threading.Lock()

    def one_settled(fut: Any) -> None:
        try:
            fut.value()
            failed = False
        except BaseException:
            failed = True
        with lock:
            if settled.done():
                return
            state["left"] -= 1
            if failed:
                state["failed"] = fut
            if failed or state["left"] == 0:
                settled.set_result(None)

    for fut in futures:
        _torch.on_done(fut, one_settled)
    if threading.current_thread() is threading.main_thread():
        prompts.wait_on_main_thread(settled)
    else:
        if not settled.done():  # e.g. a future's callback on a lane's reader: replies come there
            routes.before_wait()
        settled.wait()
    if state["failed"] is not None:
        state["failed"].wait()  # raises its error, as the future itself would
    return [fut.wait() for fut in futures]


def route_torch_calls() -> None:
    """Make the calls a notebook writes in torch's spelling nbrpc's (idempotent).

    Published tutorials and seed code call ``torch.distributed.rpc.rpc_sync``,
    ``rpc_async``, ``remote`` and ``torch.futures.wait_all``. Routed here (in the kernel at
    ``%load_ext nbrpc``, and in a script's process at ``nbrpc.init``) they behave as
    ``nbrpc.rpc_sync`` & co.: a clear error before ``%rpc_init`` and for an unknown worker,
    builtins that give the local result, a worker's exception with its own type, and waits
    the stop button interrupts. nbrpc's own modules send with torch's functions
    (``_torch.rpc_sync`` & co.), which this leaves alone.
    """
    _torch.route_user_calls(torchs_spelling(), wait_all)


def torchs_spelling() -> dict[str, Callable[..., Any]]:
    """nbrpc's ``rpc_sync``, ``rpc_async`` and ``remote`` with torch's signatures, made once."""
    if not _spelled:
        _spelled.update(
            {
                f.__name__: _in_torchs_spelling(f)
                for f in (facade.rpc_sync, facade.rpc_async, facade.remote)
            }
        )
    return _spelled


_spelled: dict[str, Callable[..., Any]] = {}
