"""Calls from the kernel to real workers, with code defined the notebook way."""

import gc
import math
import sys
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import steady, wait_until

import nbrpc

pytestmark = pytest.mark.usefixtures("cluster")

CELL = """
import torch

SCALE = 3

def remote_add(to_add, value):
    return to_add + value

def scaled(x):
    return x * SCALE

def make_adder(k):
    def add(x):
        return x + k
    return add

class Counter:
    def __init__(self, start=0):
        self.value = start
    def add(self, k):
        self.value += k
        return self.value
    def get(self):
        return self.value

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.lin(x)

def make_net(seed):
    torch.manual_seed(seed)
    return Net()

def call_with(fn, x):
    return fn(x)
"""


@pytest.fixture(scope="module")
def cell():
    from conftest import notebook_code

    return notebook_code(CELL)


def test_workers_lists_kernel_first(cluster):
    assert nbrpc.workers() == ["worker0", "worker1", "worker2"]
    assert [r.name for r in cluster.workers] == ["worker0", "worker1", "worker2"]
    assert cluster.workers[0].role == "kernel"
    assert len({r.pid for r in cluster.workers}) == 3


def test_rpc_sync_notebook_function(cell):
    out = nbrpc.rpc_sync("worker1", cell.remote_add, args=(torch.tensor(1), torch.tensor(2)))
    assert out.item() == 3


def test_function_reads_notebook_global(cell):
    assert nbrpc.rpc_sync("worker2", cell.scaled, args=(torch.ones(2),)).tolist() == [3.0, 3.0]


def test_lambda_and_closure(cell):
    assert nbrpc.rpc_sync("worker1", lambda a, b: a * b, args=(6, 7)) == 42
    assert nbrpc.rpc_sync("worker2", cell.make_adder(10), args=(5,)) == 15


def test_function_as_argument_and_return_value(cell):
    assert nbrpc.rpc_sync("worker1", cell.call_with, args=(lambda x: x - 1, 10)) == 9
    adder = nbrpc.rpc_sync("worker2", cell.make_adder, args=(100,))
    assert adder(1) == 101


def test_rpc_async_futures(cell):
    futs = [nbrpc.rpc_async(f"worker{1 + i % 2}", cell.remote_add, args=(i, 1)) for i in range(20)]
    assert [f.wait() for f in futs] == [i + 1 for i in range(20)]
    assert torch.futures.wait_all(futs[:3]) == [1, 2, 3]


def test_wait_all_returns_at_the_first_error_as_torch_says(cluster):
    """torch.futures.wait_all: the first error as soon as it happens, not after the slow
    call (torch's own collect_all would wait for all)."""

    def slow(seconds):
        time.sleep(seconds)
        return seconds

    def fails():
        raise ValueError("Expected error")

    t0 = time.monotonic()
    slow_call = rpc.rpc_async("worker1", slow, args=(5,))
    with pytest.raises(ValueError, match="Expected error"):
        torch.futures.wait_all([slow_call, rpc.rpc_async("worker2", fails)])
    assert time.monotonic() - t0 < 4, "it waited for the slow call"
    assert slow_call.wait() == 5  # the cluster is left as it was found


def test_torchs_wait_all_block_lists_rpc_async_futures_only_and_sees_timeouts(cluster):
    """torch.distributed.rpc.api._wait_all() collects the futures rpc_async returns (not
    those an rpc_sync uses inside), and waits for them: a timeout there raises torch's
    RuntimeError with torch's words."""
    from torch.distributed.rpc.api import _thread_local_var, _wait_all

    with _wait_all():
        for _ in range(3):
            rpc.rpc_async("worker1", min, args=(1, 2))
            rpc.rpc_sync("worker1", min, args=(1, 2))
        assert len(_thread_local_var.future_list) == 3
    with pytest.raises(RuntimeError, match="RPC ran for more than"), _wait_all():
        rpc.rpc_async("worker1", time.sleep, args=(1,), timeout=0.1)
    # the cluster is left as it was found: worker1 sleeps on past the caller's timeout, and
    # a later test that counts worker1's calls saw this one end during it
    assert wait_until(lambda: _in_flight("worker1") == 0), "worker1's sleep never ended"


def _in_flight(name: str) -> int:
    return {r["name"]: r for r in nbrpc.status()}[name]["calls_in_flight"]


def test_remote_rref_to_notebook_class(cell):
    counter = nbrpc.remote("worker1", cell.Counter, args=(5,))
    assert isinstance(counter, rpc.PyRRef)  # torch returns the C++ base of rpc.RRef
    assert counter.owner().name == "worker1"
    assert not counter.is_owner()
    assert counter.rpc_sync().add(2) == 7
    assert counter.rpc_async().add(3).wait() == 10
    assert counter.remote().get().to_here() == 10
    copy = counter.to_here()
    assert isinstance(copy, cell.Counter)  # the class comes back as the notebook's class
    assert copy.value == 10


def test_module_subclass_behind_rref_matches_local(cell):
    net = nbrpc.remote("worker2", cell.make_net, args=(0,))
    x = torch.randn(3, 4)
    remote_out = net.rpc_sync().forward(x)
    local_out = cell.make_net(0)(x)
    torch.testing.assert_close(remote_out, local_out)


def test_module_instance_as_argument(cell):
    local = cell.make_net(1)
    x = torch.randn(2, 4)
    torch.testing.assert_close(nbrpc.rpc_sync("worker1", cell.call_with, args=(local, x)), local(x))


def test_plain_torch_api_works_with_notebook_code(cell):
    """Seed 000 and 001 run with only their start-up replaced."""
    result = rpc.rpc_sync("worker1", cell.remote_add, args=(torch.tensor(1), torch.tensor(2)))
    assert result.item() == 3
    fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
    fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
    assert (fut1.wait() + fut2.wait()).tolist() == [5.0, 5.0]
    rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
    rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
    assert (rref1.to_here() + rref2.to_here()).tolist() == [6.0, 6.0]
    assert rpc.remote("worker2", lambda: cell.Counter(9)).rpc_sync().get() == 9


def test_get_worker_info():
    info = nbrpc.get_worker_info("worker2")
    assert info.name == "worker2"
    assert nbrpc.get_worker_info().name == "worker0"
    assert nbrpc.rpc_sync(info, min, args=(4, 2)) == 2


def test_worker_to_worker_call(cell):
    """A worker calls another worker with code that came from the notebook."""
    out = nbrpc.rpc_sync(
        "worker1", rpc.rpc_sync, args=("worker2", cell.remote_add, (torch.tensor(2), 5))
    )
    assert out.item() == 7


def test_dropped_rref_is_released_on_owner(cell):
    def owned():
        return int(rpc._rref_context_get_debug_info()["num_owner_rrefs"])

    before = steady(lambda: nbrpc.rpc_sync("worker2", owned))
    refs = [nbrpc.remote("worker2", cell.Counter) for _ in range(5)]
    for r in refs:
        r.to_here()
    assert nbrpc.rpc_sync("worker2", owned) == before + 5
    del refs, r
    gc.collect()
    deadline = time.monotonic() + 10
    while nbrpc.rpc_sync("worker2", owned) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert nbrpc.rpc_sync("worker2", owned) == before


# Builtins torch's RPC would send as TorchScript operators, matched against a schema on
# the callee: with these arguments some match no schema ("failed to match any schema") or
# return another type, although the call works locally. nbrpc sends them as Python calls.
BUILTIN_CALLS = [
    (dict, (), {"k": 1}),
    (dict, ([("a", 1), ("b", 2)],), {}),
    (torch.ones, (3,), {}),
    (torch.ones, (2, 3), {"dtype": torch.float64}),
    (torch.zeros, ((2, 2),), {}),
    (torch.full, ((2,), 7), {}),
    (torch.arange, (5,), {}),
    (torch.add, (torch.ones(2), 1), {}),
    (torch.cat, ([torch.ones(1), torch.zeros(2)],), {}),
    (math.sqrt, (4.0,), {}),
    (math.pow, (2, 10), {}),
    (len, ([1, 2, 3],), {}),
    (sorted, ([3, 1, 2],), {"reverse": True}),
]


def _same(remote_value, local_value) -> bool:
    if isinstance(local_value, torch.Tensor):
        return (
            isinstance(remote_value, torch.Tensor)
            and remote_value.dtype == local_value.dtype
            and torch.equal(remote_value, local_value)
        )
    return type(remote_value) is type(local_value) and remote_value == local_value


@pytest.mark.parametrize(
    ("func", "args", "kwargs"),
    BUILTIN_CALLS,
    ids=[f"{f.__name__}{i}" for i, (f, *_) in enumerate(BUILTIN_CALLS)],
)
def test_builtins_give_the_local_result_remotely(cluster, func, args, kwargs):
    local = func(*args, **kwargs)
    assert _same(nbrpc.rpc_sync("worker1", func, args=args, kwargs=kwargs), local)
    assert _same(nbrpc.rpc_async("worker2", func, args=args, kwargs=kwargs).wait(), local)
    assert _same(nbrpc.remote("worker1", func, args=args, kwargs=kwargs).to_here(), local)


def test_a_builtin_goes_as_torch_sends_it_where_a_schema_takes_its_arguments(cluster):
    """remote() of torch.add(tensor, 1) goes as the TorchScript operator torch sends (a typed
    RRef, never through nbrpc's callee, which counts Python calls); torch.ones(3) goes as a
    Python call (no schema takes an int there). A small rpc_sync of a builtin takes the
    lane (nbrpc._wire.lanes) as a Python call: the same result, counted."""

    def worker1() -> dict:
        return {r["name"]: r for r in nbrpc.status()}["worker1"]

    def python_calls_done() -> int:
        return worker1()["calls_done"]

    # an earlier test's call still running there would be counted in the middle (a fresh
    # run's one failure, 49 == 47 + 1): counted from when none runs
    assert wait_until(lambda: worker1()["calls_in_flight"] == 0)
    before = python_calls_done()
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(rref.to_here(), torch.ones(2) * 2)
    assert python_calls_done() == before  # native; status() asks outside the user's count
    assert torch.equal(
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.ones(2) * 2
    )
    assert python_calls_done() == before + 1  # on the lane, as a Python call
    assert torch.equal(rpc.rpc_sync("worker1", torch.ones, args=(3,)), torch.ones(3))
    assert python_calls_done() == before + 2  # torch.ones(3)


def test_a_function_missing_on_the_callee_is_the_runtime_error_torch_raises(cluster, tmp_path):
    (tmp_path / "callee_mod.py").write_text("def foo_add():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import callee_mod

        def remove_it(path):
            import sys

            sys.path.insert(0, path)
            import callee_mod

            del callee_mod.foo_add

        rpc.rpc_sync("worker1", remove_it, args=(str(tmp_path),))
        with pytest.raises(RuntimeError, match="RPC pickler does not serialize") as caught:
            rpc.rpc_sync("worker1", callee_mod.foo_add)
        assert isinstance(caught.value, nbrpc.SerializationError)
        assert "nbrpc.register_by_value" in str(caught.value)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("callee_mod", None)


def test_a_worker_whose_code_replaced_its_stderr_logs_a_failed_call_there_as_torch_does(cluster):
    def replace_stderr():
        import io
        import sys

        sys.__dict__.setdefault("nbrpc_test_stderr", sys.stderr)
        sys.stderr = io.StringIO()

    def restore_stderr():
        import sys

        logged = sys.stderr.getvalue()
        sys.stderr = sys.__dict__.pop("nbrpc_test_stderr")
        return logged

    def raises():
        raise ValueError("Expected error")

    rpc.rpc_sync("worker2", replace_stderr)
    with pytest.raises(ValueError, match="Expected error"):
        rpc.rpc_sync("worker2", raises)
    assert "ValueError: Expected error" in rpc.rpc_sync("worker2", restore_stderr)


def test_a_builtin_with_arguments_it_does_not_take_fails_as_locally_and_as_in_torch(cluster):
    with pytest.raises(RuntimeError, match="failed to match any schema") as caught:
        rpc.rpc_sync("worker1", torch.add, args=())
    assert isinstance(caught.value, TypeError)  # what torch.add() raises locally


def test_remote_builtin_keeps_its_label_in_the_ledger(cluster):
    rref = nbrpc.remote("worker2", torch.ones, args=(2,))
    rows = [r for r in nbrpc.ownership() if r["created_by"] == "remote(worker2, torch.ones)"]
    assert [r["owner"] for r in rows] == ["worker2"], nbrpc.ownership()
    del rref


def test_torchs_profiler_names_each_call_as_torch_names_it(cluster):
    """Under torch's (legacy) profiler an rpc_sync is an ``rpc_sync#...`` event and an
    rpc_async an ``rpc_async#...`` one, as with torch's own functions (nbrpc sent an
    rpc_sync as torch's rpc_async, and torch's profiler tests did not find it)."""
    from torch.autograd.profiler_legacy import profile
    from torch.distributed.rpc import api as torchs

    def events(sync, run_async) -> list[str]:
        with profile() as prof:
            sync("worker1", max, args=(1, 2))
            run_async("worker1", max, args=(3, 4)).wait()
        return [e.name for e in prof.function_events if "(worker0 -> worker1)" in e.name]

    theirs = events(torchs.rpc_sync, torchs.rpc_async)
    assert theirs[0].startswith("rpc_sync#max"), theirs  # the reference, in this process
    assert events(rpc.rpc_sync, rpc.rpc_async) == theirs  # torch's spelling, routed
    assert events(nbrpc.rpc_sync, nbrpc.rpc_async) == theirs


def test_a_torchscript_function_s_first_call_is_the_first_event_of_its_kind(cluster, nb):
    """nbrpc compiles a notebook's TorchScript function on the worker before its first call,
    an RPC the profiler records too, as ``rpc_nbrpc#...``: the first event whose name holds
    the call's kind is the call's own (torch's profiler tests take that one, and "sync" is
    also in "async")."""
    from torch.autograd.profiler_legacy import profile

    code = nb(
        "import torch\n"
        "@torch.jit.script\n"
        "def plus_one(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x + 1\n"
        "@torch.jit.script\n"
        "def plus_two(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x + 2\n"
    )
    for call, kind, fn in (
        (nbrpc.rpc_sync, "sync", code.plus_one),
        (_waited, "async", code.plus_two),
    ):
        with profile() as prof:
            assert float(call("worker2", fn, args=(torch.ones(1),))) == float(fn(torch.ones(1)))
        names = [e.name for e in prof.function_events if "(worker0 -> worker2)" in e.name]
        assert any(n.startswith("rpc_nbrpc#compile_script_as") for n in names), names
        first = next(n for n in names if kind in n)  # as torch's get_function_event looks
        assert fn.qualified_name in first, names


def _waited(to, fn, args):
    return nbrpc.rpc_async(to, fn, args=args).wait()
