"""Small calls on lanes (nbrpc/_wire/lanes/): what takes one, what stays on TensorPipe, and
that a call gives the same result, error, timeout and death either way."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from conftest import running_kernel

import nbrpc
from nbrpc._wire import lanes, sent_functions
from nbrpc._wire.lanes import messages

CELL = """
import os
import threading
import time
import torch
import torch.distributed.rpc as rpc

def echo(x):
    return x

def top_level_names(profile_rref):  # of a server-process profile, as torch's test reads it
    names = []
    for events in profile_rref.local_value().process_global_function_events:
        last_end = 0
        for event in events:
            if event.time_range.start > last_end:
                names.append(event.name)
                last_end = event.time_range.end
    return names

def nap(seconds):
    time.sleep(seconds)
    return seconds

def grad_leaf():
    return torch.ones(2, requires_grad=True)

def big_result(n):
    return torch.arange(n, dtype=torch.float32)

def own_rref(x):
    return rpc.RRef(x * 2)

def not_picklable():
    return threading.Lock()

def on_meta(n):
    return torch.empty(n, device="meta")  # a tensor on a device, as a CUDA one is

def nap_then_big(seconds, n):  # a reply a lane cannot carry: kept for TensorPipe's take
    time.sleep(seconds)
    return torch.arange(n, dtype=torch.float32)

def kept_replies():
    from nbrpc._wire.lanes.state import here
    return len(here.held)

def foreign():  # an object of a module only this worker has: its reply cannot unpickle
    import sys, types
    mod = types.ModuleType("nbrpc_worker_only")
    exec("class Thing:\\n    pass\\n", mod.__dict__)
    sys.modules["nbrpc_worker_only"] = mod
    return mod.Thing()

@rpc.functions.async_execution
def later(x):
    fut = torch.futures.Future()
    fut.set_result(x + 1)
    return fut

gate = None

def meet(k):
    global gate
    if gate is None:
        gate = threading.Barrier(k, timeout=20)
    gate.wait()
    return k

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __eq__(self, other):
        return (self.x, self.y) == (other.x, other.y)
"""


@pytest.fixture
def code(nb, cluster):
    return nb(CELL)


def _routes(rec) -> dict[str, str]:
    return {row["function"]: row["route"] for row in rec.calls if row["caller"] != "worker1"}


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("recorded", [False, True], ids=["plain", "recorded"])
def test_a_small_call_takes_the_lane_and_gives_what_tensorpipe_gives(cluster, code, recorded):
    """Each value goes both ways on a lane and, for comparison, through TensorPipe
    (remote().to_here()); dtype, shape, strides (a transposed view stays one) and values
    are the same, and so are notebook classes and containers. Plain values take the C
    pickler behind the function's pickle made once (lanes/messages.py), recorded or not
    (recorded: each tensor's bytes counted); the others nbrpc's pickler."""
    base = torch.arange(12.0).reshape(3, 4)
    values = [
        torch.ones(1),
        base.T,  # a view: its storage, offset and strides travel
        base[1],
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor(7),
        torch.zeros(0),
        torch.tensor([True, False]),
        {"a": torch.arange(3), "b": [1, 2.5, "x"]},
        code.Point(1, 2.5),
        (None, 3, b"bytes"),
    ]
    with nbrpc.record() if recorded else contextlib.nullcontext() as rec:
        for value in values:
            on_lane = nbrpc.rpc_sync("worker1", code.echo, args=(value,))
            through_tensorpipe = nbrpc.remote("worker1", code.echo, args=(value,)).to_here()
            if isinstance(value, code.Point):
                assert on_lane == value == through_tensorpipe
                continue
            _same(on_lane, value if not isinstance(value, torch.Tensor) else through_tensorpipe)
            _same(on_lane, through_tensorpipe)
    if not recorded:
        assert messages.lane_call(code.echo, (values[0],), {}, None)[:4] != bytes(4)
        return
    routes = [row["route"] for row in rec.calls if row["function"] == "echo"]
    assert routes.count("lane") == len(values), routes  # the rpc_sync calls
    assert routes.count("tensorpipe") == len(values), routes  # remote() always


KEPT_CELL = """
import math
SCALE = 2
ITEMS = [1]

def scaled(x, offset=0):
    return math.floor(x * SCALE) + offset

def total():
    return sum(ITEMS)
"""


def test_a_notebook_function_is_pickled_once_and_still_sees_every_change(cluster, nb):
    """A lane keeps a notebook function the callee made (sent_functions): five calls make
    it once there. A changed global, default or definition is seen by the next call, as
    with a fresh pickle; a list global is sent afresh with every call."""
    code = nb(KEPT_CELL)
    kept = lambda: nbrpc.rpc_sync("worker1", sent_functions.kept)  # noqa: E731
    before = kept()
    with nbrpc.record() as rec:
        assert [nbrpc.rpc_sync("worker1", code.scaled, args=(i,)) for i in range(5)] == [
            0,
            2,
            4,
            6,
            8,
        ]
    assert {row["route"] for row in rec.calls if row["function"] == "scaled"} == {"lane"}
    assert kept() == before + 1  # made once, kept for the four calls after
    code.scaled.__globals__["SCALE"] = 3
    assert nbrpc.rpc_sync("worker1", code.scaled, args=(1,)) == 3
    code.scaled.__defaults__ = (10,)
    assert nbrpc.rpc_sync("worker1", code.scaled, args=(1,)) == 13
    assert kept() == before + 3  # each change made a new pickle
    redefined = nb(KEPT_CELL.replace("+ offset", "- offset"))
    assert nbrpc.rpc_sync("worker1", redefined.scaled, args=(1, 1)) == 1
    assert nbrpc.rpc_sync("worker1", code.total) == 1
    code.ITEMS.append(2)  # changed in place: the next call sees it (a list is never kept)
    assert nbrpc.rpc_sync("worker1", code.total) == 3
    assert nbrpc.rpc_async("worker1", code.scaled, args=(2,)).wait() == 16


def test_a_kept_function_called_with_plain_values_sees_every_change(cluster, nb):
    """Unrecorded calls of plain values start with the function's pickle made once, its
    globals' values included (lanes/messages.py): the next call after a change of a global,
    a default or a float's sign (0.0 == -0.0, which an equality check would miss) sees it,
    as a fresh pickle would, and so does the call after that."""
    code = nb(KEPT_CELL + "\nZERO = 0.0\n\ndef sign():\n    return math.copysign(1, ZERO)\n")

    def scaled(*args):
        return nbrpc.rpc_sync("worker1", code.scaled, args=args)

    def sign():
        return nbrpc.rpc_sync("worker1", code.sign)

    assert [scaled(i) for i in range(3)] == [0, 2, 4]
    assert messages.lane_call(code.scaled, (1,), {}, None)[:4] != bytes(4)  # the kept pickle
    code.scaled.__globals__["SCALE"] = 3
    assert [scaled(1), scaled(1), scaled(2)] == [3, 3, 6]
    code.scaled.__defaults__ = (10,)
    assert [scaled(1), scaled(1)] == [13, 13]
    assert [sign(), sign()] == [1.0, 1.0]
    code.sign.__globals__["ZERO"] = -0.0
    assert [sign(), sign()] == [-1.0, -1.0]
    code.sign.__globals__["ZERO"] = 0.0
    assert [sign(), sign()] == [1.0, 1.0]
    code.sign.__globals__["ZERO"] = float("nan")  # copysign(1, nan) is 1.0
    assert [sign(), sign()] == [1.0, 1.0]
    del code.sign.__globals__["ZERO"]  # a global gone: the worker's own (still there)
    assert sign() == 1.0


def test_what_a_lane_leaves_to_tensorpipe_goes_there_and_works(cluster, code):
    x = torch.ones(3)
    local = rpc.RRef(torch.ones(2))
    with nbrpc.record() as rec:
        assert torch.equal(
            nbrpc.rpc_sync("worker1", torch.mul, args=(local.to_here(), 2)), x[:2] * 2
        )
        # an RRef in the arguments: torch forks it
        assert nbrpc.rpc_sync("worker1", code.echo, args=(local,)).to_here().sum() == 2
        needs_grad = torch.ones(2, requires_grad=True)
        assert nbrpc.rpc_sync("worker1", code.echo, args=(needs_grad,)).sum() == 2
        assert nbrpc.rpc_sync("worker1", code.echo, args=(torch.ones(1 << 17),)).numel() == 1 << 17
        with dist_autograd.context():
            assert nbrpc.rpc_sync("worker1", code.nap, args=(0,)) == 0
        assert nbrpc.rpc_sync("worker1", code.later, args=(1,)) == 2
    rows = [r for r in rec.calls if r["caller"] != "worker1"]
    routes = [(r["function"], r["route"]) for r in rows]
    assert ("torch.mul", "lane") in routes
    assert routes.count(("echo", "tensorpipe")) == 2, routes  # RRef, grad
    assert ("echo", "lane") in routes, routes  # large: its storage through shared memory
    assert ("nap", "tensorpipe") in routes, routes  # inside a distributed autograd context
    assert ("later", "tensorpipe") in routes, routes  # async_execution: torch waits it


def test_a_worker_s_server_process_profiler_sees_the_kernel_s_calls(cluster, code):
    """torch's ``rpc._server_process_global_profile`` on a worker records the requests
    TensorPipe brings; while one is on, a call that came by lane is sent back to come
    through TensorPipe (it ran beside the profiler, unseen: torch's test of it failed)."""
    x, y = torch.tensor(1), torch.tensor(2)
    outer = rpc.remote("worker1", rpc._server_process_global_profile)
    outer.rpc_sync().__enter__()
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, (x, y)), x + y)
    outer.rpc_sync().__exit__(None, None, None)
    names = rpc.rpc_sync("worker1", code.top_level_names, (outer,))
    assert names == ["aten::add"], names
    with nbrpc.record() as rec:  # and the lane again once it stopped
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, (x, y)), x + y)
    assert [r["route"] for r in rec.calls if r["caller"] == "worker0"] == ["lane"]


def test_a_reply_the_lane_cannot_carry_is_fetched_through_tensorpipe(cluster, code):
    """An RRef, a tensor that needs grad: the call came by lane, the reply went through
    TensorPipe (torch's behaviour); a large tensor's reply comes by lane, its storage
    through shared memory; a reply that does not pickle is torch's error, with nbrpc's
    words."""
    with nbrpc.record() as rec:
        owned = nbrpc.rpc_sync("worker1", code.own_rref, args=(torch.ones(2),))
        leaf = nbrpc.rpc_sync("worker1", code.grad_leaf)
        big = nbrpc.rpc_sync("worker1", code.big_result, args=(1 << 16,))
    assert torch.equal(owned.to_here(), torch.ones(2) * 2)
    assert owned.owner().name == "worker1"
    through_tensorpipe = nbrpc.remote("worker1", code.grad_leaf).to_here()
    assert leaf.requires_grad == through_tensorpipe.requires_grad
    assert torch.equal(big, torch.arange(1 << 16, dtype=torch.float32))
    rows = {r["function"]: r for r in rec.calls}
    assert rows["own_rref"]["route"] == rows["big_result"]["route"] == "lane"
    assert rows["big_result"]["bytes_out"] >= 4 << 16  # counted where TensorPipe pickled it
    with pytest.raises(nbrpc.SerializationError, match="cannot send a lock back from worker1"):
        nbrpc.rpc_sync("worker1", code.not_picklable)
    assert nbrpc.rpc_sync("worker1", code.echo, args=(5,)) == 5


def test_a_call_answering_with_a_device_tensor_takes_tensorpipe_after_its_first_reply(
    cluster, code
):
    """What a GPU cluster's lanes do with CUDA tensors, on any machine ("meta" is a device
    too): one among the arguments sends the call through TensorPipe; a reply holding one
    is fetched through TensorPipe, and the function's later calls to that worker skip the
    lane. Without a device map TensorPipe refuses both, in torch's words, as it would
    with no lanes at all."""
    said = []
    with nbrpc.record() as rec:
        for _ in range(2):
            with pytest.raises(Exception, match="only supports CPU tensors") as caught:
                nbrpc.rpc_sync("worker1", code.on_meta, args=(2,), timeout=30)
            said.append((type(caught.value), str(caught.value).splitlines()[0]))
        with pytest.raises(Exception, match="only supports CPU tensors"):
            nbrpc.rpc_sync("worker1", code.echo, args=(torch.empty(1, device="meta"),), timeout=30)
        assert nbrpc.rpc_sync("worker1", code.echo, args=(7,)) == 7  # the lane still serves
    lanes.pause(True)
    try:  # without lanes: the same error
        with pytest.raises(Exception, match="only supports CPU tensors") as caught:
            nbrpc.rpc_sync("worker1", code.on_meta, args=(2,), timeout=30)
    finally:
        lanes.pause(False)
    assert said[0] == said[1] == (type(caught.value), str(caught.value).splitlines()[0])
    routes = [(r["function"], r["route"]) for r in rec.calls if r["caller"] != "worker1"]
    assert [r for r in routes if r[0] == "on_meta"] == [
        ("on_meta", "lane"),  # the call went by lane; its reply could not
        ("on_meta", "tensorpipe"),  # remembered: no lane round first
    ], routes
    # the call with a device's tensor did not take the lane (TensorPipe refused to send
    # it, so it left no row); the plain call after it did
    assert [r for r in routes if r[0] == "echo"] == [("echo", "lane")], routes


def test_a_reply_that_does_not_unpickle_here_fails_its_call_alone_as_through_tensorpipe(
    cluster, code
):
    """A lane's reply that cannot be unpickled in the caller (here: a module only the
    worker has; on a GPU, a staged CUDA tensor with no room on its device) fails that call
    with its error, as TensorPipe's does, and the error says which side lacks the module;
    the lane and the worker go on (the lane took it for a dead worker before)."""
    said = {}
    for route in ("lane", "tensorpipe"):
        lanes.pause(route == "tensorpipe")
        try:
            here = "this process cannot import module 'nbrpc_worker_only'"  # not worker1
            with pytest.raises(nbrpc.SerializationError, match=here) as sync:
                nbrpc.rpc_sync("worker1", code.foreign, timeout=30)
            with pytest.raises(nbrpc.SerializationError, match=here) as later:
                nbrpc.rpc_async("worker1", code.foreign, timeout=30).wait()
        finally:
            lanes.pause(False)
        said[route] = (type(sync.value), type(later.value))
        assert nbrpc.rpc_sync("worker1", code.echo, args=(3,)) == 3
        assert nbrpc.rpc_async("worker1", code.echo, args=(4,)).wait() == 4
    assert said["lane"] == said["tensorpipe"], said
    assert nbrpc.current().status()[1]["state"] == "ready"


def test_a_timeout_on_a_lane_is_nbrpcs_and_the_next_call_takes_a_new_lane(cluster, code):
    """Timeouts shorter and longer than the main thread's first read of its lane (one
    slice, lanes.MAIN_SLICE_S), and a call that outlasts several slices."""
    for timeout, call in (
        (0.15, lambda: nbrpc.rpc_sync("worker2", code.nap, args=(4.0,), timeout=0.15)),
        (0.3, lambda: nbrpc.rpc_sync("worker2", code.nap, args=(4.0,), timeout=0.3)),
        (0.6, lambda: nbrpc.rpc_sync("worker2", code.nap, args=(4.0,), timeout=0.6)),
        (0.3, lambda: nbrpc.rpc_async("worker2", code.nap, args=(4.0,), timeout=0.3).wait()),
    ):
        t0 = time.monotonic()
        with pytest.raises(nbrpc.RpcTimeoutError, match="RPC ran for more than"):
            call()
        took = time.monotonic() - t0
        # never early; late by at most a slice on a quiet machine, given 2 s on a busy one
        assert timeout - 0.05 < took < timeout + 2.0, f"a {timeout} s timeout came at {took:.2f} s"
        assert nbrpc.rpc_sync("worker2", code.echo, args=(3,)) == 3
    time.sleep(4.0)  # the naps end there
    assert nbrpc.rpc_sync("worker2", code.nap, args=(4 * lanes.MAIN_SLICE_S,)) == 0.4


def test_a_reply_kept_for_a_call_whose_caller_stopped_waiting_is_let_go(cluster, code):
    """The caller's timeout (or the stop button) closes the main thread's lane; the large
    reply the callee then kept for TensorPipe's take is not taken, and is dropped when
    the lane closes (it stayed until the cluster closed: a large or a CUDA tensor)."""
    assert nbrpc.rpc_sync("worker2", code.kept_replies) == 0
    with pytest.raises(nbrpc.RpcTimeoutError):
        nbrpc.rpc_sync("worker2", code.nap_then_big, args=(1.0, 1 << 16), timeout=0.3)
    time.sleep(1.5)  # the call ends there, and its reply is kept, then dropped
    assert nbrpc.rpc_sync("worker2", code.kept_replies) == 0
    big = nbrpc.rpc_sync("worker2", code.nap_then_big, args=(0.0, 1 << 16))  # taken
    assert torch.equal(big, torch.arange(1 << 16, dtype=torch.float32))
    assert nbrpc.rpc_sync("worker2", code.kept_replies) == 0


def test_concurrent_calls_on_one_lane_run_at_once_as_on_torchs_thread_pool(cluster, code):
    """1000 rpc_async calls all come back with their own values, and 4 calls that wait on
    each other (a barrier on the worker) all finish: each got a thread, as on torch's pool."""
    futures = [nbrpc.rpc_async("worker1", code.echo, args=(i,)) for i in range(1000)]
    assert [f.wait() for f in futures] == list(range(1000))
    waiting = [nbrpc.rpc_async("worker2", code.meet, args=(4,), timeout=30) for _ in range(4)]
    assert [f.wait() for f in waiting] == [4, 4, 4, 4]


def test_a_callback_of_a_lane_call_may_call_and_wait(cluster, code):
    """torch runs ``fut.then(cb)`` on the thread that completes the future: for a lane call,
    the lane's reader. A call ``cb`` makes and waits for there goes through TensorPipe
    (torch's suite, ``test_callback_with_ret``: before, it waited for its own reader)."""

    def callback(done):
        inner = nbrpc.rpc_async("worker1", torch.add, args=(done.wait(), 1), timeout=10)
        return inner.then(lambda f: f.wait() + 1).wait()

    first = nbrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1), timeout=10)
    assert torch.equal(first.then(callback).wait(), torch.ones(2) + 3)


def test_lane_sockets_admit_only_this_user_and_survive_garbage(cluster, code):
    directory = lanes.directory()
    assert directory is not None
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    path = lanes.socket_path(directory, "worker1")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.getuid() == 0:  # another user is refused by the directory's mode
        probe = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('refused')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == "refused", out
    for garbage in (
        b"GET / HTTP/1.0\r\n\r\n",
        struct.pack("<QIB", 1, 1 << 31, 1),  # a length no peer sends
        struct.pack("<QIB", 1, 5, 2) + b"\x80\x05junk",  # not a pickle
    ):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(garbage)
            s.settimeout(5)
            with contextlib.suppress(TimeoutError, ConnectionError):
                s.recv(64)
    assert nbrpc.rpc_sync("worker1", code.echo, args=(9,)) == 9


def test_a_worker_that_dies_during_a_lane_call_is_noticed_at_once(cluster, code):
    t0 = time.monotonic()
    with pytest.raises(nbrpc.WorkerDiedError, match="worker2"):
        nbrpc.rpc_sync("worker2", os._exit, args=(3,))
    assert time.monotonic() - t0 < 5
    with pytest.raises(nbrpc.WorkerDiedError):
        nbrpc.rpc_sync("worker2", code.echo, args=(1,))
    nbrpc.restart("worker2")
    with nbrpc.record() as rec:
        assert nbrpc.rpc_sync("worker2", code.echo, args=(torch.ones(2),)).sum() == 2
    assert [r["route"] for r in rec.calls] == ["lane"]


def test_a_worker_restarted_without_shared_memory_gets_its_lane_again():
    """--no-shm turns the arena off, not lanes: a restarted worker opened none (its calls
    all took TensorPipe, silently) when the restart asked the arena's flag alone."""
    with running_kernel("%load_ext nbrpc", "%rpc_init -n 1 --no-shm --quiet") as kernel:
        kernel.run("def echo(x):\n    return x\nimport torch, nbrpc")
        record = (
            "with nbrpc.record() as rec:\n"
            "    nbrpc.rpc_sync('worker1', echo, args=(torch.ones(2),))\n"
            "routes = [r['route'] for r in rec.calls]"
        )
        kernel.run(record)
        assert kernel.value("routes") == ["lane"]
        kernel.run("%rpc_restart worker1")
        kernel.run(record)
        assert kernel.value("routes") == ["lane"]


def test_no_fast_calls_keeps_every_call_on_tensorpipe_and_the_stop_button_ends_a_lane_wait():
    cells = ["%load_ext nbrpc", "%rpc_init -n 1 --no-fast-calls --quiet"]
    with running_kernel(*cells) as kernel:
        kernel.run("def echo(x):\n    return x\nimport time, torch, nbrpc")
        assert "lanes" not in kernel.run("%rpc_status")
        kernel.run(
            "with nbrpc.record() as rec:\n"
            "    nbrpc.rpc_sync('worker1', echo, args=(torch.ones(2),))\n"
            "routes = [r['route'] for r in rec.calls]"
        )
        assert kernel.value("routes") == ["tensorpipe"]
        kernel.run("%rpc_shutdown")
        assert "lanes" in kernel.run("%rpc_init -n 1")  # the summary says how calls travel
        kernel.run(
            "with nbrpc.record() as rec:\n"
            "    nbrpc.rpc_sync('worker1', echo, args=(torch.ones(2),))\n"
            "routes = [r['route'] for r in rec.calls]"
        )
        assert kernel.value("routes") == ["lane"]
        ran_on, errors = kernel.stop_after("nbrpc.rpc_sync('worker1', time.sleep, args=(8,))", 1.5)
        assert errors
        assert errors[0].startswith("KeyboardInterrupt"), errors
        assert ran_on < 3, f"the cell ran {ran_on:.1f} s after the stop button"
        assert kernel.value("nbrpc.rpc_sync('worker1', echo, args=(4,))") == 4
