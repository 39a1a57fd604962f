"""What a lane's pickle carries, and what it refuses (nbrpc/_wire/lanes/messages.py, the lanes'
messages): no process."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from nbrpc._wire.lanes import messages


def _round_trip(value):
    return pickle.loads(messages.lane_dumps(value))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(1),
        torch.arange(12.0).reshape(3, 4).T,  # a transposed view
        torch.arange(12.0)[3:7],  # an offset into its storage
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor(7),
        torch.zeros(0),
        torch.zeros(2, 0, 3),
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, ::2],
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.stride()}",
)
def test_a_tensor_arrives_as_the_same_view_of_its_own_storage(tensor):
    got = _round_trip(tensor)
    assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
        tensor.dtype,
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
    )
    assert torch.equal(got, tensor)
    if got.numel():
        assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "value",
    [
        torch.ones(2, requires_grad=True),
        torch.ones(messages.LANE_TENSOR_BYTES // 4 + 1),  # more storage bytes than a lane takes
        torch.ones(4).to_sparse(),
        pytest.param("quantized", id="quantized"),
        torch.ones(2, dtype=torch.complex64).conj(),
    ],
    ids=["requires_grad", "large", "sparse", "quantized", "conj"],
)
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.usefixtures("no_cluster")  # a cluster's shared memory would carry the large one
def test_what_torch_must_carry_is_refused(value):
    if isinstance(value, str):  # made here: its creation warns that it is deprecated
        value = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(Exception):  # noqa: B017, PT011 (NotLane, or the pickler's wrapper of it)
        messages.lane_dumps(value)


def test_a_parameter_takes_its_own_reduction_as_in_torchs_pickler():
    """torch's RPC pickler reduces ``torch.Tensor`` by exact type, so a Parameter goes by its
    ``__reduce_ex__`` (its ``.data``, a plain tensor, then ``requires_grad``) there too."""
    got = _round_trip(torch.nn.Parameter(torch.ones(2)))
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad
    assert torch.equal(got.detach(), torch.ones(2))


def test_two_tensors_sharing_a_storage_are_left_to_torch_which_keeps_them_sharing():
    base = torch.arange(8.0)
    with pytest.raises(Exception):  # noqa: B017, PT011
        messages.lane_dumps((base[:4], base[4:]))
    same = base[:4]
    a, b = _round_trip((same, same))  # one tensor twice: pickle's memo, one object
    assert a is b


def test_an_rref_is_refused_before_torch_forks_it():
    from torch.distributed.rpc import RRef

    assert RRef in messages.lane_reducers(False)
    with pytest.raises(messages.NotLane):
        messages.lane_reducers(False)[RRef](object())


def test_a_small_message_is_small():
    assert len(messages.lane_dumps({"x": torch.ones(1), "n": 3})) < 400


class _Subclass(torch.Tensor):
    pass


def test_a_device_tensor_is_refused_as_such_wherever_it_sits_in_a_reply():
    """What a GPU cluster's callee keeps for TensorPipe with its stream recorded ("meta"
    stands in for CUDA): inside containers nbrpc's pickler walks, not only plain ones."""
    import collections

    meta = torch.empty(1, device="meta")
    pair = collections.namedtuple("pair", "a b")
    for reply in (meta, (meta,), pair(meta, 1), [meta] * 40, torch.nn.Parameter(meta)):
        with pytest.raises(messages.OnDevice) as refused:
            messages.lane_dumps(reply)
        assert refused.value.device.type == "meta"


def test_a_tensor_subclass_goes_through_torchs_pickling():
    """Its own reduction would copy its storage into the lane (a CUDA one to the same
    device index, past the device maps)."""
    with pytest.raises(messages.NotLane):
        messages.lane_dumps((torch.ones(2).as_subclass(_Subclass),))
    with pytest.raises(messages.OnDevice):
        messages.lane_dumps((torch.empty(2, device="meta").as_subclass(_Subclass),))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(1),
        torch.arange(12.0).reshape(3, 4).T,  # a transposed view: its elements, in order
        torch.arange(12.0)[3:7],  # an offset into its storage: the elements alone
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor(7),
        torch.zeros(2, 0, 3),
    ],
)
def test_a_staged_tensor_arrives_equal_on_the_device_its_map_names(tensor):
    """The staging codec of small CUDA tensors (``stage`` / ``staged``), run here on CPU
    tensors: on a GPU the same code copies to host memory and on to the mapped device."""
    reduced, args = messages.stage(tensor, "cpu")
    got = reduced(*args)
    assert got.device.type == "cpu"
    assert got.dtype == tensor.dtype
    assert got.shape == tensor.shape
    assert torch.equal(got, tensor)
    assert got.is_contiguous()


def test_staging_refuses_what_torchs_pickling_must_carry():
    """requires_grad, sparse, a storage already in the message, or over the lane's bytes:
    TensorPipe carries the message (OnDevice), its device maps and futures as torch's."""
    messages.lane_message({"cpu": "cpu"})  # a new message
    with pytest.raises(messages.OnDevice):
        messages.stage(torch.ones(2, requires_grad=True), "cpu")
    with pytest.raises(messages.OnDevice):
        messages.stage(torch.ones(2).to_sparse(), "cpu")
    base = torch.arange(8.0)
    messages.stage(base[:4], "cpu")
    with pytest.raises(messages.OnDevice):  # the same storage twice: it stays shared there
        messages.stage(base[4:], "cpu")
    messages.lane_message({"cpu": "cpu"})
    with pytest.raises(messages.OnDevice):
        messages.stage(torch.ones(messages.LANE_TENSOR_BYTES // 4 + 1), "cpu")


def test_a_call_carries_the_map_back_for_its_reply_only_to_a_peer_it_maps():
    """``place_by`` (set at the join) decides: to a mapped peer, the call's last element is
    the map back (where the reply's CUDA tensors go); to another, None. A device tensor
    no map places is refused as before ("meta" stands in for CUDA)."""
    try:
        messages.place_by({"worker1": {"cuda:0": "cuda:1"}, "worker2": {0: 0}})
        assert messages.places_to("worker1") == ({"cuda:0": "cuda:1"}, {"cuda:1": "cuda:0"})
        assert messages.places_to("worker2") == ({"cuda:0": "cuda:0"}, {"cuda:0": "cuda:0"})
        assert messages.places_to("worker3") == (None, None)
        for peer, back in (("worker1", {"cuda:1": "cuda:0"}), ("worker3", None)):
            payload = messages.lane_call(torch.add, (torch.ones(1), 1), {}, None, peer)
            *_, got = messages.lane_call_of(payload)
            assert got == back
        with pytest.raises(messages.OnDevice):  # no map names "meta"
            messages.lane_call(torch.add, (torch.empty(1, device="meta"), 1), {}, None, "worker1")
    finally:
        messages.place_by(None)
    assert messages.places_to("worker1") == (None, None)


def test_while_the_kernel_lends_no_device_a_tensor_on_one_is_refused_before_torch_sees_it():
    """(nbrpc/_wire/pickling.py, ``refuse_devices``) torch would map such a tensor by the
    maps the kernel's first join fixed, find no CUDA stream, and fail only after counting
    the call as active (the kernel's leave would wait for it forever). ``meta`` is a
    device's tensor on any machine."""
    from nbrpc._errors import DeviceMapError
    from nbrpc._wire import pickling

    pickling.install()
    on_device = torch.ones(2, device="meta")
    pickling.refuse_here((on_device,))  # nothing refused by default
    pickling.refuse_devices("no maps here.")
    try:
        with pytest.raises(
            DeviceMapError, match=r"^no maps here\. This call holds a tensor on meta"
        ):
            pickling.serialize({"x": [1, on_device]})
        _, table = pickling.serialize({"x": [1, torch.ones(2)]})  # CPU tensors still go
        assert len(table) == 1
        for arguments in ((1, on_device), ([torch.ones(1), on_device],)):
            with pytest.raises(DeviceMapError, match="tensor on meta"):
                pickling.refuse_here(arguments)  # a builtin's or TorchScript's arguments
        pickling.refuse_here((torch.ones(1), [torch.ones(1)], 3))
    finally:
        pickling.refuse_devices(None)
    _, table = pickling.serialize(on_device)
    assert table[0].device.type == "meta"


@pytest.mark.parametrize("op", [torch.add, math.sqrt], ids=["torch.add", "math.sqrt"])
def test_a_builtins_call_of_plain_values_takes_the_c_picklers_path_and_arrives_whole(op):
    """torch's operators (``__self__`` None) and a module's builtins pickle by name with
    the standard library's C pickler, as with nbrpc's: ``torch.add(t, 1)`` skips the
    Python pickler (measured: 58 -> 19 µs to pickle the call, 22 -> 14 µs to read it)."""
    from nbrpc._wire.callee import call_builtin

    sent = (op, (torch.ones(1), 1) if op is torch.add else (4.0,), None)
    assert messages.plain_call(call_builtin, sent, {})
    func, args, kwargs, _, _ = messages.lane_call_of(
        messages.lane_call(call_builtin, sent, {}, None)
    )
    assert func is call_builtin
    assert args[0] is op
    assert kwargs == {}
    assert call_builtin(*args) == call_builtin(*sent)


def test_a_builtin_bound_to_an_object_takes_nbrpcs_pickler():
    """``[].append``: the C pickler would carry its list by value, nbrpc's decides."""
    from nbrpc._wire.callee import call_builtin

    assert not messages.plain_call(call_builtin, ([].append, (1,), None), {})
