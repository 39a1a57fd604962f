"""torch's own RPC tests on nbrpc clusters: a small, fast subset of the compatibility tier.

``tools/compat.py`` runs torch's RPC test classes (the ones in the wheel, under
``torch/testing/_internal/distributed/``) on nbrpc clusters: the calling process is rank 0
and runs each test on its main thread, as a notebook kernel would, while the workers run
the same test for their ranks (``make compat`` runs all of them; docs/compatibility.md has
the table). This module runs a handful of them in ``make test``, chosen because each one
caught a real difference from torch before: an RRef that arrives in a reply and is
``to_here()``'d on the kernel's main thread, destinations given as a rank or a
WorkerInfo, the exception type and wording of a timeout, builtins through ``remote``,
distributed autograd across processes, the optimizer, a RemoteModule.

All of them run once, in kernels of their own (a crash of rank 0 must not take pytest
down), from a module fixture; each test then asserts its own outcome and prints the
first line of the error and where in torch's test it came from.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import load_tool

#: Class.test -> what it guards (shown when it fails).
CHOSEN: dict[str, str] = {
    # RRefs received in a reply or forwarded, to_here() on the kernel's main thread
    "RpcTest.test_nested_rref": "to_here() of RRefs nested in a reply",
    "RpcTest.test_rpc_return_rref": "to_here() of an RRef returned by rpc_sync",
    "RpcTest.test_rref_forward_chain": "to_here() along a chain of forwarded RRefs",
    "RpcTest.test_rref_proxy_class": "RRef proxies (rref.rpc_sync().method())",
    # destinations as torch takes them
    "RpcTest.test_add_with_id": "a WorkerInfo as the destination",
    "RpcTest.test_self_add": "the caller's own WorkerInfo as the destination",
    "RpcTest.test_worker_id": "get_worker_info by name, and its error for an unknown one",
    "RpcTest.test_send_to_rank": "a rank (int) as the destination, in a kernel's later cluster",
    # errors as torch raises them
    "RpcTest.test_rpc_timeouts": "a timeout is a RuntimeError saying 'RPC ran for more than'",
    "RpcTest.test_py_raise_in_user_func_escaped_str": "a worker's exception, type and text",
    "RpcTest.test_py_raise_in_user_func": "the callee logs a failed call to its own stderr",
    "RpcTest.test_function_not_on_callee": "a function missing on the callee: RuntimeError",
    "RpcTest.test_wait_all_exit_early_python": "wait_all returns at the first error",
    "RpcTest.test_wait_all_timeout": "torch's _wait_all() block sees a timeout",
    "RpcTest.test_all_gather": "torch's _all_gather spans the cluster",
    "RpcTest.test_custom_exception_throw_during_reconstruction": "an exception that cannot "
    "be rebuilt is a RuntimeError naming the original",
    "TensorPipeAgentRpcTest.test_op_with_invalid_args": "a builtin no schema takes: "
    "torch's RuntimeError",
    # builtins
    "RpcTest.test_builtin_remote_ret": "a builtin operator through remote()",
    "RpcTest.test_multi_builtin_remote_ret": "several builtins through remote()",
    # distributed autograd and the optimizer
    "DistAutogradTest.test_backward_simple": "a backward pass through rpc_sync",
    "DistAutogradTest.test_backward_rref": "a backward pass through an RRef",
    "DistAutogradTest.test_graph_for_py_nested_call": "the autograd graph of a nested call",
    "DistOptimizerTest.test_dist_optim": "DistributedOptimizer over remote parameters",
    "RemoteModuleTest.test_forward_sync": "a RemoteModule's forward",
}

#: Chosen tests that fail in a kernel's later cluster for a cause in nbrpc, and pass in
#: its first (the tier's second look runs them there). Strict: the day one passes in its
#: later cluster, its test fails until it leaves this list.
KNOWN: dict[str, str] = {
    "RpcTest.test_send_to_rank": "after a re-init in the same kernel the workers' torch ids "
    "are no longer their ranks (4, 5, 6 in a second cluster): rpc_sync(2, ...) raises "
    "UnknownWorkerError 'No worker with torch id 2'",
}

#: Importing torch's test modules here (to list them) compiles TorchScript that torch
#: itself marks deprecated; that is torch's notice about its own tests, not nbrpc's.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script"),
    pytest.mark.filterwarnings("ignore::FutureWarning:torch.jit._script"),  # its category from 2.14
]

#: Per-test limit for the tier's runner (its own default is for the full run).
TEST_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, object]:
    """Every chosen test run once on nbrpc clusters: the result of each, by name."""
    pytest.importorskip("expecttest", reason="torch's test classes import expecttest")
    compat = load_tool("compat")
    selections = compat.select(tests=list(CHOSEN))
    log_dir = str(tmp_path_factory.mktemp("torch-compat"))
    results = compat.run(selections, timeout=TEST_TIMEOUT_S, log_dir=log_dir)
    # as make compat does: what failed in a later cluster runs again in a first one
    results = compat.second_look(results, TEST_TIMEOUT_S, log_dir)
    return {f"{r.cls}.{r.test}": r for r in results}


@pytest.mark.timeout(900)  # the first test waits for the whole run (about 1.5 min here)
@pytest.mark.parametrize("name", list(CHOSEN))
def test_torch_rpc_test_passes(outcomes: dict[str, Any], name: str) -> None:
    result = outcomes.get(name)
    assert result is not None, f"{name} did not run (not found in torch's classes?)"
    where = f" at {result.where}" if result.where else ""
    assert result.outcome == "passed", (
        f"{name} ({CHOSEN[name]}): {result.outcome}: {result.error}{where}"
    )
    if name in KNOWN:  # failed in a later cluster, for the known cause; passed in a first
        assert result.after_reinit, f"{name} passes in a later cluster now: take it out of KNOWN"
        assert "No worker with torch id" in result.after_reinit, result.after_reinit
    else:
        assert not result.after_reinit, (
            f"{name} ({CHOSEN[name]}) passed only in a fresh kernel's first cluster; in a "
            f"later one: {result.after_reinit}"
        )
