"""A notebook's module-level names on a worker: one namespace per process, as in a script.

In a script run by ``torch.distributed.rpc``, every process imports the script once: a
module-level ``param_server = None`` or ``lock = Lock()`` exists once per process, and a
function's ``global param_server`` assignment is there for every later call. A notebook
function travels by value instead (cloudpickle), and cloudpickle gives it a fresh globals
dict on every call: an assignment was gone after the call (three calls of a singleton
getter made three parameter servers), and a module-level lock could not be pickled.

So on a worker every function from the notebook's ``__main__`` runs with the worker's own
``__main__`` as its globals, the namespace ``%%rpc`` cells and ``nbrpc.push`` use too (one
namespace per worker):

* a name a function assigns stays there, for later calls from any caller, as in a
  script's module;
* a name it only reads arrives with each call, with the kernel's current value (a
  constant changed in the kernel is seen by the next call), unless the worker's own code
  assigned that name since: nbrpc tells by identity, the namespace no longer holds the
  object the last call brought;
* module-level locks, events, conditions and semaphores, which cannot be pickled, travel
  as what they are and are made afresh on the worker the first time, then kept there.

A new worker process (``%rpc_restart``, the next ``%rpc_init``) starts with an empty
namespace, as a new process of a script would. The kernel (a script's main process) keeps
cloudpickle's behaviour: a notebook function that comes back to it gets a dict of its own,
so nothing a worker sends lands in the notebook's namespace.

The cloudpickle hook this needs (its function reducer's shape) is
:func:`nbrpc._wire.pickling.RpcPickler._dynamic_function_reduce`, pinned by a test.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

#: what can be made afresh where a function runs, by the type a module-level name holds
SYNC_TYPES: dict[type, str] = {
    type(threading.Lock()): "Lock",
    type(threading.RLock()): "RLock",
    threading.Event: "Event",
    threading.Condition: "Condition",
    threading.Semaphore: "Semaphore",
    threading.BoundedSemaphore: "BoundedSemaphore",
}


@dataclass
class _State:
    """``shared``: this process is a worker, whose notebook functions share ``__main__``;
    ``placed``: the value each name got from the last call that brought it (a name whose
    value is no longer that object was assigned by the worker's own code)."""

    shared: bool = False
    placed: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()
_MISSING = object()


def is_notebook_function(obj: Any) -> bool:
    """Whether ``obj`` is a plain function the notebook defined (in its ``__main__``): it
    travels by value, gets the worker's namespace as its globals, and a lane keeps its
    pickle; never one of torch's builtins. The one test of it, on every call's path."""
    return type(obj) is FunctionType and obj.__module__ == "__main__"


def share() -> None:
    """This process is a worker: notebook functions run in its ``__main__`` from now on.

    What the engine put there itself (IPython's ``In``, ``Out``, ``exit``, ...) counts as
    placed: a notebook name that happens to be the same wins over it."""
    with _state.lock:
        _state.placed = dict(namespace())
        _state.shared = True


def namespace() -> dict[str, Any]:
    """The namespace notebook functions run in on this worker (its ``__main__``)."""
    return sys.modules["__main__"].__dict__


class Sync:
    """A module-level lock (or event, condition, semaphore) as it travels: its kind and
    the count a semaphore starts from. Made afresh where the function runs."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: int | None = None) -> None:
        self.kind, self.value = kind, value

    def __reduce__(self) -> tuple:
        return Sync, (self.kind, self.value)

    def make(self) -> Any:
        factory = getattr(threading, self.kind)
        return factory() if self.value is None else factory(self.value)

    def matches(self, value: Any) -> bool:
        return SYNC_TYPES.get(type(value)) == self.kind


def as_sent(value: Any) -> Any:
    """A module-level value as it travels: a synchronisation object as :class:`Sync`."""
    kind = SYNC_TYPES.get(type(value))
    if kind is None:
        return value
    if kind == "BoundedSemaphore":
        return Sync(kind, value._initial_value)
    if kind == "Semaphore":
        return Sync(kind, value._value)
    return Sync(kind)


def globals_for(base: dict[str, Any]) -> dict[str, Any]:
    """Unpickling side: the globals a notebook function is made with (``base``:
    cloudpickle's fresh dict, kept where the namespace is not shared)."""
    return namespace() if _state.shared else base


def arrive(values: dict[str, Any]) -> dict[str, Any]:
    """Unpickling side: the globals a function brought, put where it runs. Returns what
    cloudpickle then adds to the function's globals itself (nothing, on a worker)."""
    if not values:  # a function that reads no global (or none the caller has)
        return {}
    if not _state.shared:
        return {k: v.make() if isinstance(v, Sync) else v for k, v in values.items()}
    ns = namespace()
    with _state.lock:
        for name, value in values.items():
            current = ns.get(name, _MISSING)
            if isinstance(value, Sync):
                if not value.matches(current):
                    ns[name] = _state.placed[name] = value.make()
                continue
            placed = _state.placed.get(name, _MISSING)
            if current is _MISSING or current is placed:
                ns[name] = _state.placed[name] = value
            elif placed is not _MISSING:  # the worker's code assigned it: its own from now
                del _state.placed[name]
    return {}
