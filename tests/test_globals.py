"""A notebook's module-level names on each worker behave as a script's module does.

Run the way users run: a real kernel with cells typed as a person types them, and the
same checks in a plain script using ``nbrpc.init`` (see ``nbrpc._wire.namespace``).
"""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
from conftest import run_script, running_kernel

from nbrpc._wire import namespace, pickling

SINGLETON = """
from threading import Lock
import torch.distributed.rpc as rpc

class ParameterServer:
    def __init__(self):
        self.updates = 0

param_server = None
global_lock = Lock()

def get_parameter_server():
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server

def server_id():
    return id(get_parameter_server())

def trainer_gets_ps():
    return rpc.rpc_sync("parameter_server", server_id)
"""

COUNTER = """
counter = 0

def bump():
    global counter
    counter += 1
    return counter
"""

CHECKS = """
ids = {rpc.rpc_sync(t, trainer_gets_ps) for t in ("trainer1", "trainer2")}
ids |= {rpc.rpc_sync("parameter_server", server_id) for _ in range(3)}
print("servers made:", len(ids))
print("counter:", [rpc.rpc_sync("parameter_server", bump) for _ in range(3)])
print("each worker its own:", rpc.rpc_sync("trainer1", bump), rpc.rpc_sync("trainer2", bump))
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(
        "%load_ext nbrpc",
        "%rpc_init --names parameter_server,trainer1,trainer2 --quiet",
        closing="%rpc_shutdown",
    ) as k:
        yield k


def test_a_singleton_with_its_lock_is_one_object_reached_by_both_trainers(kernel):
    kernel.run(SINGLETON)
    kernel.run(COUNTER)
    out = kernel.run(CHECKS)
    assert "servers made: 1" in out
    assert "counter: [1, 2, 3]" in out  # a script gives [1, 2, 3]; by value gave [1, 1, 1]
    assert "each worker its own: 1 1" in out


def test_a_constant_changed_in_the_kernel_is_seen_by_the_next_call(kernel):
    kernel.run("SCALE = 2\ndef scaled(x):\n    return x * SCALE")
    assert kernel.value("rpc.rpc_sync('trainer1', scaled, args=(3,))") == 6
    kernel.run("SCALE = 3  # the cell re-run with a new value")
    assert kernel.value("rpc.rpc_sync('trainer1', scaled, args=(3,))") == 9


def test_a_name_the_worker_assigned_stays_the_workers(kernel):
    kernel.run("limit = 10\ndef set_limit(n):\n    global limit\n    limit = n\n")
    kernel.run("def get_limit():\n    return limit")
    kernel.run("rpc.rpc_sync('trainer2', set_limit, args=(99,))")
    assert kernel.value("rpc.rpc_sync('trainer2', get_limit)") == 99
    assert kernel.value("rpc.rpc_sync('trainer1', get_limit)") == 10  # not assigned there
    out = kernel.run("%%rpc trainer2\nlimit")  # one namespace: %%rpc cells see it too
    assert "Out[trainer2]: 99" in out


def test_a_global_that_cannot_travel_names_itself_and_the_fix(kernel):
    _, errors = kernel.execute(
        "import socket\nconn = socket.socket()\n"
        "def send_it():\n    return conn.fileno()\n"
        "rpc.rpc_sync('trainer1', send_it)"
    )
    assert errors[0].startswith("SerializationError")
    assert "global 'conn', a socket, which cannot travel" in errors[0]
    assert "%%rpc cell" in errors[0]
    kernel.run("conn.close()")


def test_restart_gives_the_worker_a_fresh_namespace(kernel):
    kernel.run("rpc.rpc_sync('trainer1', bump)")
    assert kernel.value("rpc.rpc_sync('trainer1', bump)") >= 2
    kernel.run("%rpc_restart trainer1")
    assert kernel.value("rpc.rpc_sync('trainer1', bump)") == 1
    assert kernel.value("rpc.rpc_sync('trainer1', trainer_gets_ps)") == kernel.value(
        "rpc.rpc_sync('parameter_server', server_id)"
    )


def test_the_same_in_a_script(tmp_path):
    out = run_script(
        tmp_path / "globals.py",
        "import nbrpc\n"
        + SINGLETON
        + COUNTER
        + "with nbrpc.init(names=['parameter_server', 'trainer1', 'trainer2'], progress=False):\n"
        + "".join(f"    {line}\n" for line in CHECKS.strip().splitlines())
        + "with nbrpc.init(names=['parameter_server'], progress=False):\n"
        + "    print('after a new init:', rpc.rpc_sync('parameter_server', bump))\n",
    )
    assert "servers made: 1" in out
    assert "counter: [1, 2, 3]" in out
    assert "each worker its own: 1 1" in out
    assert "after a new init: 1" in out  # a new process, a new namespace


# -- what travels, without workers -------------------------------------------------------


def test_cloudpickles_function_reducer_has_the_shape_nbrpc_rewrites():
    """The one cloudpickle hook nbrpc uses: if this fails, cloudpickle changed
    ``Pickler._dynamic_function_reduce`` and ``pickling.RpcPickler`` must follow."""
    glob = {"__name__": "__main__", "k": 3}
    exec("def f(x):\n    return x + k", glob)
    import io

    reduced = cloudpickle.Pickler(io.BytesIO())._dynamic_function_reduce(glob["f"])
    make, newargs, (_state, slotstate), *rest = reduced
    assert callable(make)
    assert isinstance(newargs[1], dict)
    assert slotstate["__globals__"] == {"k": 3}
    assert rest[-1] is cloudpickle.cloudpickle._function_setstate


def test_a_lock_travels_as_what_it_is_and_is_made_where_it_runs():
    glob = {"__name__": "__main__", "lock": __import__("threading").Lock()}
    exec("def locked():\n    with lock:\n        return 1", glob)
    import io

    buf = io.BytesIO()
    pickling.RpcPickler(buf).dump(glob["locked"])
    arrived = pickle.loads(buf.getvalue())  # here, the kernel's side: a dict of its own
    assert arrived() == 1
    assert arrived.__globals__["lock"] is not glob["lock"]
    assert isinstance(namespace.as_sent(glob["lock"]), namespace.Sync)
