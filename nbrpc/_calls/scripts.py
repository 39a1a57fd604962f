"""TorchScript functions defined in a notebook, callable on the workers as the notebook's
Python functions are.

The first call of a ``@torch.jit.script`` function to a worker first has that worker
compile it under the kernel's qualified name (:func:`nbrpc._torch.compile_script_as`:
the Python function by value, its cell's lines beside it). A cell run again compiles
under a new name in the kernel (torch's ``___torch_mangle_N``), which is compiled on
the workers at its first call too; a fresh worker (a new cluster, a restart) is asked
again. A TorchScript function that calls another has that one compiled there first (it
travels by name: :mod:`nbrpc._wire.pickling` reduces a ScriptFunction to its name). Where
that cannot be done (no source kept, a function that does not pickle, a compile that
fails there), the call goes as torch sends it, and its error carries nbrpc's note with
the fix (:func:`nbrpc._calls.errors.translate`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from nbrpc import _torch

_asked: set[tuple[str, str]] = set()  # (worker, qualified name) compiled there, or tried
_lock = threading.Lock()


def ensure_on(worker: str, fn: Any) -> None:
    """Have ``worker`` know ScriptFunction ``fn`` under its name before a call of it. The
    compile is an RPC of nbrpc's own, which torch's profiler names ``rpc_nbrpc#...``: the
    first event of the call's kind in a profile is the call's, as in torch's."""
    if not isinstance(fn, torch.jit.ScriptFunction):
        return
    key = (worker, fn.qualified_name)
    with _lock:
        if key in _asked:
            return
        _asked.add(key)
    found = _torch.script_source(fn)
    if found is None:
        return
    for used in _torch.script_functions_used(found[0]):  # what it calls, compiled first
        ensure_on(worker, used)
    try:
        _torch.rpc_sync_of_nbrpcs(
            worker, _torch.compile_script_as, args=(fn.qualified_name, *found)
        )
    except Exception:  # torch's error at the call says it, with nbrpc's note
        return


def forget(workers: tuple[str, ...] | None = None) -> None:
    """Fresh processes under ``workers`` (all: a new cluster) know none of them yet."""
    with _lock:
        if workers is None:
            _asked.clear()
        else:
            _asked.difference_update({k for k in _asked if k[0] in workers})
