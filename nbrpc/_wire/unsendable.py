"""What cannot travel, said: the error a failed pickle of a call or a reply becomes.

:meth:`nbrpc._wire.pickling.RpcPickler.dump` turns any error of pickling a message into a
:class:`~nbrpc.SerializationError` whose text is :func:`cannot_send`'s: which call (or
which process's result) could not travel, why, and what to do instead. A call's arguments
are made where the call is sent from, a result where it runs, so the advice differs. For a
call of a notebook function, :func:`unsendable_global` names the notebook global that
keeps it from travelling, found only once a pickle failed (it pickles each global again).
"""

from __future__ import annotations

from types import FunctionType
from typing import Any

import cloudpickle

from nbrpc import _process, _torch

from . import namespace


def cannot_send(obj: Any, exc: Exception) -> str:
    """Why ``obj`` cannot travel, and what to do: a call's arguments are made where the
    call is sent from, a result where it runs."""
    why = f"{type(exc).__name__}: {exc}"
    func = _torch.udf_function(obj)  # torch's PythonUDF: the call being sent
    if func is not None:
        name = getattr(func, "__qualname__", type(func).__name__)
        culprit = unsendable_global(func)
        if culprit is not None:
            owner, global_name, value = culprit
            return (
                f"cannot send a call of {name} over RPC: {owner} uses the notebook's "
                f"global {global_name!r}, a {type(value).__name__}, which cannot travel "
                f"({why}). Make it on the worker instead, as a script's module would: "
                f"inside the function, or once in a %%rpc cell ({global_name} = ...); "
                "module-level locks, events and semaphores are made there by themselves."
            )
        return (
            f"cannot send a call of {name} over RPC: {why}. Objects holding locks, open "
            "files, sockets or generators cannot travel; create them on the worker instead "
            "(inside the function, or keep them there with nbrpc.remote)."
        )
    return (
        f"cannot send a {type(obj).__name__} back from {_process.name()} as a call's result: "
        f"{why}. Return what pickles (numbers, tensors, lists, dicts of them), or keep the "
        "object on the worker: nbrpc.remote(...) returns an RRef to it."
    )


def unsendable_global(func: Any, seen: set[int] | None = None) -> tuple[str, str, Any] | None:
    """The notebook global that keeps ``func`` from travelling, found by pickling each one
    it names, and those of the notebook functions it names (only once a call failed):
    ``(function name, global name, value)``, or None."""
    seen = set() if seen is None else seen
    if not namespace.is_notebook_function(func) or id(func) in seen:
        return None
    seen.add(id(func))
    names = cloudpickle.cloudpickle._extract_code_globals(func.__code__)
    for name in sorted(names):
        value = func.__globals__.get(name)
        if isinstance(value, FunctionType):
            found = unsendable_global(value, seen)
            if found is not None:
                return found
            continue
        try:
            cloudpickle.dumps(namespace.as_sent(value))
        except Exception:
            return func.__qualname__, name, value
    return None
