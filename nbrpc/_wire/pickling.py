"""How notebook code travels: cloudpickle inside torch's RPC pickler.

torch's RPC pickler (``torch.distributed.rpc.internal._InternalRPCPickler``) pickles by
reference, so a function, lambda or class defined in a notebook's ``__main__`` fails on
the worker. It also moves tensors out-of-band: its dispatch table swaps each tensor for an
index into a tensor table that TensorPipe sends beside the pickle, not inside it.

nbrpc keeps torch's pickler and only changes the ``Pickler`` class it instantiates, to a
cloudpickle Pickler that still honours torch's dispatch table. Functions and classes from
``__main__`` then travel by value while tensors (and RRefs) keep their torch reducers, so
they stay out-of-band. The same hook makes plain ``torch.distributed.rpc`` calls work with
notebook code once nbrpc is initialized.

Two costs are paid once instead of per call (a notebook function's call pickled in 13 µs
instead of 29 µs measured): the code object of a function sent by value is marshalled once
and sent with a key, which the receiver keeps (:mod:`.sent_code`); and cloudpickle's
answer "importable: by reference" for a function or class is remembered
(:meth:`RpcPickler.reducer_override`). A function's globals, defaults and closure are still
pickled on every call, so a changed global is seen by the next call.

With devices in the RPC options (CUDA device maps), torch also pickles every call's value
and reply a second time with the standard library, only to list its tensors, and a
notebook class or lambda fails there ("Can't pickle <class '__main__.Model'>: attribute
lookup Model on __main__ failed"), even though the RPC itself would carry it.
:class:`TensorFinder` treats classes, functions and modules as holding no tensors, as
that pickle does for every importable one.

A lane's messages (:mod:`nbrpc._wire.lanes.messages`) are pickled by the same pickler
(:class:`LanePickler`) with other reducers, or by the standard library's C pickler alone
where they hold plain values; a call's function then travels as a pickle made once here
(:func:`function_head`).

A message that cannot be pickled is a :class:`~nbrpc.SerializationError` that says what
could not travel and what to do instead (:mod:`.unsendable`).

The private torch names this relies on (the hooks in ``torch.distributed.rpc.internal``,
the pickler torch instantiates) live in :mod:`nbrpc._torch`, pinned by
``tests/test_torch_seam.py``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from types import BuiltinFunctionType, CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import cloudpickle
import torch
from torch.distributed.rpc import RRef

from nbrpc import _ledger, _process, _torch
from nbrpc._errors import DeviceMapError, SerializationError

from . import (
    callee,
    cancelling,
    failures,
    namespace,
    recording,
    sent_code,
    sent_functions,
    shm,
    unsendable,
)

#: the C field behind ``dispatch_table`` (a member descriptor; typeshed calls it a Mapping)
_C_DISPATCH_TABLE: Any = pickle.Pickler.dispatch_table
_CLOUDPICKLE_TABLE = cloudpickle.Pickler.dispatch_table


def _reduce_method(method: MethodType) -> Any:
    """A bound method that its owner returns by name travels as ``getattr(owner, name)``.

    That is plain pickle's way. cloudpickle would ship the function by value instead, and
    for torch's own reducers (classmethods of ``_InternalRPCPickler``) that drags in the
    module's thread-local tensor tables, which cannot be pickled.
    """
    name = method.__func__.__name__
    if getattr(method.__self__, name, None) == method:
        return getattr, (method.__self__, name)
    return _CLOUDPICKLE_TABLE[MethodType](method)


def _reduce_script_function(fn: torch.jit.ScriptFunction) -> Any:
    """A TorchScript function travels by its qualified name: the receiver has one compiled
    under that name (:mod:`nbrpc._calls.scripts` sees to it for a notebook's own)."""
    return _torch.script_function_named, (fn.qualified_name,)


_BASE_TABLE = {
    **_CLOUDPICKLE_TABLE,
    MethodType: _reduce_method,
    CodeType: sent_code.reduce_code,
    torch.jit.ScriptFunction: _reduce_script_function,
}
_BY_REFERENCE_KEEP = 8192
_BY_VALUE_MODULES = cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES  # cloudpickle's own set


@dataclass
class _Pickling:
    """Functions and classes cloudpickle found importable (pickled by reference), by id:
    module attributes, alive anyway. Emptied when cloudpickle's set of modules registered
    by value changes size (``by_value_seen``; RpcPickler.dump checks). ``installed``: the
    hooks went into torch."""

    by_reference: dict[int, Any] = field(default_factory=dict)
    #: id -> (function, its pickle): importable functions a lane call starts with
    heads: dict[int, tuple[Any, bytes]] = field(default_factory=dict)
    by_value_seen: int = len(_BY_VALUE_MODULES)
    installed: bool = False
    #: why a tensor on a device may not leave this process now (None: it may);
    #: :func:`refuse_devices`
    refusal: str | None = None


_pickling = _Pickling()
# RRefs travel as torch's fork data plus their label, so the receiver's ledger knows them.
_RREF_TABLE = {_torch.PyRRef: _ledger.reduce_rref, RRef: _ledger.reduce_rref}


class _DispatchTable(dict):
    """A dispatch table where torch's RRef reducers, set item by item, yield to the ledger's.

    torch writes ``p.dispatch_table[PyRRef] = ...`` after assigning the table. The C
    pickler reads any mapping with ``PyObject_GetItem``, so a dict subclass costs no more
    per lookup than a dict.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _RREF_TABLE.get(key, value))


class _MainGlobals:
    """A notebook function's globals dict, as it travels: the worker's namespace there
    (:func:`nbrpc._wire.namespace.globals_for`)."""

    __slots__ = ("base",)

    def __init__(self, base: dict) -> None:
        self.base = base

    def __reduce__(self) -> tuple:
        return namespace.globals_for, (self.base,)


class _Arriving:
    """The globals a notebook function names, as they travel: put into the worker's
    namespace on arrival (:func:`nbrpc._wire.namespace.arrive`)."""

    __slots__ = ("values",)

    def __init__(self, values: dict) -> None:
        self.values = {name: namespace.as_sent(value) for name, value in values.items()}

    def __reduce__(self) -> tuple:
        return namespace.arrive, (self.values,)


class NotLane(Exception):
    """A message that must go through TensorPipe (raised while pickling it for a lane,
    :mod:`nbrpc._wire.lanes`): a refusal, not a failure to pickle, so
    :meth:`RpcPickler.dump` passes it on as it is, where any other error becomes a
    :class:`SerializationError`."""


class OnDevice(NotLane):
    """A message holding a tensor on a device (CUDA's; any but the CPU): TensorPipe
    carries it, so that the device maps place it and torch's CUDA-aware futures order
    the streams, as without lanes. ``device``: the first such tensor's."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(str(device))
        self.device = device


class RpcPickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, made to respect a ``dispatch_table`` assigned after creation.

    torch assigns ``p.dispatch_table = {...}`` on each pickler it makes. On a cloudpickle
    Pickler that assignment would land in the instance ``__dict__`` (cloudpickle defines a
    class-level table that shadows the C field), torch's tensor reducer would be ignored,
    and tensors would be copied into the pickle. The property writes the C field instead,
    merged over cloudpickle's own reducers (code objects, cells, ...).
    """

    def __init__(self, file: Any, protocol: int | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self.out = file  # the pickle's size, for a recorded call (nbrpc._wire.recording)
        self.dispatch_table = {}

    def reducer_override(self, obj: Any) -> Any:
        if not issubclass(type(obj), type) and not isinstance(obj, FunctionType):
            # cloudpickle's answer too, for all but these two (asked as cloudpickle asks
            # it: isinstance, which an object's __class__ can answer)
            return NotImplemented
        if id(obj) in _pickling.by_reference:
            return NotImplemented  # pickle's own save_global: by reference
        reduced = super().reducer_override(obj)
        if reduced is NotImplemented and (isinstance(obj, (FunctionType, type))):
            if len(_pickling.by_reference) >= _BY_REFERENCE_KEEP:
                _pickling.by_reference.clear()
                _pickling.heads.clear()
            _pickling.by_reference[id(obj)] = obj
        return reduced

    def _dynamic_function_reduce(self, func: FunctionType) -> Any:
        """cloudpickle's reduction of a function sent by value; one from the notebook's
        ``__main__`` gets the worker's namespace as its globals (:mod:`.namespace`).

        cloudpickle's hook, private: ``(make, (code, globals, ...), (state, slotstate),
        ...)`` with the names the function reads in ``slotstate["__globals__"]``
        (pinned in tests/test_pickling.py)."""
        reduced = super()._dynamic_function_reduce(func)
        if not namespace.is_notebook_function(func):
            return reduced
        make, (code, base, *args), (state, slotstate), *rest = reduced
        slotstate["__globals__"] = _Arriving(slotstate["__globals__"])
        return (make, (code, _MainGlobals(base), *args), (state, slotstate), *rest)

    def dump(self, obj: Any) -> None:
        _notice_by_value()
        func = _torch.udf_function(obj)
        sent, message = obj, None
        if func is not None:
            # A call names its caller (nbrpc._wire.recording): every user call, and any call
            # whose reply may come through shared memory (only some peers share it here)
            user = callee.is_user_call(func)
            reply = shm.restricted() and shm.sending() == "call"
            if user or reply:
                sent, message = recording.outgoing(obj, _process.name(), reply, user)
        elif recording.active() is not None:  # a reply, of a call recorded here?
            message = recording.message_for(obj)
        try:
            with shm.pickling(obj):
                super().dump(sent)
        except (SerializationError, NotLane, DeviceMapError):
            raise
        except Exception as exc:
            raise SerializationError(unsendable.cannot_send(obj, exc)) from exc
        if message is not None:
            recording.pickled(message, self.out.tell())

    @property
    def dispatch_table(self) -> dict:
        try:
            return _C_DISPATCH_TABLE.__get__(self)
        except AttributeError:  # during the C __init__, before the setter ran
            return _BASE_TABLE

    @dispatch_table.setter
    def dispatch_table(self, table: dict) -> None:
        # A flat merged dict, not a ChainMap: the C pickler looks every object's type up
        # in this table, and a plain dict lookup is far cheaper. torch's entries win,
        # except for RRefs, which the ledger reduces (the same fork data, plus a label).
        merged = {**_BASE_TABLE, **table, **_RREF_TABLE}
        if shm.enabled() and torch.Tensor in merged:  # large CPU tensors: shared memory
            merged[torch.Tensor] = shm.make_reducer(merged[torch.Tensor])
        if recording.active() is not None and torch.Tensor in merged:  # bytes, path
            merged[torch.Tensor] = recording.counted(merged[torch.Tensor])
        if _pickling.refusal is not None and torch.Tensor in merged:
            merged[torch.Tensor] = _refusing(merged[torch.Tensor])
        _C_DISPATCH_TABLE.__set__(self, _DispatchTable(merged))


#: tensor types whose reduction reaches the lanes' tensor reducer (a Parameter's by its
#: ``.data``, a plain tensor): what a lane may carry
_REDUCED_BY_DATA = (torch.Tensor, torch.nn.Parameter)


class LanePickler(RpcPickler):
    """:class:`RpcPickler` with the reducers it is given, over cloudpickle's and nbrpc's
    base (:func:`over_base_table`), nothing merged in per message: the lanes' pickler
    (:mod:`nbrpc._wire.lanes`), which puts small tensors in the pickle itself."""

    #: what the C pickler reads while it is made (the real table is set right after): a
    #: plain attribute, not :class:`RpcPickler`'s property (2 µs a message, measured)
    dispatch_table = _BASE_TABLE

    def __init__(self, file: Any, table: dict, keep_functions: bool = True) -> None:
        cloudpickle.Pickler.__init__(self, file, protocol=5)
        self.out, self.table, self.keep_functions = file, table, keep_functions
        _C_DISPATCH_TABLE.__set__(self, table)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj) not in _REDUCED_BY_DATA:
            # a subclass's own reduction would copy its storage, a CUDA one to the same
            # device index there (no device map): TensorPipe's pickling sends those
            raise OnDevice(obj.device) if not obj.is_cpu else NotLane
        if self.keep_functions and namespace.is_notebook_function(obj):
            kept = sent_functions.reduce(
                obj, _by_reference, self._alone, _pickling.by_value_seen
            )  # a notebook function sent call after call: its pickle, made once
            if kept is not None:
                return kept
        return RpcPickler.reducer_override(self, obj)

    def dump_as_is(self, obj: Any) -> None:
        """Pickle ``obj`` with no header added (a lane's call carries its own)."""
        _notice_by_value()
        cloudpickle.Pickler.dump(self, obj)

    def _alone(self, func: FunctionType) -> bytes:
        out = io.BytesIO()
        cloudpickle.Pickler.dump(LanePickler(out, self.table, keep_functions=False), func)
        return out.getvalue()


def _notice_by_value() -> None:
    """After ``register_pickle_by_value``, what was found importable is asked again."""
    if len(_BY_VALUE_MODULES) != _pickling.by_value_seen:
        _pickling.by_reference.clear()
        _pickling.heads.clear()
        _pickling.by_value_seen = len(_BY_VALUE_MODULES)


def _by_reference(obj: Any) -> bool:
    """Whether ``obj`` (a class or function) was found importable: pickled by name."""
    return _pickling.by_reference.get(id(obj)) is obj


def over_base_table(table: dict) -> dict:
    """``table`` over the reducers every nbrpc pickle uses (code objects, methods, ...)."""
    return {**_BASE_TABLE, **table}


#: What a pickle by reference would record as a name: no tensors are found inside them.
_NAMED_ONLY = (type, FunctionType, BuiltinFunctionType, ModuleType, CodeType)


class TensorFinder(_torch.TENSOR_EXTRACTOR):
    """torch's tensor-listing pickler, for values that hold notebook classes and lambdas.

    The standard library pickles a class or function as its importable name, so torch's
    own pickler never looks inside one; it only fails when the name does not resolve,
    which is the case for everything defined in a notebook and sent by value. Answering
    ``""`` (a persistent id) for those types skips the lookup and keeps the search the
    same: an instance's own state, where tensors live, is still walked.
    """

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _NAMED_ONLY):
            return ""
        return super().persistent_id(obj)


def refuse_devices(reason: str | None) -> None:
    """While ``reason`` is set, a tensor on a device (CUDA's; any but the CPU) in a call or
    reply this process pickles is a :class:`~nbrpc.DeviceMapError` saying ``reason``.

    The kernel sets it while it lends no device to the cluster, though its first join left
    device maps in torch's options (:mod:`nbrpc._kernel_devices`): torch would map such a
    tensor, then find no CUDA stream for it and raise only after counting the call as
    active, and a count that never drops makes the kernel's leave wait forever. Refused
    here, the call fails before torch sees it. What skips this pickler (builtins sent as
    TorchScript operators, TorchScript functions) is checked by :func:`refuse_here`."""
    _pickling.refusal = reason


def refuse_here(arguments: tuple) -> None:
    """Raise :func:`refuse_devices`'s error if one of ``arguments`` (a builtin's or a
    TorchScript function's: tensors, or lists and tuples of them) is on a device."""
    if _pickling.refusal is None:
        return
    for arg in arguments:
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor) and not item.is_cpu:
                raise _refused(item)


def _refusing(reduce: Any) -> Any:
    def reduce_tensor(tensor: torch.Tensor) -> Any:
        if not tensor.is_cpu:
            raise _refused(tensor)
        return reduce(tensor)

    return reduce_tensor


def _refused(tensor: torch.Tensor) -> DeviceMapError:
    return DeviceMapError(f"{_pickling.refusal} This call holds a tensor on {tensor.device}.")


def devices_of(obj: Any) -> set[torch.device]:
    """The devices of the tensors ``obj`` holds, found as torch finds a CUDA-aware
    reply's tensors (:class:`TensorFinder`); empty if it cannot be walked."""
    tensors: list[torch.Tensor] = []
    try:
        TensorFinder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL, tensors=tensors).dump(obj)
    except Exception:
        return set()
    return {t.device for t in tensors}


def install() -> None:
    """Route torch RPC's pickling and remote-call wrapper through nbrpc (idempotent).

    Runs in the kernel and in every worker before ``init_rpc``.
    """
    if _pickling.installed:
        return
    _pickling.installed = True
    _torch.install_rpc_hooks(
        RpcPickler, callee.run_function, failures.handle_exception, cancelling.sends_held
    )
    _torch.install_tensor_extractor(TensorFinder)
    _ledger.install()


def serialize(obj: Any) -> tuple[bytes, list]:
    """Pickle ``obj`` exactly as an RPC would: returns ``(pickle_bytes, tensor_table)``.

    Tensors appear in the table, not in the bytes: the table travels beside the pickle.
    """
    return _torch.default_pickler().serialize(obj)


def register_by_value(module: ModuleType) -> None:
    """Ship a local helper module's code by value, for workers that cannot import it.

    Thin wrapper over ``cloudpickle.register_pickle_by_value``; call it in the kernel,
    before the calls that use ``module`` (an imported module object, e.g. a helper file
    next to the notebook). Raises ``ValueError`` (cloudpickle's) for an object that is not
    an imported module.
    """
    cloudpickle.register_pickle_by_value(module)  # RpcPickler.dump then forgets its memo


# -- what a lane's call starts with (:mod:`nbrpc._wire.lanes.messages`) ---------------------


def function_head(func: Any) -> bytes | None:
    """The pickle a lane call of ``func`` starts with, made once: a notebook function's
    kept reduction (:func:`.sent_functions.head`), or an importable function by name
    (found so by an earlier pickle: the first call of one is pickled whole). None: the
    call is pickled whole."""
    _notice_by_value()
    if namespace.is_notebook_function(func):
        return sent_functions.head(func, _by_reference, _kept_head, _pickling.by_value_seen)
    kept = _pickling.heads.get(id(func))
    if kept is not None and kept[0] is func:
        return kept[1]
    if not _by_reference(func) or type(func) is not FunctionType:
        return None
    head = pickle.dumps(func, protocol=5)
    _pickling.heads[id(func)] = func, head
    return head


def _kept_head(func: FunctionType) -> bytes:
    out = io.BytesIO()
    LanePickler(out, _BASE_TABLE).dump_as_is(func)  # (no tensor: none is kept)
    return out.getvalue()
