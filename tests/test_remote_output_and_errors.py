"""Remote print() shows in the caller, marked; remote exceptions keep type and source."""

import threading

import pytest
import torch

import nbrpc

pytestmark = pytest.mark.usefixtures("cluster")

CELL = """
import sys
import torch
import torch.distributed.rpc as rpc

def chatty(n):
    for i in range(n):
        print(f"step {i}")
    print("to stderr", file=sys.stderr)
    print("no newline", end="")
    return n

def relay():
    return rpc.rpc_sync("worker2", chatty, args=(1,))

def divide(a, b):
    ratio = a / b
    return ratio

class ModelError(Exception):
    pass

def raise_custom():
    raise ModelError("loss is nan at step 7")

class NeedsTwoArgs(Exception):
    def __init__(self, code, text):
        super().__init__(code, text)
        self.code = code

def raise_two_args():
    raise NeedsTwoArgs(3, "bad")

def raise_unpicklable():
    import threading
    err = ValueError("holds a lock")
    err.lock = threading.Lock()
    raise err

def sleepy(seconds):
    import time
    time.sleep(seconds)
    return seconds

def make_lock():
    import threading
    return threading.Lock()
"""


@pytest.fixture(scope="module")
def cell():
    from conftest import notebook_code

    return notebook_code(CELL)


def test_print_arrives_marked_before_the_result(cell, capfd):
    assert nbrpc.rpc_sync("worker1", cell.chatty, args=(50,)) == 50
    out, err = capfd.readouterr()
    expected = "".join(f"[worker1] step {i}\n" for i in range(50)) + "[worker1] no newline\n"
    assert expected in out  # every line, in order, the unterminated one last
    assert "[worker1] to stderr\n" in err


def test_nested_call_output_reaches_the_kernel(cell, capfd):
    assert nbrpc.rpc_sync("worker1", cell.relay) == 1
    out, _ = capfd.readouterr()
    assert "[worker2] step 0" in out


def test_exception_keeps_type_and_shows_notebook_line(cell):
    with pytest.raises(ZeroDivisionError) as info:
        nbrpc.rpc_sync("worker1", cell.divide, args=(1, 0))
    exc = info.value
    assert exc.worker == "worker1"
    assert "ratio = a / b" in exc.remote_traceback  # the notebook source line
    assert "in divide" in exc.remote_traceback
    assert any("ratio = a / b" in note for note in exc.__notes__)


def test_notebook_defined_exception_class_is_rebuilt(cell):
    with pytest.raises(cell.ModelError, match="loss is nan at step 7"):
        nbrpc.rpc_sync("worker2", cell.raise_custom)


def test_exception_with_custom_constructor(cell):
    with pytest.raises(cell.NeedsTwoArgs) as info:
        nbrpc.rpc_sync("worker1", cell.raise_two_args)
    assert info.value.code == 3


def test_unpicklable_exception_keeps_its_type(cell):
    with pytest.raises(ValueError, match="holds a lock") as info:
        nbrpc.rpc_sync("worker1", cell.raise_unpicklable)
    assert info.value.worker == "worker1"


def test_exception_through_rpc_async(cell):
    fut = nbrpc.rpc_async("worker2", cell.divide, args=(1, 0))
    with pytest.raises(ZeroDivisionError):
        fut.wait()


def test_plain_torch_call_raises_the_workers_exception(cell):
    """After init, torch's spelling is routed to nbrpc's (seed code calls rpc.rpc_sync):
    the worker's exception arrives with its type, as from nbrpc.rpc_sync."""
    import torch.distributed.rpc as rpc

    with pytest.raises(ZeroDivisionError, match="division by zero") as info:
        rpc.rpc_sync("worker1", cell.divide, args=(1, 0))
    assert info.value.worker == "worker1"
    with pytest.raises(ZeroDivisionError):
        rpc.rpc_async("worker1", cell.divide, args=(1, 0)).wait()


def test_remote_failure_surfaces_on_to_here(cell):
    rref = nbrpc.remote("worker1", cell.divide, args=(1, 0))
    with pytest.raises(ZeroDivisionError) as info:
        rref.to_here()
    assert "ratio = a / b" in info.value.remote_traceback


def test_unknown_worker_names_the_known_ones(cell):
    with pytest.raises(nbrpc.UnknownWorkerError, match=r"'wroker1'.*worker0, worker1, worker2"):
        nbrpc.rpc_sync("wroker1", cell.divide, args=(1, 1))
    with pytest.raises(ValueError, match="nobody"):  # UnknownWorkerError is a ValueError
        nbrpc.remote("nobody", cell.divide, args=(1, 1))


def test_unpicklable_argument_and_return_value(cell):
    with pytest.raises(nbrpc.SerializationError, match="cannot send a call of divide"):
        nbrpc.rpc_sync("worker1", cell.divide, args=(threading.Lock(), 1))
    with pytest.raises(Exception, match="lock"):
        nbrpc.rpc_sync("worker1", cell.make_lock)
    assert nbrpc.rpc_sync("worker1", cell.divide, args=(4, 2)) == 2  # still usable


def test_timeout_names_call_and_worker(cell):
    with pytest.raises(
        nbrpc.RpcTimeoutError, match=r"call of sleepy on worker2 timed out after 0.5 s"
    ):
        nbrpc.rpc_sync("worker2", cell.sleepy, args=(3,), timeout=0.5)
    assert nbrpc.rpc_sync("worker2", cell.sleepy, args=(0,), timeout=5) == 0


def test_remote_errors_are_translated_like_rpc_sync(cell):
    slow = nbrpc.remote("worker1", cell.sleepy, args=(2,))
    with pytest.raises(nbrpc.RpcTimeoutError, match=r"to_here\(\) of an RRef on worker1.*0.3 s"):
        slow.to_here(timeout=0.3)
    assert slow.to_here() == 2  # the value still arrives


def test_init_twice_is_refused(cluster):
    with pytest.raises(nbrpc.AlreadyInitializedError, match=r"already running.*%rpc_shutdown"):
        nbrpc.init(n=1)
    assert nbrpc.current() is cluster


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ValueError, match="bad worker name"):
        nbrpc.Cluster(2, names=["ok", "not ok"])
    with pytest.raises(ValueError, match="unique"):
        nbrpc.Cluster(2, names=["a", "a"])
    with pytest.raises(ValueError, match="-n must be at least 1"):
        nbrpc.Cluster(0)
    with pytest.raises(ValueError, match="does not match"):
        nbrpc.Cluster(3, names=["a", "b"])


def test_tensor_result_values(cell):
    t = torch.arange(10.0)
    assert torch.equal(nbrpc.rpc_sync("worker1", cell.divide, args=(t, 2)), t / 2)
