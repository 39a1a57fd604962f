"""torch's ``RRef`` methods with nbrpc's errors and calls (installed in every process).

``to_here`` waits as a notebook's wait does (interruptible, serving a worker's debugger, on
nbrpc's clock) and gives nbrpc's errors; ``owner`` names a restart that replaced the owner;
``_get_type``, which torch's proxies ask first, keeps the owner's exception type; the
proxies (``rref.rpc_sync().f()``, ``rpc_async()``, ``remote()``) call through
:mod:`.facade`, so a method's exception keeps its type as a call's does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.distributed.rpc import WorkerInfo

from nbrpc import _ledger, _torch
from nbrpc._debugger import prompts
from nbrpc._errors import WorkerDiedError, shown_short
from nbrpc._wire import failures

from . import errors, facade, spelling


def _owner(rref: Any) -> WorkerInfo:
    """``RRef.owner`` (and so every proxy call, ``rref.rpc_sync().f()``): an owner that a
    restart replaced is a WorkerDiedError naming the restart (installed by :func:`install`)."""
    try:
        return _torch.original_owner(rref)
    except RuntimeError:
        replaced = facade.gone_error(_ledger.owner_rank(rref))
        if replaced is not None:
            raise replaced from None
        raise


def _to_here(rref: Any, timeout: float = _torch.UNSET_RPC_TIMEOUT) -> Any:
    """``RRef.to_here`` with :func:`rpc_sync`'s errors (installed by :func:`install`).

    The worker's own exception (the call behind the RRef failed) arrives as it is; torch's
    errors (a timeout, the owner's death) become nbrpc's. On the main thread it first waits
    for the value's creation as :class:`facade.Future` waits: interruptible, serving a worker's
    debugger, on nbrpc's clock.
    """
    try:
        if threading.current_thread() is threading.main_thread() and not rref.is_owner():
            _await_creation(rref, timeout)
        return _torch.original_to_here(rref, timeout)
    except Exception as exc:
        if failures.is_rebuilt(exc):
            raise failures.delivered(exc)  # noqa: B904 (the worker's own, as raised there)
        owner = _torch.owner_name(rref)
        if owner is None:
            replaced = facade.gone_error(_ledger.owner_rank(rref))
            if replaced is not None:
                raise replaced from None
            # it left the group (died, or belonged to a cluster since shut down)
            raise WorkerDiedError("the worker that owned this RRef", f"torch said: {exc}") from None
        limit = None if timeout == _torch.UNSET_RPC_TIMEOUT else timeout
        error = errors.translate(exc, "to_here() of an RRef", owner, limit)
        if error is exc:
            raise
        raise error from None


def _await_creation(rref: Any, timeout: float) -> None:
    created = _torch.rref_creation_future(rref)
    if created is None or created.done():
        return
    limit = facade.given(timeout)
    if not prompts.wait_on_main_thread(created, facade.limit_of(limit)):
        raise errors.timeout_error(None, "to_here() of an RRef", rref.owner().name, limit)


def _get_type(rref: Any, timeout: float = _torch.UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
    """``RRef._get_type``, which torch's RRef proxies ask before every call, with
    :func:`rpc_sync`'s errors: where the value's creation failed (its constructor raised),
    the owner's exception as it was raised there, not torch's RuntimeError carrying its
    text; a timeout or a lost owner as nbrpc's. With ``blocking=False`` a :class:`facade.Future`,
    the same one for each call that torch answers with its one cached future."""
    owner = _torch.owner_name(rref) or "the owner"
    what = "the type query of an RRef"
    try:
        got = _torch.original_get_type(rref, timeout, blocking)
    except Exception as exc:
        error = failures.received(
            exc, lambda e: errors.translate(e, what, owner, facade.given(timeout))
        )
        if error is exc:
            raise
        raise error from None
    if isinstance(got, type):  # the answer itself (torch's future is its C++ type)
        return got
    known = _type_futures.get(rref)
    if known is not None and known[0] is got:
        return known[1]
    out = facade.new_future(owner)
    _type_futures[rref] = (got, out)
    call = errors.Sent(owner, what, 0.0, facade.given(timeout))
    _torch.on_done(got, lambda done: failures.settle(done, out, call.translate))
    return out


#: What :func:`_get_type` answered each handle with: torch's future (the handle keeps it)
#: and nbrpc's, settled from it.
_type_futures: weakref.WeakKeyDictionary[Any, tuple[Any, facade.Future]] = (
    weakref.WeakKeyDictionary()
)


def install() -> None:
    """Give every RRef's ``to_here``, ``owner`` and ``_get_type`` nbrpc's error
    translation, and its proxies (``rref.rpc_sync().f()``, ``rpc_async()``, ``remote()``)
    nbrpc's calls, so a method's exception keeps its type as a call's does, and so does
    the failed creation of the value they call (idempotent)."""
    _torch.patch_rref_method("to_here", shown_short(_to_here))
    _torch.patch_rref_method("owner", _owner)
    _torch.patch_rref_method("_get_type", _get_type)
    for name, call in spelling.torchs_spelling().items():
        _torch.patch_rref_method(name, _proxy(call))


def _proxy(call: Callable[..., Any]) -> Callable[..., Any]:
    """``RRef.rpc_sync`` & co.: torch's own proxy (``RRefProxy``), calling through nbrpc's
    ``call`` (torch's C++ made it call ``torch.distributed.rpc.api``'s, whose errors come
    as a ``RuntimeError`` wrapping the method's)."""

    def proxy(rref: Any, timeout: float = _torch.UNSET_RPC_TIMEOUT) -> Any:
        return _torch.RRefProxy(rref, call, timeout)

    proxy.__name__ = proxy.__qualname__ = call.__name__
    return proxy
