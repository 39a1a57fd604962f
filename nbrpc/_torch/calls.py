"""The calls: torch's own senders, the names a notebook calls, the hooks into torch's
pickler and callee, CUDA-aware futures' tensor finder, and TorchScript's builtin table.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
import torch.distributed.rpc.internal as rpc_internal
from torch import _jit_internal
from torch._C import _jit_resolve_packet

# what torch's callee returns for a call that raised (``msg``, ``exception_type``)
from torch.distributed.rpc.internal import RemoteException as RemoteException
from torch.distributed.rpc.rref_proxy import RRefProxy as RRefProxy
from torch.jit._builtins import _find_builtin

# -- the calls a notebook makes, and nbrpc's own -------------------------------------------

#: The names a notebook calls, which nbrpc routes to its own in the kernel
#: (:func:`route_user_calls`): ``torch.distributed.rpc.<name>``.
USER_CALLS = ("rpc_sync", "rpc_async", "remote")


def rpc_sync(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``rpc_sync``: what nbrpc's modules send with, whatever the routing."""
    return rpc_api.rpc_sync(*args, **kwargs)


def rpc_async(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``rpc_async`` (see :func:`rpc_sync`), its future left out of the list
    that torch's ``_wait_all()`` block keeps: nbrpc lists the future it hands out instead
    (:func:`list_future`), and a ``rpc_sync`` built on this is not an ``rpc_async``."""
    local = rpc_api._thread_local_var
    listed = getattr(local, "future_list", None)
    if listed is None:
        return rpc_api.rpc_async(*args, **kwargs)
    del local.future_list
    try:
        return rpc_api.rpc_async(*args, **kwargs)
    finally:
        local.future_list = listed


def rpc_sync_started(to: Any, func: Any, args: tuple, kwargs: dict | None, timeout: float) -> Any:
    """torch's own ``rpc_sync`` without its wait: the future it waits on. While torch's
    profiler records, the call's event is ``rpc_sync#...`` as for torch's own call (sent
    as an ``rpc_async``, it was ``rpc_async#...``: torch's profiler tests failed on it)."""
    return rpc_api._invoke_rpc(to, func, rpc_api.RPCExecMode.SYNC, args, kwargs, timeout)


class _NbrpcsOwn:
    """The kind torch's profiler names an RPC of nbrpc's own with (``rpc_nbrpc#f(a -> b)``,
    where torch's own are ``rpc_sync#``, ``rpc_async#`` and ``rpc_remote#``)."""

    value = "nbrpc"


NBRPCS_OWN = _NbrpcsOwn()


def rpc_sync_of_nbrpcs(to: Any, func: Any, args: tuple) -> Any:
    """torch's own ``rpc_sync`` of a call nbrpc makes for itself before a user's call (a
    TorchScript function compiled where it is called), which torch's profiler records as
    ``rpc_nbrpc#...``. torch's profiler tests take the first event whose name holds the
    call's kind ("sync", also in "async", or "remote"): it must be the user's call. (Its
    C++ side asks for a profiling key of every RPC sent while it records, so none can be
    left out of the profile.)"""
    return rpc_api._invoke_rpc(to, func, NBRPCS_OWN, args, None).wait()


class _ServerProfiles:
    """How many of torch's server-process profilers (``rpc._server_process_global_profile``)
    are on in this process: they record the requests TensorPipe brings, and a lane's call
    runs beside those (:func:`server_profiling`)."""

    active = 0
    lock = threading.Lock()


def server_profiling() -> bool:
    """Whether a server-process profiler records here: a lane's callee then sends the call
    back to come through TensorPipe, where the profiler sees it (it saw none)."""
    return _ServerProfiles.active > 0


def _count_server_profiles() -> None:
    """Count torch's server-process profilers as they start and stop (idempotent)."""
    from torch.distributed.rpc import server_process_global_profiler as module

    enable = getattr(module, "_enable_server_process_global_profiler", None)
    disable = getattr(module, "_disable_server_process_global_profiler", None)
    if enable is None or disable is None or hasattr(enable, "nbrpc_counted"):
        return

    @functools.wraps(enable)
    def enabled(*args: Any, **kwargs: Any) -> Any:
        result = enable(*args, **kwargs)
        with _ServerProfiles.lock:
            _ServerProfiles.active += 1
        return result

    @functools.wraps(disable)
    def disabled(*args: Any, **kwargs: Any) -> Any:
        with _ServerProfiles.lock:
            _ServerProfiles.active = max(0, _ServerProfiles.active - 1)
        return disable(*args, **kwargs)

    enabled.nbrpc_counted = True  # type: ignore[attr-defined]
    module._enable_server_process_global_profiler = enabled
    module._disable_server_process_global_profiler = disabled


def list_future(fut: Any) -> None:
    """Add ``fut`` to the futures of a ``torch.distributed.rpc.api._wait_all()`` block
    running on this thread, as torch's ``rpc_async`` adds its own."""
    listed = getattr(rpc_api._thread_local_var, "future_list", None)
    if listed is not None:
        listed.append(fut)


def on_done(fut: Any, callback: Callable[[Any], None]) -> None:
    """``fut.add_done_callback(callback)``, except that what ``callback`` raises while it
    runs right here (``fut`` was done: torch runs it at once, on this thread) is raised
    here. torch logs a callback's exception and drops it: the stop button's
    ``KeyboardInterrupt``, delivered into a worker's call at whatever bytecode it runs
    (:mod:`nbrpc._wire.cancelling`), or into the kernel's main thread by SIGINT, was lost
    when it landed in such a callback, and the call ran on (checked: torch logs "Got the
    following error when running the callback: KeyboardInterrupt" and goes on). A
    callback that runs later, on another thread, is torch's as before."""
    caught: list[BaseException] = []
    me = threading.get_ident()
    registering = True

    def run(done: Any) -> None:
        try:
            callback(done)
        except BaseException as exc:
            if not registering or threading.get_ident() != me:
                raise
            caught.append(exc)

    try:
        fut.add_done_callback(run)
    finally:
        registering = False
    if caught:
        raise caught[0]


def remote(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``remote``, as the ledger patched it (see :func:`rpc_sync`)."""
    return rpc_api.remote(*args, **kwargs)


def route_user_calls(calls: dict[str, Callable[..., Any]], wait_all: Callable[..., Any]) -> None:
    """Make the names a notebook calls nbrpc's: ``torch.distributed.rpc.rpc_sync``,
    ``rpc_async`` and ``remote`` (``calls``), and ``torch.futures.wait_all``. The functions
    of ``torch.distributed.rpc.api`` stay torch's: nbrpc itself sends with those."""
    for name in USER_CALLS:
        setattr(rpc, name, calls[name])
    torch.futures.wait_all = wait_all


# -- hooks into torch.distributed.rpc -----------------------------------------------------

#: The private attributes of ``torch.distributed.rpc.internal`` nbrpc replaces. torch's
#: C++ side (``PythonRpcHandler``) looks up ``_run_function`` and ``_handle_exception`` when
#: the first RPC agent starts, so :func:`install_rpc_hooks` must run before ``init_rpc``.
TORCH_INTERNAL_HOOKS = ("_pickler", "_run_function", "_handle_exception")

#: torch's RPC pickler class: torch assigns ``pickler.dispatch_table = {...}`` on each one
#: it makes and then sets the RRef reducers item by item (see :mod:`nbrpc._wire.pickling`).
INTERNAL_PICKLER = rpc_internal._InternalRPCPickler


#: The functions of ``torch.distributed.rpc.api`` that pickle a call and hand it to the
#: agent: ``_invoke_rpc`` (under ``rpc_sync`` and ``rpc_async``, torch's and an RRef
#: proxy's) and ``remote``. Each runs inside the ``sending`` hold of
#: :func:`install_rpc_hooks`, from the pickling of its RRefs to the hand-over.
HELD_SENDS = ("_invoke_rpc", "remote")


#: name -> torch's send of that name as held (what :func:`install_rpc_hooks` put in place;
#: another patch, the ledger's of ``remote``, may wrap it in turn)
_held_sends: dict[str, Any] = {}


def install_rpc_hooks(
    pickler: type,
    run_function: Callable[..., Any],
    handle_exception: Callable[..., Any],
    sending: Callable[[], AbstractContextManager[Any]],
) -> None:
    """Route torch RPC's pickling and remote-call wrapper through nbrpc's, and run its
    sends (:data:`HELD_SENDS`) inside ``sending()``."""
    missing = [name for name in TORCH_INTERNAL_HOOKS if not hasattr(rpc_internal, name)]
    missing += [name for name in HELD_SENDS if not hasattr(rpc_api, name)]
    if missing:
        raise ImportError(
            f"torch.distributed.rpc's {missing[0]} is gone in torch "
            f"{torch.__version__}: nbrpc needs a release that supports this torch version."
        )
    rpc_internal._pickler = pickler  # type: ignore[assignment]
    rpc_internal._run_function = run_function
    rpc_internal._handle_exception = handle_exception
    for name in HELD_SENDS:
        if name not in _held_sends:  # (once: a second install would hold twice)
            _held_sends[name] = _held(getattr(rpc_api, name), sending)
            patch_api(name, _held_sends[name])
    _count_server_profiles()


def held_sends() -> dict[str, Any]:
    """torch's sends as :func:`install_rpc_hooks` holds them, by name (for the seam's pins)."""
    return dict(_held_sends)


def _held(send: Callable[..., Any], sending: Callable[[], AbstractContextManager[Any]]) -> Any:
    @functools.wraps(send)
    def held(*args: Any, **kwargs: Any) -> Any:
        with sending():
            return send(*args, **kwargs)

    return held


def default_pickler() -> Any:
    """The pickler instance torch's RPC uses (``serialize(obj) -> (bytes, tensors)``)."""
    return rpc_api._default_pickler


def custom_reducer_classes() -> list[type]:
    """The classes torch's RPC pickler reduces its own way (``RemoteModule``, ...): private
    (``_InternalRPCPickler._class_reducer_dict``)."""
    return list(getattr(default_pickler(), "_class_reducer_dict", {}))


#: ``profiler_enabled()``: whether torch's autograd profiler records now (it records
#: RPCs); private, asked on every lane call (torch's own function, no frame around it)
profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled


def patch_api(name: str, value: Any) -> Any:
    """Replace ``torch.distributed.rpc.api.NAME`` (and the re-export in
    ``torch.distributed.rpc``); returns the original. ``"RRef.__init__"`` patches the
    local-owner constructor."""
    if name == "RRef.__init__":
        original = rpc_api.RRef.__init__
        rpc_api.RRef.__init__ = value  # type: ignore[method-assign]
        return original
    original = getattr(rpc_api, name)
    setattr(rpc_api, name, value)
    if getattr(rpc, name, None) is original:
        setattr(rpc, name, value)
    return original


def route_user_shutdown(replacement: Callable[..., Any]) -> None:
    """Make ``torch.distributed.rpc.shutdown`` (the name tutorials call) ``replacement``;
    ``torch.distributed.rpc.api.shutdown``, which :func:`leave_group` uses, stays torch's."""
    if rpc.shutdown is not replacement:
        rpc.shutdown = replacement


#: Modules of the functions torch's RPC runs for itself (membership updates, RRef type
#: queries, shutdown barriers): calls of these are not user calls.
TORCH_OWN_CALL_MODULES = (
    "torch.distributed.rpc.api",
    "torch.distributed.rpc._utils",
    "torch.distributed.rpc.backend_registry",
)

#: where torch's RRef proxies (``rref.rpc_sync().method(...)``) put the function they
#: send: ``_local_invoke(rref, method_name, args, kwargs)`` runs on the owner
RREF_PROXY_MODULE = "torch.distributed.rpc.rref_proxy"


def udf_function(obj: Any) -> Any:
    """The function of torch's ``PythonUDF`` (a call being pickled), else ``None``."""
    func = getattr(obj, "func", None)
    return func if func is not None and hasattr(obj, "args") else None


#: torch's call record, a namedtuple ``func, args, kwargs``: public in torch since 1.x
#: (``torch.distributed.rpc.internal.PythonUDF``), built by every Python call it sends.
PythonUDF = rpc_internal.PythonUDF


def run_udf(udf: Any) -> Any:
    """Run torch's ``PythonUDF`` (a namedtuple ``func, args, kwargs``) as torch does."""
    return udf.func(*udf.args, **udf.kwargs)


# -- CUDA-aware futures ---------------------------------------------------------------------

#: The ``pickle.Pickler`` subclass torch uses to list a value's tensors. Once a process has
#: devices in its RPC options, every call's value and reply is a CUDA-aware future, and
#: completing one pickles the value with this class (``_jit_internal._extract_tensors``,
#: called from C++, which looks the class up by name on each call) to learn which tensors
#: to synchronise streams for. The pickle itself is thrown away.
TENSOR_EXTRACTOR = _jit_internal._TensorExtractor


def install_tensor_extractor(extractor: type[_jit_internal._TensorExtractor]) -> None:
    """Make ``extractor`` (a subclass of :data:`TENSOR_EXTRACTOR`) what torch uses."""
    if not hasattr(_jit_internal, "_extract_tensors"):
        raise ImportError(
            f"torch._jit_internal._extract_tensors is gone in torch {torch.__version__}: "
            "nbrpc needs a release that supports this torch version."
        )
    _jit_internal._TensorExtractor = extractor  # type: ignore[misc]


# -- TorchScript ---------------------------------------------------------------------------


def builtin_accepts(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether one of the TorchScript schemas of builtin ``func`` takes these arguments:
    matched here as the callee would match them (torch's ``_jit_resolve_packet``, which
    ``torch.ops`` resolves overloads with), so a call torch would refuse there is known."""
    try:
        _jit_resolve_packet(_find_builtin(func), *args, **(kwargs or {}))
    except Exception:
        return False
    return True


def is_builtin(func: Any) -> bool:
    """Whether torch's RPC would send ``func`` as a TorchScript builtin operator (its
    schema matched on the callee, not a Python call): ``torch.add``, and some Python
    builtins such as ``dict`` or ``len`` too."""
    try:
        return _find_builtin(func) is not None
    except TypeError:  # unhashable callables
        return False
