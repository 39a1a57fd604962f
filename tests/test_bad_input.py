"""Bad input that docs/errors.md lists and no other test file covers: each a clear error."""

import sys

import pytest
import torch
from conftest import notebook_code

import nbrpc

pytestmark = pytest.mark.usefixtures("cluster")


def test_wrong_arguments_raise_the_workers_type_error_with_the_notebook_line():
    nb = notebook_code("def scale(x, factor):\n    return x * factor\n")
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'factor'") as e:
        nbrpc.rpc_sync("worker1", nb.scale, args=(torch.ones(1),))
    assert e.value.worker == "worker1"


def test_a_module_the_workers_cannot_import_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "helpers_only_in_the_kernel.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import helpers_only_in_the_kernel as helpers

    try:
        with pytest.raises(
            nbrpc.SerializationError,
            match=r"worker2 cannot import module 'helpers_only_in_the_kernel'.*"
            r"nbrpc.register_by_value\(helpers_only_in_the_kernel\)",
        ):
            nbrpc.rpc_sync("worker2", helpers.double, args=(2,))
        nbrpc.register_by_value(helpers)  # the fix the message gives
        assert nbrpc.rpc_sync("worker2", helpers.double, args=(2,)) == 4
    finally:
        sys.modules.pop("helpers_only_in_the_kernel", None)


def test_a_cluster_handle_starts_once(cluster):
    with pytest.raises(nbrpc.ClusterClosedError, match=r"starts once\. Start a new one"):
        cluster.start()
    with pytest.raises(nbrpc.AlreadyInitializedError, match="already running"):
        nbrpc.Cluster(n=1).start()  # a second cluster, made directly, is refused too
    assert nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).item() == 2


def test_an_exception_that_cannot_be_rebuilt_arrives_as_remote_error():
    nb = notebook_code(
        "class Picky(Exception):\n"
        "    def __init__(self, a, b):  # pickle rebuilds exceptions from args: (a,) fails\n"
        "        super().__init__(a)\n"
        "def fail():\n"
        "    raise Picky('bad state', 'detail')\n"
    )
    with pytest.raises(nbrpc.RemoteError) as e:
        nbrpc.rpc_sync("worker1", nb.fail)
    assert e.value.worker == "worker1"
    assert "Picky" in e.value.ename
    assert "bad state" in e.value.evalue
    assert "raise Picky" in e.value.remote_traceback
    assert isinstance(e.value, RuntimeError)  # as torch's caller gets it, with its words
    assert "Original exception on remote side was" in str(e.value)


def test_a_worker_on_another_host_with_the_local_store_is_told_the_fix():
    from nbrpc._engines import worker

    store = {"kind": "file", "path": "/nonexistent-nbrpc-dir/store"}
    with pytest.raises(RuntimeError, match=r"cannot see the kernel's store .* --listen ADDR"):
        worker.join("worker9", 9, store, "worker0", 5.0, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "-n must be at least 1"),
        ({"names": ["a", "a"]}, "unique"),
        ({"gpus": "all"}, "only 'auto'"),
        ({"shm_threshold": 0}, "positive number of bytes"),
        ({"progress": "loud"}, "progress='loud'"),
        ({"n": 100_000}, "100000 workers do not fit on this host: each needs at least"),
        ({"names": [f"w{i}" for i in range(100_000)]}, "100000 workers do not fit"),
    ],
)
def test_bad_settings_are_config_errors_before_anything_starts(kwargs, match):
    with pytest.raises(nbrpc.ConfigError, match=match) as info:
        nbrpc.Cluster(**kwargs)
    assert isinstance(info.value, ValueError)  # what a caller would naturally catch
