"""How notebook code and tensors are pickled for RPC (no workers needed)."""

import pickle

import pytest
import torch
from torch.distributed.rpc.internal import PythonUDF

from nbrpc import SerializationError, _torch
from nbrpc._wire import pickling, sent_code, shm


@pytest.fixture(autouse=True)
def _installed():
    pickling.install()


def test_notebook_function_travels_by_value(nb):
    cell = nb("OFFSET = 5\ndef add(x):\n    return x + OFFSET\n")
    data, tensors = pickling.serialize(PythonUDF(cell.add, (1,), {}))
    udf = pickle.loads(data)
    assert udf.func(1) == 6
    assert tensors == []


def test_lambda_and_closure_travel(nb):
    cell = nb("def make(k):\n    return lambda x: x * k\n")
    data, _ = pickling.serialize(PythonUDF(cell.make(7), (3,), {}))
    assert pickle.loads(data).func(3) == 21


def test_tensors_stay_out_of_band(monkeypatch):
    monkeypatch.setattr(shm, "enabled", lambda: False)  # torch's own path (no fast path)
    big = torch.randn(1_000_000)  # 4 MB
    view = big[::2]  # non-contiguous
    data, tensors = pickling.serialize(PythonUDF(len, (big, view, {"x": big}), {}))
    assert len(data) < 2_000, "tensor data leaked into the pickle"
    assert len(tensors) == 2  # the repeated tensor is memoized, sent once
    assert tensors[0].data_ptr() == big.data_ptr()
    assert tensors[1].data_ptr() == view.data_ptr()


def test_notebook_module_subclass_keeps_parameters_out_of_band(nb):
    cell = nb(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(256, 256)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x)\n"
    )
    net = cell.Net()
    data, tensors = pickling.serialize(net)
    assert len(tensors) == 2  # weight and bias
    assert len(data) < 20_000
    assert sum(t.numel() for t in tensors) == 256 * 256 + 256


def test_unpicklable_argument_names_the_call_and_the_fix():
    import threading

    def f(x):
        return x

    with pytest.raises(SerializationError, match=r"cannot send a call of .*f over RPC.*lock"):
        pickling.serialize(PythonUDF(f, (threading.Lock(),), {}))


def test_code_is_marshalled_once_while_globals_travel_every_call(nb):
    cell = nb("OFFSET = 5\ndef add(x):\n    return x + OFFSET\n")
    first, _ = pickling.serialize(PythonUDF(cell.add, (1,), {}))
    key = sent_code.code_key(cell.add.__code__)
    cell.add.__globals__["OFFSET"] = 9  # a later cell changes the global
    second, _ = pickling.serialize(PythonUDF(cell.add, (1,), {}))
    assert sent_code.code_key(cell.add.__code__) == key  # the same code: one key
    got_first, got_second = pickle.loads(first).func, pickle.loads(second).func
    assert got_first(1) == 6
    assert got_second(1) == 10  # the changed global arrived
    assert got_second.__code__ is got_first.__code__  # the receiver kept the code
    cell2 = nb("def add(x):\n    return x - 1\n")  # redefined: new code, new key
    third, _ = pickling.serialize(PythonUDF(cell2.add, (1,), {}))
    assert pickle.loads(third).func(1) == 0


def test_a_module_registered_by_value_after_a_call_travels_by_value(tmp_path, monkeypatch):
    import sys

    import cloudpickle

    import nbrpc

    (tmp_path / "nbrpc_helper_mod.py").write_text("def twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import nbrpc_helper_mod

    by_ref, _ = pickling.serialize(PythonUDF(nbrpc_helper_mod.twice, (1,), {}))
    assert b"twice" in by_ref
    assert b"_load_code" not in by_ref
    nbrpc.register_by_value(nbrpc_helper_mod)
    try:
        by_value, _ = pickling.serialize(PythonUDF(nbrpc_helper_mod.twice, (1,), {}))
        assert b"_load_code" in by_value  # its code travels now
    finally:
        cloudpickle.unregister_pickle_by_value(nbrpc_helper_mod)
        sys.modules.pop("nbrpc_helper_mod", None)


def test_a_forked_process_sends_code_under_keys_of_its_own(nb):
    """Workers are forked from one zygote: with its keys, two workers sent different code
    under one key and the kernel rebuilt the wrong function (a full run found it)."""
    import os

    cell = nb("def one():\n    return 1\n")
    parent_key = sent_code.reduce_code(cell.one.__code__)[1][0]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same code object, as a forked worker would send it
        try:
            os.write(write_end, sent_code.reduce_code(cell.one.__code__)[1][0].encode())
        finally:
            os._exit(0)
    os.close(write_end)
    child_key = os.read(read_end, 200).decode()
    os.waitpid(pid, 0)
    os.close(read_end)
    assert child_key
    assert child_key.split(".")[0] == str(pid)
    assert child_key != parent_key


def test_cuda_aware_futures_find_tensors_in_notebook_objects(nb):
    """With device maps, torch lists every value's tensors with the standard pickler, which
    cannot name a notebook class; nbrpc's finder walks the same state and names none."""
    import io

    from torch import _jit_internal

    cell = nb(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(3, 2)\n"
        "        self.act = lambda x: x.relu()\n"
    )
    net, x = cell.Net(), torch.ones(3)
    value = {"model": net, "type": cell.Net, "fn": lambda: 0, "x": x, "n": [1, "a"]}
    with pytest.raises(pickle.PicklingError, match="Net"):  # torch's own, as it ships
        _torch.TENSOR_EXTRACTOR(io.BytesIO(), protocol=-1, tensors=[]).dump(value)
    found = _jit_internal._extract_tensors(value)  # what torch's C++ calls
    assert [t.data_ptr() for t in found] == [
        net.lin.weight.data_ptr(),
        net.lin.bias.data_ptr(),
        x.data_ptr(),
    ]
