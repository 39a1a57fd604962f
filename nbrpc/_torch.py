"""Every private torch name, patch and error wording nbrpc depends on, in one place.

torch's RPC is in maintenance mode and its Python layer is mostly private: the pickler,
the remote-call wrapper, RRef forks, the dynamic group's membership messages and the
autograd context's graph are underscore names. nbrpc uses them, but only through this
module, so a torch upgrade is checked here and nowhere else. ``tests/test_torch_seam.py``
pins each entry; a failure there names the torch change and the function to update.

Public torch API (``rpc.rpc_async``, ``dist_autograd.context``, ``RRef`` methods without
an underscore) is used directly by the other modules and is not listed here.

What is here, by topic:

* the current agent and its store (``agent``, ``agent_is_set``, ``set_rpc_timeout``);
* RRef internals (``PyRRef``, ``rref_fork``, ``rref_from_fork``, ``rref_type_future``,
  ``original_get_type``, ``rref_id``, ``owned_rref_count``, ``delete_user_rrefs``);
* the dynamic group's membership (``GROUP_TOKEN_KEY``, ``MEMBER_LIST_KEY``,
  ``update_group_membership``, ``forget_locally``);
* the hooks nbrpc installs into ``torch.distributed.rpc.internal`` and the two patches of
  ``torch.distributed.rpc.api`` (``install_rpc_hooks``, ``patch_api``);
* TensorPipe options that are not public (``tensorpipe_options``, ``TP_SOCKET_IFNAME``);
* the pickler CUDA-aware futures use to find a value's tensors (``TENSOR_EXTRACTOR``,
  ``install_tensor_extractor``);
* distributed autograd's context internals (``autograd_context``, ...);
* TorchScript's builtin table (``is_builtin``);
* torch's error wording (``is_timeout``, ``missing_module``, ``is_connection_loss``).
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
import torch.distributed.rpc.internal as rpc_internal
from torch import _jit_internal
from torch._C import _jit_resolve_packet
from torch._C._distributed_rpc import (
    PyRRef,
    _delete_all_user_and_unforked_owner_rrefs,
    _rref_context_get_debug_info,
)
from torch.distributed.rpc._utils import _update_group_membership
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

# what torch's callee returns for a call that raised (``msg``, ``exception_type``)
from torch.distributed.rpc.internal import RemoteException as RemoteException
from torch.distributed.rpc.rref_proxy import RRefProxy as RRefProxy
from torch.jit._builtins import _find_builtin

# -- the current agent ---------------------------------------------------------------------


def agent() -> Any:
    """This process's RPC agent (torch keeps it in a private module global)."""
    return rpc_api._get_current_rpc_agent()


def agent_is_set() -> bool:
    return rpc_api._is_current_rpc_agent_set()


def set_rpc_timeout(seconds: float) -> None:
    """The default timeout of later calls (torch's setter is private)."""
    rpc._set_rpc_timeout(seconds)


def leave_group(timeout: float = 0) -> None:
    """torch's own graceful shutdown; on a dynamic group it is a leave."""
    rpc_api.shutdown(graceful=True, timeout=timeout)


# -- RRef internals ------------------------------------------------------------------------

#: how torch's RRef repr names its id (torch has no accessor)
RREF_ID = re.compile(r"created_on=(\d+), local_id=(\d+)")


def rref_fork(rref: PyRRef) -> tuple:
    """The fork data torch pickles an RRef as (registers a fork with its owner)."""
    return rref._serialize()


def rref_from_fork(fork_data: tuple) -> PyRRef:
    """The receiving side of :func:`rref_fork` (what torch's unpickler does)."""
    return PyRRef._deserialize(fork_data)


def rref_type_future(rref: PyRRef) -> Any:
    """A future of the value's type; a user RRef asks its owner once and caches it."""
    return original_get_type(rref, blocking=False)


def original_get_type(
    rref: PyRRef, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True
) -> Any:
    """torch's own ``RRef._get_type`` (the value's type, or with ``blocking=False`` a future
    of it; a handle keeps the first answer), also after :func:`patch_rref_method` replaced
    it. torch's RRef proxies (``rref.rpc_sync().f()`` & co.) ask it before every call."""
    get_type = _patched.rref_methods.get("_get_type", PyRRef._get_type)
    return get_type(rref, timeout=timeout, blocking=blocking)


#: The creation futures of the user RRefs this process's ``remote()`` made, by handle.
#: torch's ``RRef._get_future()`` has one only for those: on any other RRef (one a call
#: returned, a fork received in arguments) it dereferences a null future and the process
#: dies (SIGSEGV). So it is asked once, right after ``remote()``, and never again.
_creations: weakref.WeakKeyDictionary[PyRRef, Any] = weakref.WeakKeyDictionary()


def remember_creation(rref: PyRRef) -> None:
    """Keep the creation future of ``rref``, which this process's ``remote()`` returned."""
    if not rref.is_owner():
        _creations[rref] = rref._get_future()


def rref_creation_future(rref: PyRRef) -> Any:
    """The future of a user RRef's creation by ``remote()`` in this process, done once the
    owner holds the value (or failed to make it); None for any other RRef."""
    return _creations.get(rref)


def rref_id(rref: PyRRef) -> str:
    """torch's globally unique RRef id as ``"created_on:local_id"``, read from its repr
    (torch has no accessor; ranks are unique in nbrpc's groups)."""
    match = RREF_ID.search(str(rref))
    return f"{match.group(1)}:{match.group(2)}" if match else str(rref)


def owned_rref_count() -> int:
    """How many RRefs this process owns that some process still references."""
    return int(_rref_context_get_debug_info().get("num_owner_rrefs", 0))


def delete_user_rrefs(timeout_s: float) -> None:
    """Delete this process's user RRefs, telling their owners (torch's static-group
    shutdown does this; its dynamic leave does not)."""
    _delete_all_user_and_unforked_owner_rrefs(timedelta(seconds=timeout_s))


# -- the dynamic group's membership -------------------------------------------------------

GROUP_TOKEN_KEY = "RpcGroupManagementToken"  # the key of the join/leave critical section
MEMBER_LIST_KEY = "_ALL_WORKER_INFOS"  # under the "names" prefix: "name-id," entries

#: The function torch's leave runs on every peer (sent by RPC, so it must be torch's own).
update_group_membership = _update_group_membership


def forget_locally(info: Any) -> None:
    """What :data:`update_group_membership` does, in this process: ``info`` left."""
    agent()._update_group_membership(info, [], {}, False)


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


def list_future(fut: Any) -> None:
    """Add ``fut`` to the futures of a ``torch.distributed.rpc.api._wait_all()`` block
    running on this thread, as torch's ``rpc_async`` adds its own."""
    listed = getattr(rpc_api._thread_local_var, "future_list", None)
    if listed is not None:
        listed.append(fut)


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


def install_rpc_hooks(
    pickler: type, run_function: Callable[..., Any], handle_exception: Callable[..., Any]
) -> None:
    """Route torch RPC's pickling and remote-call wrapper through nbrpc's."""
    missing = [name for name in TORCH_INTERNAL_HOOKS if not hasattr(rpc_internal, name)]
    if missing:
        raise ImportError(
            f"torch.distributed.rpc.internal.{missing[0]} is gone in torch "
            f"{torch.__version__}: nbrpc needs a release that supports this torch version."
        )
    rpc_internal._pickler = pickler  # type: ignore[assignment]
    rpc_internal._run_function = run_function
    rpc_internal._handle_exception = handle_exception


def default_pickler() -> Any:
    """The pickler instance torch's RPC uses (``serialize(obj) -> (bytes, tensors)``)."""
    return rpc_api._default_pickler


def custom_reducer_classes() -> list[type]:
    """The classes torch's RPC pickler reduces its own way (``RemoteModule``, ...): private
    (``_InternalRPCPickler._class_reducer_dict``)."""
    return list(getattr(default_pickler(), "_class_reducer_dict", {}))


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler records now (it records RPCs): private
    (``torch._C._autograd._profiler_enabled``), about 30 ns."""
    return bool(torch._C._autograd._profiler_enabled())


_contexts = threading.local()  # .made: contexts this thread made and has not released


def track_autograd_contexts() -> None:
    """Count the distributed autograd contexts each thread makes (idempotent), so that
    :func:`in_autograd_context` costs one attribute read outside one. torch's
    ``context()`` calls the module's ``_new_context`` and ``_release_context``."""
    made, released = dist_autograd._new_context, dist_autograd._release_context
    if getattr(made, "nbrpc_counted", False):
        return

    def new_context() -> Any:
        context = made()
        _contexts.made = getattr(_contexts, "made", 0) + 1
        return context

    def release_context(context_id: int) -> Any:
        _contexts.made = max(getattr(_contexts, "made", 0) - 1, 0)
        return released(context_id)

    new_context.nbrpc_counted = True  # type: ignore[attr-defined]
    dist_autograd._new_context = new_context
    dist_autograd._release_context = release_context


def in_autograd_context() -> bool:
    """Whether this thread is inside a distributed autograd context (its RPCs are part of
    the backward pass). Private: ``_current_context`` raises when there is none (a few
    µs), asked only on a thread that made a context (:func:`track_autograd_contexts`)."""
    if not getattr(_contexts, "made", 0):
        return False
    try:
        dist_autograd._current_context()
    except RuntimeError:
        return False
    return True


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


#: torch's ``_all_gather`` (the collective its RPC layer builds barriers with), as it was
_torch_all_gather = rpc_api._all_gather


def route_all_gather(members: Callable[[], list[str]]) -> None:
    """``torch.distributed.rpc.api._all_gather`` without names gathers over ``members()``
    (idempotent). torch defaults to ``_ALL_WORKER_NAMES``, the processes a process saw when
    it joined: in a dynamic group the kernel saw only itself, and a gather hung."""

    def _all_gather(obj: Any, worker_names: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _torch_all_gather(obj, worker_names or set(members()), timeout)

    patch_api("_all_gather", _all_gather)


def reset_all_gather() -> None:
    """A new cluster's gathers count from 0 in every process, as its fresh workers do:
    torch numbers them per set of names, and a kernel that re-runs reuses the names."""
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()
        rpc_api._all_gather_sequence_id_to_states.clear()


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

#: torch's deprecation notices about its own internals that public torch API triggers:
#: ``DistributedOptimizer`` scripts functional optimizers with TorchScript on each worker.
INTERNAL_DEPRECATIONS = (
    "`TorchScript` support for functional optimizers is deprecated",
    "`torch.jit.script` is deprecated",
    "`torch.jit.interface` is deprecated",
)


def quiet_internal_deprecations() -> None:
    """Hide :data:`INTERNAL_DEPRECATIONS` in this process: a notebook user cannot act on
    them (nbrpc's tests check that the optimizer's steps still equal torch's)."""
    for text in INTERNAL_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=DeprecationWarning)
    quiet_optimizer_notice_if_loaded()


#: the name of the notice function torch's functional optimizer modules call
OPTIMIZER_NOTICE = "_scripted_functional_optimizer_deprecation_warning"


@dataclass
class _Patched:
    """What this module replaced in torch: whether the optimizer notice is silenced, and
    torch's own methods of ``PyRRef`` replaced by :func:`patch_rref_method`."""

    optimizer_notice: bool = False
    rref_methods: dict[str, Any] = field(default_factory=dict)


_patched = _Patched()


@torch.jit.ignore
def no_optimizer_notice(stacklevel: int = 0) -> None:
    """Stands in for torch's notice, which forces itself past every warnings filter."""


def quiet_optimizer_notice_if_loaded() -> None:
    """torch's functional optimizers warn with ``simplefilter("always")`` from their
    ``__init__``; once ``torch.distributed.optim`` is loaded (1.5 s to import, so never
    just for this), their modules call a silent stand-in. Cheap to call before every call."""
    if _patched.optimizer_notice or "torch.distributed.optim.utils" not in sys.modules:
        return
    from torch.distributed.optim.utils import functional_optim_map

    for cls in functional_optim_map.values():
        module = sys.modules[cls.__module__]
        if hasattr(module, OPTIMIZER_NOTICE):
            setattr(module, OPTIMIZER_NOTICE, no_optimizer_notice)
    _patched.optimizer_notice = True


def patch_rref_method(name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``PyRRef.NAME`` (a pybind11 class, so every RRef handle); idempotent."""
    if name not in _patched.rref_methods:
        _patched.rref_methods[name] = getattr(PyRRef, name)
    setattr(PyRRef, name, replacement)


def original_owner(rref: PyRRef) -> Any:
    """torch's own ``RRef.owner``, also after :func:`patch_rref_method` replaced it."""
    return _patched.rref_methods.get("owner", PyRRef.owner)(rref)


def original_to_here(rref: PyRRef, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """torch's own ``RRef.to_here``, also after :func:`patch_rref_method` replaced it."""
    return _patched.rref_methods.get("to_here", PyRRef.to_here)(rref, timeout)


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


# -- TensorPipe ----------------------------------------------------------------------------

#: TensorPipe reads this variable when an agent is created: the interface it listens on.
TP_SOCKET_IFNAME = "TP_SOCKET_IFNAME"
#: gloo's equivalent, read when a process group is created.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"


def tensorpipe_options(transports: list[str], channels: list[str], **kwargs: Any) -> Any:
    """``TensorPipeRpcBackendOptions`` with transport and channel lists (private arguments)."""
    return rpc.TensorPipeRpcBackendOptions(_transports=transports, _channels=channels, **kwargs)


# -- distributed autograd -----------------------------------------------------------------


def current_autograd_context_id() -> int:
    """The innermost context on this thread; ``RuntimeError`` when there is none."""
    return dist_autograd._current_context()._context_id()


def validate_autograd_context(context_id: int) -> None:
    """Raises ``RuntimeError`` when this process does not know ``context_id`` (any more)."""
    dist_autograd._is_valid_context(context_id)


def autograd_messages(context_id: int) -> tuple[dict[int, Any], dict[int, Any]]:
    """The context's send and recv graph nodes in this process, by autograd message id
    (a send here and the recv on the peer share one id: the trace joins them by it)."""
    ctx = dist_autograd._retrieve_context(context_id)
    return ctx._send_functions(), ctx._recv_functions()


def autograd_known_workers(context_id: int) -> list[int]:
    """Ids of the workers this process's part of the context sent to or received from."""
    return sorted(dist_autograd._retrieve_context(context_id)._known_worker_ids())


#: torch's words when ``loss.backward()`` (the local engine) meets a graph that crossed
#: workers inside a distributed autograd context (torch 2.13: an internal assertion).
LOCAL_BACKWARD_ACROSS_WORKERS = "graphTask_ INTERNAL ASSERT FAILED"
_torch_backward = torch.autograd.backward


def route_local_backward(replacement: Callable[..., Any]) -> None:
    """Make ``torch.autograd.backward`` (what ``Tensor.backward`` calls) ``replacement``."""
    torch.autograd.backward = replacement


def local_backward(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``torch.autograd.backward``."""
    return _torch_backward(*args, **kwargs)


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


# -- torch's error wording ----------------------------------------------------------------


def is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("timeout" in text.lower() or "timed out" in text)


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def missing_module(exc: BaseException) -> str | None:
    """The module a worker failed to import while unpickling a call, else ``None``."""
    if not isinstance(exc, RuntimeError) or "deserialize" not in str(exc):
        return None
    match = _NO_MODULE.search(str(exc))
    return match.group(1) if match else None


_SERIALIZATION = re.compile(r"SerializationError: (.*?)(?:\n\nAt:|\nException raised from|$)", re.S)


def serialization_failure(exc: BaseException) -> str | None:
    """nbrpc's pickler refused a result on the callee (torch's C++ turned the error into a
    RuntimeError, C++ frames appended): its message, else ``None``."""
    if not isinstance(exc, RuntimeError):
        return None
    match = _SERIALIZATION.search(str(exc))
    return match.group(1).strip() if match else None


CONNECTION_LOST = (
    "eof (this error originated at tensorpipe",  # the shm transport's wording
    "EOF: end of file (this error originated at tensorpipe",  # the uv transport's
    "ECONNREFUSED",
    "ECONNRESET",
    "EPIPE",
    "pipe closed",
    "Connection reset by peer",
)


#: torch's words when a handle names a worker id its agent does not know: an RRef whose
#: owner left the group (a worker that died, or one of an earlier cluster).
UNKNOWN_DESTINATION = "could not find destination id"
#: torch's hint when a callee cannot find the function a call names (its unpickler's
#: AttributeError; torch's caller gets it as a RuntimeError)
NOT_ON_CALLEE = "RPC pickler does not serialize"


def owner_name(rref: PyRRef) -> str | None:
    """The name of an RRef's owner; ``None`` when it left the group (torch raises)."""
    try:
        return rref.owner_name()
    except RuntimeError as exc:
        if UNKNOWN_DESTINATION in str(exc):
            return None
        raise


def is_connection_loss(exc: BaseException) -> bool:
    """Whether torch's error means the peer's process went away (TensorPipe's wording)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in CONNECTION_LOST)
