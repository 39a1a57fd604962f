"""TorchScript functions a notebook compiles: what it takes to compile one on a worker
under the kernel's own name.

torch's RPC sends a ``@torch.jit.script`` function by its qualified name
(``__torch__.my_script_add``; ``__torch__.___torch_mangle_0.my_script_add`` once its cell
ran again, torch counting per process), and the callee looks that name up in its own
compilation unit. A function compiled in the kernel only is unknown there. The Python
function it was compiled from (``ScriptFunction._torchdynamo_inline``) and its cell's
lines (IPython keeps them in ``linecache``) are what a worker needs to compile it under
the same name (``torch._C._jit_script_compile``, as ``torch.jit.script`` does).
"""

from __future__ import annotations

import linecache
from typing import Any

import torch
from torch import _jit_internal
from torch.jit import _state, frontend


def script_source(fn: Any) -> tuple[Any, list[str]] | None:
    """The Python function ``fn`` (a ScriptFunction) was compiled from, and the lines of
    the file or cell it is in; None where torch kept no function or there are no lines."""
    original = getattr(fn, "_torchdynamo_inline", None)
    code = getattr(original, "__code__", None)
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    return (original, lines) if lines else None


def compile_script_as(qualified_name: str, fn: Any, lines: list[str]) -> bool:
    """On a worker: compile Python function ``fn`` (sent by value, its file's ``lines``
    beside it) as TorchScript under ``qualified_name``, unless a function of that name is
    there already. Whether it compiled one."""
    if _state._python_cu.find_function(qualified_name) is not None:
        return False
    filename = fn.__code__.co_filename
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    ast = frontend.get_jit_def(fn, fn.__name__)
    resolve = _jit_internal.createResolutionCallbackFromClosure(fn)
    torch._C._jit_script_compile(qualified_name, ast, resolve, frontend.get_default_args(fn))
    return True


def script_functions_used(fn: Any) -> list[Any]:
    """The ScriptFunctions Python function ``fn`` names among its globals (a TorchScript
    function that calls another): each must be compiled on a worker before ``fn``."""
    space = getattr(fn, "__globals__", {})
    return [
        space[name]
        for name in getattr(getattr(fn, "__code__", None), "co_names", ())
        if isinstance(space.get(name), torch.jit.ScriptFunction)
    ]


def script_function_named(qualified_name: str) -> Any:
    """Unpickling side of a ScriptFunction sent by name: this process's function of that
    qualified name (compiled here by :func:`compile_script_as`)."""
    found = _state._python_cu.find_function(qualified_name)
    if found is None:
        raise RuntimeError(f"attempted to get undefined function {qualified_name}")
    return found
