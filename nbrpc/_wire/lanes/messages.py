"""A lane's messages (:mod:`nbrpc._wire.lanes`) as bytes: calls, replies, their tensors.

A call or reply pickles by nbrpc's pickler (:class:`nbrpc._wire.pickling.LanePickler`:
notebook code by value) with the lanes' reducers: small dense CPU tensors *in* the pickle
(storage, offset, size, stride), larger ones in shared memory where the cluster has it
(:func:`nbrpc._wire.shm.lend`: the pickle holds the slot's place; a message not sent
gives it back, :func:`unsent`), RRefs and torch's special classes refused
(:class:`NotLane`: TensorPipe carries that call). A small tensor on a CUDA device
that this process maps to the peer (:func:`place_by`) is *staged*: copied to this host's
memory as it is pickled (which waits for the work on this thread's stream that makes it)
and copied to the mapped device as it is unpickled there, on the thread that then runs the
call; a reply's, by the map back, which the call carries. Any other tensor on a device
(no map for it, or too large) raises :class:`OnDevice`: TensorPipe carries that message,
its device maps and CUDA-aware futures as without lanes. Where a message holds plain values only
(numbers, strings, plain tensors, small containers of them), the standard library's C
pickler takes it alone: a call's function then travels as a pickle made once
(:func:`nbrpc._wire.pickling.function_head`), its arguments and header after it.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import threading
from types import BuiltinFunctionType, ModuleType
from typing import Any

import torch

from nbrpc import _torch
from nbrpc._devices import canonical
from nbrpc._wire import pickling, recording, sent_functions, shm
from nbrpc._wire.callee import call_builtin

#: tensor storage bytes one lane message carries in its own bytes; a larger storage goes
#: through shared memory (:func:`nbrpc._wire.shm.lend`), where the cluster has it, else the
#: message through TensorPipe
LANE_TENSOR_BYTES = 1 << 16


NotLane, OnDevice = pickling.NotLane, pickling.OnDevice  # (raised while pickling)

#: this process's device maps, fixed at its join: peer name -> ({its device: the peer's},
#: the map back), the pair :func:`places_to` answers
_device_maps: dict[str, tuple[dict[str, str], dict[str, str]]] = {}


def place_by(device_maps: dict | None) -> None:
    """This process joined with ``device_maps`` (peer -> {device: device}): small CUDA
    tensors to those peers are staged through lanes by them (the module's docstring)."""
    _device_maps.clear()
    for peer, mapping in (device_maps or {}).items():
        there = {canonical(k): canonical(v) for k, v in mapping.items()}
        if there:
            _device_maps[peer] = there, {v: k for k, v in there.items()}


def places_to(peer: str) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """Where this process's CUDA tensors go on ``peer`` (its map to it), and where the
    peer's go here (the map back, for the reply); ``(None, None)`` with no map."""
    return _device_maps.get(peer, (None, None))


#: a dtype by the name it travels under (a string pickles without an import on arrival)
_DTYPE_NAMES: dict[torch.dtype, str] = {}
for _name in dir(torch):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _DTYPE_NAMES.setdefault(getattr(torch, _name), _name)


def _tensor(dtype: str | torch.dtype, data: bytes, offset: int, size: tuple, stride: tuple) -> Any:
    """Unpickling side of :func:`_reduce_tensor`: the tensor, on a storage of its own,
    as torch's RPC delivers one (not resizable). ``torch.frombuffer`` over a copy of the
    bytes: 0.7 µs, where a storage made and ``set_`` took 2.4-2.7 µs."""
    kind: torch.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not data or len(data) % kind.itemsize:  # no storage, or one another dtype made
        made = torch.empty(0, dtype=kind)
        if not data:
            return made.resize_(size)
        storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)
        return made.set_(storage, offset, size, stride)
    flat = torch.frombuffer(bytearray(data), dtype=kind)
    if offset == 0 and stride == (1,) and size[0] == flat.shape[0]:  # the whole storage
        return flat
    return flat.as_strided(size, stride, offset)


def staged(dtype: str | torch.dtype, data: bytes, size: tuple, stride: tuple, device: str) -> Any:
    """Unpickling side of :func:`stage`: the tensor, on ``device`` (the mapped one),
    copied there on this thread's current stream (the call then runs on it)."""
    return _tensor(dtype, data, 0, size, stride).to(device)


def stage(t: torch.Tensor, device: str) -> Any:
    """A small CUDA tensor in the pickle, for ``device`` on the other side: its elements
    copied to this host's memory now (the copy waits for the work queued on this thread's
    stream, as TensorPipe's send waits on that stream's event), contiguous."""
    nbytes = t.numel() * t.element_size()
    if not _dense(t) or not _counted(nbytes, t.untyped_storage().data_ptr()):
        raise OnDevice(t.device)  # TensorPipe's CUDA channel, its device maps
    host = t.detach().to("cpu").contiguous()
    data = ctypes.string_at(host.data_ptr(), nbytes) if nbytes else b""
    dtype = _DTYPE_NAMES.get(t.dtype, t.dtype)
    return staged, (dtype, data, tuple(host.shape), host.stride(), device)


def _reduce_tensor(t: torch.Tensor) -> Any:
    """A small dense CPU tensor, in the pickle: its whole storage, offset, size and stride
    (what TensorPipe sends too, so a view arrives as the same view). A CUDA tensor this
    message maps: staged (:func:`stage`)."""
    if not t.is_cpu:
        places = _lane_counted.places
        device = places.get(str(t.device)) if places is not None else None
        if device is None:
            raise OnDevice(t.device)
        return stage(t, device)
    if not _dense(t):
        raise NotLane
    storage = t.untyped_storage()
    nbytes, address = storage.nbytes(), storage.data_ptr()
    lent = _lane_counted.lent
    if address in lent or (
        _lane_counted.bytes + nbytes > LANE_TENSOR_BYTES and address not in _lane_counted.storages
    ):  # too large for the frame: through shared memory, if this cluster has it
        reduced = shm.lend(t, lent)
        if reduced is None:
            raise NotLane
        return reduced
    if not _counted(nbytes, address):
        raise NotLane
    data = ctypes.string_at(address, nbytes) if nbytes else b""
    dtype = _DTYPE_NAMES.get(t.dtype, t.dtype)
    return _tensor, (dtype, data, t.storage_offset(), tuple(t.shape), t.stride())


def _dense(t: torch.Tensor) -> bool:
    """A plain dense tensor: no grad, strided, not quantized, conjugated or negated
    (torch's pickling keeps those)."""
    return not (
        t.requires_grad or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
    )


def _counted(nbytes: int, address: int) -> bool:
    """Whether the message being pickled takes ``nbytes`` more of tensor storage (at
    ``address``), counted then: within :data:`LANE_TENSOR_BYTES` together, and a storage
    not already in it (two tensors share it: TensorPipe keeps them sharing)."""
    counted = _lane_counted.bytes + nbytes
    if counted > LANE_TENSOR_BYTES or (nbytes and address in _lane_counted.storages):
        return False
    _lane_counted.bytes = counted
    if nbytes:
        _lane_counted.storages.add(address)
    return True


def _refuse(obj: Any) -> Any:
    raise NotLane


class _LaneCounted(threading.local):
    """This thread's message being pickled: its tensor bytes and storages so far, and
    where its CUDA tensors go (None: no map to the peer, none is staged)."""

    bytes = 0
    storages: set[int]
    places: dict[str, str] | None = None
    #: storages of the message in shared memory (:func:`nbrpc._wire.shm.lend`)
    lent: dict[int, Any]

    def __init__(self) -> None:
        self.storages = set()
        self.lent = {}


_lane_counted = _LaneCounted()
_lane_tables: dict[bool, dict] = {}


def lane_reducers(recording_on: bool) -> dict:
    """The lane pickler's reducers: tensors in the pickle, RRefs and torch's special
    classes refused (``recording_on``: tensor bytes counted for the timeline)."""
    table = _lane_tables.get(recording_on)
    if table is None:
        tensor = recording.counted(_reduce_tensor, "lane") if recording_on else _reduce_tensor
        table = {torch.Tensor: tensor, _torch.PyRRef: _refuse, torch.distributed.rpc.RRef: _refuse}
        table[torch.jit.ScriptFunction] = _refuse  # torch's script call: TensorPipe's
        table.update(dict.fromkeys(_torch.custom_reducer_classes(), _refuse))
        table = _lane_tables[recording_on] = pickling.over_base_table(table)
    return table


_PLAIN_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_LEAVES = _PLAIN_ATOMS | {torch.Tensor}
#: the C pickler's tables, by whether a timeline records (then each tensor's bytes count)
_PLAIN_TABLES: dict[bool, dict[Any, Any]] = {
    False: {torch.Tensor: _reduce_tensor},
    True: {torch.Tensor: recording.counted(_reduce_tensor, "lane")},
}


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` holds only numbers, strings, bytes, None, plain tensors, and small
    tuples, lists and dicts of these: what the standard library's C pickler pickles as
    nbrpc's would (no class or function in it, by value or not)."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES:
        return True
    if depth > 3 or kind not in (tuple, list, dict) or len(obj) > 32:
        return False
    # loops, not all(<generator>): asked of every call's arguments and every reply
    if kind is dict:
        for key, value in obj.items():
            if type(key) not in _PLAIN_ATOMS:
                return False
            if type(value) not in _PLAIN_LEAVES and not _plain(value, depth + 1):
                return False
        return True
    for item in obj:
        if type(item) not in _PLAIN_LEAVES and not _plain(item, depth + 1):
            return False
    return True


def plain_call(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments are plain (:func:`_plain`); a builtin sent as a Python
    call (``call_builtin(op, args, kwargs)``) may name its operator: a module's builtin
    (``math.sqrt``), or one of torch's (``torch.add``, whose ``__self__`` is None), which
    the C pickler, like nbrpc's, pickles by name (an operator bound to an object would
    carry that object)."""
    if func is call_builtin and len(args) == 3:
        op, args, kwargs = args[0], args[1], args[2] or {}
        if type(op) is not BuiltinFunctionType or (
            op.__self__ is not None and type(op.__self__) is not ModuleType
        ):
            return False
    return _plain(args) and _plain(kwargs)


#: a lane call's first bytes: the length of the function's own pickle (0: none, the
#: call is one pickle)
_HEAD = struct.Struct("<I")


def lane_call(
    func: Any, args: tuple, kwargs: dict, header: Any, peer: str = "", stage: bool = True
) -> bytes:
    """A call pickled for a lane. Where its arguments are plain values and its function
    has a pickle made once (:func:`nbrpc._wire.pickling.function_head`), that pickle,
    then ``(args, kwargs, header)`` by the standard library's C pickler alone (a notebook
    function's call of a 1-element tensor: 11 -> 3 µs, measured): nbrpc's pickler, a
    cloudpickle Pickler, runs Python code for every tuple, dict and tensor in a call;
    recorded, its tensors' bytes are counted as they are pickled. Else ``(func, args,
    kwargs, header)`` in one pickle by :class:`LanePickler`. ``peer``: the callee's name;
    where this process maps devices to it, the call carries the map back for its reply
    (last in the tuple; None without one), and with ``stage`` its own small CUDA tensors
    are staged (a synchronous call: the copy to host memory waits for the tensor's stream,
    which an ``rpc_async`` must not; without, they refuse the lane, :class:`OnDevice`).
    Raises where the call cannot take a lane (:class:`NotLane`, or a pickling error)."""
    recording_on = recording.active() is not None
    places, back = places_to(peer) if _device_maps else (None, None)
    if not stage:
        places = None
    head = pickling.function_head(func) if plain_call(func, args, kwargs) else None
    if head is not None:
        return _plain_pickle(
            (args, kwargs, header, back), head, _PLAIN_TABLES[recording_on], places
        )
    out = lane_message(places)
    out.write(_HEAD.pack(0))
    pickler = pickling.LanePickler(out, lane_reducers(recording_on))
    pickler.dump_as_is((func, args, kwargs, header, back))
    return out.getvalue()


def lane_call_of(payload: Any) -> tuple[Any, tuple, dict, Any, dict[str, str] | None]:
    """The callee's side of :func:`lane_call`: ``(func, args, kwargs, header, back)``,
    staged CUDA tensors on their mapped devices already."""
    (size,) = _HEAD.unpack_from(payload)
    if not size:
        return pickle.loads(payload[_HEAD.size :])
    func = sent_functions.from_head(payload[_HEAD.size : _HEAD.size + size])
    args, kwargs, header, back = pickle.loads(payload[_HEAD.size + size :])
    return func, args, kwargs, header, back


def lane_dumps(obj: Any, places: dict[str, str] | None = None) -> bytes:
    """``obj`` (a reply) pickled for a lane (nbrpc's pickler: notebook code by value);
    raises when it cannot take one (:class:`NotLane`, or any pickling error). A plain
    value takes the C pickler alone (12 -> 3 µs for a small tensor). ``places``: the
    call's map back (its small CUDA tensors are staged by it)."""
    recording_on = recording.active() is not None
    if _plain(obj):
        # recorded: the row's, where its tensors and bytes are counted
        message = recording.message_for(obj) if recording_on else None
        data = _plain_pickle(obj, b"", _PLAIN_TABLES[recording_on], places)
        if message is not None:
            recording.pickled(message, len(data))
        return data
    out = lane_message(places)
    pickling.LanePickler(out, lane_reducers(recording_on)).dump(obj)
    return out.getvalue()


class _PlainPickler(threading.local):
    """This thread's C pickler of plain messages and its buffer, made once: making a
    pickler costs about as much as pickling a small call with it."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.pickler = pickle.Pickler(self.out, protocol=5)  # its table: set per message


_plain_pickler = _PlainPickler()


def _plain_pickle(
    obj: Any, head: bytes, table: dict, places: dict[str, str] | None = None
) -> bytes:
    """``obj`` by the C pickler (plain values: :func:`_plain`) after ``head`` (a call's:
    its length and its function's pickle; a reply: none), its tensors by ``table``
    (CUDA ones staged by ``places``)."""
    _forget_counted(places)
    kept = _plain_pickler
    out, pickler = kept.out, kept.pickler
    out.seek(0)
    out.truncate()
    pickler.dispatch_table = table
    if head:
        out.write(_HEAD.pack(len(head)))
        out.write(head)
    try:
        pickler.dump(obj)
    finally:
        pickler.clear_memo()  # it holds what it pickled: the call's arguments
    return out.getvalue()


def lane_message(places: dict[str, str] | None = None) -> io.BytesIO:
    """A new message's buffer; the tensors :func:`_reduce_tensor` counted are forgotten
    (``places``: where its CUDA tensors go, :func:`stage`)."""
    _forget_counted(places)
    return io.BytesIO()


def _forget_counted(places: dict[str, str] | None = None) -> None:
    """A new message: no tensor of it counted yet (:func:`_reduce_tensor`), its CUDA
    tensors staged by ``places`` (None: none is)."""
    _lane_counted.bytes = 0
    _lane_counted.storages.clear()
    _lane_counted.lent = {}  # (the last message's: sent, or given back by unsent())
    _lane_counted.places = places


def unsent() -> None:
    """The message this thread pickled last will not be sent (no lane took it, or it is
    too large for a frame): the shared memory its large tensors took is free again."""
    shm.take_back(_lane_counted.lent)
