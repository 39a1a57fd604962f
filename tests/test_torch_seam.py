"""Pins every private torch name, patch and wording in ``nbrpc._torch`` (no workers needed).

Each assertion names the torch change it detects and the function of ``nbrpc._torch`` to
update, so a torch upgrade that breaks nbrpc fails here first, and says where. ``make test``
runs this file on two torch releases of the supported range (``.venv``'s and the newest,
``make test-torch``), and any other on demand; where the releases differ, the pin checks
the flag of ``nbrpc._torch.versions`` that names the difference.
"""

import inspect
import re
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
import torch.distributed.rpc.internal as rpc_internal

import nbrpc
from nbrpc import _group, _torch
from nbrpc._wire import pickling

SEAM = "nbrpc/_torch/"


def _pin(condition: bool, change: str, fix: str) -> None:
    assert condition, f"torch {torch.__version__} changed: {change}. Update {fix} in {SEAM}."


def test_rpc_internal_hooks_are_still_there_and_installed():
    pickling.install()
    for name in _torch.TORCH_INTERNAL_HOOKS:
        _pin(
            hasattr(rpc_internal, name),
            f"torch.distributed.rpc.internal.{name} is gone",
            "install_rpc_hooks",
        )
    _pin(rpc_internal._pickler is pickling.RpcPickler, "_pickler is not ours", "install_rpc_hooks")
    _pin(
        _torch.RemoteException._fields == ("msg", "exception_type"),
        "RemoteException's fields",
        "RemoteException (and nbrpc._wire.failures.failure)",
    )
    source = inspect.getsource(_torch.INTERNAL_PICKLER.serialize)
    for line in (
        "_pickler(f)",
        "p.dispatch_table = self._dispatch_table",
        "p.dispatch_table[dist.rpc.PyRRef] = self._py_rref_reducer",
    ):
        _pin(line in source, f"_InternalRPCPickler.serialize no longer has {line!r}", "the pickler")
    data, tensors = _torch.default_pickler().serialize({"x": 1})
    _pin(
        isinstance(data, bytes) and tensors == [],
        "default pickler's serialize()",
        "default_pickler",
    )


def test_torchs_sends_pickle_and_hand_over_inside_the_functions_nbrpc_holds():
    """The stop waits for a send from its RRefs' pickling to the hand-over
    (``HELD_SENDS``): torch's ``rpc_sync``/``rpc_async`` pickle and send inside
    ``_invoke_rpc``, and ``remote`` inside itself; an RRef proxy's calls go through them."""
    pickling.install()
    held = _torch.held_sends()
    _pin(sorted(held) == sorted(_torch.HELD_SENDS), "a send is not held", "install_rpc_hooks")
    _pin(rpc_api._invoke_rpc is held["_invoke_rpc"], "_invoke_rpc is not held", "HELD_SENDS")
    invoke = inspect.getsource(inspect.unwrap(rpc_api._invoke_rpc))
    for line in ("_default_pickler.serialize(", "_invoke_rpc_python_udf("):
        _pin(line in invoke, f"_invoke_rpc no longer has {line!r}", "HELD_SENDS")
    for api in (rpc_api.rpc_sync, rpc_api.rpc_async):
        _pin(
            "_invoke_rpc(" in inspect.getsource(api),
            f"{api.__name__} sends elsewhere",
            "HELD_SENDS",
        )
    remote = inspect.getsource(inspect.unwrap(held["remote"]))
    for line in ("_default_pickler.serialize(", "_invoke_remote_python_udf("):
        _pin(line in remote, f"remote no longer has {line!r}", "HELD_SENDS")


def test_cuda_futures_list_tensors_with_the_class_nbrpc_replaces():
    from torch import _jit_internal

    pickling.install()
    _pin(
        "_TensorExtractor(" in inspect.getsource(_jit_internal._extract_tensors),
        "_jit_internal._extract_tensors no longer instantiates _TensorExtractor",
        "install_tensor_extractor",
    )
    _pin(
        _jit_internal._TensorExtractor is pickling.TensorFinder,
        "_TensorExtractor is not ours",
        "install_tensor_extractor",
    )


def test_torchs_profiler_names_nbrpcs_own_rpc_by_its_kind():
    """nbrpc's own RPCs (a TorchScript function's compile before its first call) go through
    torch's ``_invoke_rpc`` with a kind of nbrpc's, which torch's profiler key takes its
    ``.value`` from: ``rpc_nbrpc#...``, never holding "sync", "async" or "remote"."""
    key = rpc_internal._build_rpc_profiling_key(_torch.NBRPCS_OWN, "f", "a", "b")
    _pin(key == "rpc_nbrpc#f(a -> b)", f"the profiling key is now {key!r}", "rpc_sync_of_nbrpcs")
    params = list(inspect.signature(rpc_api._invoke_rpc).parameters)
    _pin(params[:4] == ["to", "func", "rpc_type", "args"], f"_invoke_rpc{params}", "the same")


def test_python_udf_shape():
    udf = rpc_internal.PythonUDF(max, (1, 2), {})
    _pin(_torch.udf_function(udf) is max, "PythonUDF has no .func/.args", "udf_function")
    _pin(_torch.run_udf(udf) == 2, "PythonUDF is not (func, args, kwargs)", "run_udf")
    _pin(_torch.udf_function(AttributeError("x")) is None, "udf_function on errors", "udf_function")


def test_rref_internals_exist():
    for name in ("_serialize", "_deserialize", "_get_type", "to_here"):
        _pin(hasattr(_torch.PyRRef, name), f"PyRRef.{name} is gone", "the RRef helpers")
    _pin(issubclass(rpc.RRef, _torch.PyRRef), "rpc.RRef no longer subclasses PyRRef", "PyRRef")
    text = "UserRRef(RRefId = GloballyUniqueId(created_on=3, local_id=17), ForkId = ...)"
    _pin(_torch.RREF_ID.search(text) is not None, "RRef repr", "rref_id")
    for name in ("_rref_context_get_debug_info", "_delete_all_user_and_unforked_owner_rrefs"):
        _pin(hasattr(torch._C._distributed_rpc, name), f"{name} is gone", "owned_rref_count")


def test_the_rref_contexts_counts_are_where_nbrpc_reads_them(cluster):
    """``owned_rref_count`` and ``pending_user_rrefs`` read torch's RRef debug info."""
    keys = set(rpc._rref_context_get_debug_info())
    _pin({"num_owner_rrefs", "num_pending_users"} <= keys, f"its keys: {keys}", "rrefs.py")
    _pin(_torch.pending_user_rrefs() >= 0, "num_pending_users is no count", "pending_user_rrefs")


def test_patched_api_names_exist():
    for name in ("remote", "shutdown", "_get_current_rpc_agent", "_is_current_rpc_agent_set"):
        _pin(hasattr(rpc_api, name), f"torch.distributed.rpc.api.{name} is gone", "patch_api")
    _pin(hasattr(rpc, "_set_rpc_timeout"), "rpc._set_rpc_timeout is gone", "set_rpc_timeout")
    params = inspect.signature(rpc_api.remote).parameters
    _pin(list(params)[:2] == ["to", "func"], "remote()'s signature", "patch_api / _ledger")


def test_group_membership_internals():
    from torch.distributed.rpc import _utils

    _pin(
        _torch.update_group_membership is _utils._update_group_membership,
        "rpc._utils._update_group_membership moved",
        "update_group_membership",
    )
    source = inspect.getsource(_utils)
    _pin(
        f'"{_torch.GROUP_TOKEN_KEY}"' in source,
        "the join/leave token key",
        "GROUP_TOKEN_KEY",
    )
    agent_type = torch._C._distributed_rpc.TensorPipeAgent
    _pin(
        hasattr(agent_type, "_update_group_membership"),
        "TensorPipeAgent._update_group_membership is gone",
        "forget_locally",
    )


def test_a_dynamic_join_decides_devices_where_the_kernel_lends_them():
    """``devices_withheld`` and ``advertise_devices`` replace two functions of torch's
    dynamic join, looked up by name when it runs: a process's own device list, from its
    maps, and what a joiner asks every member (``nbrpc._kernel_devices``)."""
    from torch.distributed.rpc import backend_registry

    _pin(_torch.can_lend_devices(), "backend_registry lost a lending hook", "LENDING_HOOKS")
    join = inspect.getsource(backend_registry._set_devices_and_reverse_device_map)
    _pin(
        "_create_device_list(" in join and "api.rpc_sync(" in join and "_get_device_infos" in join,
        "the dynamic join no longer asks members by _get_device_infos nor lists devices",
        "devices_withheld / advertise_devices",
    )
    _pin(
        backend_registry._create_device_list(
            [], {"w": {torch.device("cuda:0"): torch.device("cuda:0")}}, {}
        )
        == [torch.device("cuda:0")],
        "_create_device_list(devices, maps, reverse maps) changed",
        "devices_withheld",
    )
    saved = backend_registry._get_device_infos
    try:
        _torch.advertise_devices(lambda: ({"w": {"cuda:0": "cuda:1"}}, ["cuda:0"]))
        count, maps, devices = backend_registry._get_device_infos()
        _pin(
            count == torch.cuda.device_count()
            and maps == {"w": {torch.device("cuda:0"): torch.device("cuda:1")}}
            and devices == [torch.device("cuda:0")],
            "_get_device_infos's answer (count, maps, devices)",
            "advertise_devices",
        )
    finally:
        backend_registry._get_device_infos = saved
    own = backend_registry._create_device_list
    with _torch.devices_withheld():
        maps = {"w": {torch.device("cuda:0"): torch.device("cuda:0")}}
        _pin(backend_registry._create_device_list([], maps, {}) == [], "withheld", "same")
    _pin(backend_registry._create_device_list is own, "torch's own, back", "devices_withheld")


def test_tensorpipe_options_accept_transports_and_channels():
    options = _torch.tensorpipe_options(["uv"], ["cma", "basic"], init_method="tcp://127.0.0.1:1")
    _pin(options.init_method == "tcp://127.0.0.1:1", "TensorPipe options", "tensorpipe_options")


def test_live_group_internals(cluster):
    """On the running cluster: the member list nbrpc edits for dead workers, RRef counts."""
    import torch.distributed as dist

    listed = dist.PrefixStore("names", _torch.agent().store).get(_torch.MEMBER_LIST_KEY)
    for record in cluster.records[1:]:
        _pin(
            f"{record.name}-{record.rank},".encode() in listed,
            f"the dynamic group's member list ({listed!r})",
            "MEMBER_LIST_KEY",
        )
    _pin(isinstance(_torch.owned_rref_count(), int), "RRef debug info", "owned_rref_count")
    rref = nbrpc.remote("worker1", torch.ones, args=(2,))
    _pin(re.fullmatch(r"\d+:\d+", _torch.rref_id(rref)) is not None, "RRef repr", "rref_id")
    _pin(_torch.rref_type_future(rref).wait() is torch.Tensor, "RRef._get_type", "same")
    fresh = nbrpc.remote("worker1", torch.ones, args=(2,))  # a handle keeps its first answer
    _pin(
        _torch.original_get_type(fresh, blocking=True) is torch.Tensor,
        "RRef._get_type(timeout, blocking)",
        "original_get_type",
    )
    created = _torch.rref_creation_future(rref)
    _pin(created is not None, "RRef._get_future is gone", "rref_creation_future")
    created.wait()
    _pin(created.done(), "RRef._get_future never finishes", "rref_creation_future")
    slow = nbrpc.remote("worker1", time.sleep, args=(3.0,))
    created = _torch.rref_creation_future(slow)
    _pin(not created.done(), "creation finished before the call did", "rref_creation_future")
    created.wait()
    _pin(slow.to_here(timeout=0.1) is None, "the value was not there at creation", "same")


def test_a_member_gets_back_its_devices_and_reply_maps_through_a_joins_update(cluster):
    """``_torch.hold_devices`` is the update torch's join runs, with the process's own
    name: accepted in the kernel and in a worker (by ``nbrpc._setup.device_replies``'s
    way), the group unchanged after it. (With CUDA devices: tests/test_devices.py.)"""
    before = sorted((w.name, w.id) for w in _torch.agent().get_worker_infos())
    nobody = {"nbrpc-seam-check": {"cpu": "cpu"}}  # a peer that never joins: no reply uses it
    _torch.hold_devices([], nobody)
    _torch.rpc_sync("worker1", _group.hold_devices, args=(nobody,), timeout=10)
    after = sorted((w.name, w.id) for w in _torch.agent().get_worker_infos())
    _pin(after == before, "the update changed the members", "hold_devices")
    # a leave on behalf of a worker (one that never was), keeping devices and reply maps
    ghost = rpc.WorkerInfo("nbrpc-seam-ghost", -2)
    _torch.rpc_sync("worker1", _group.forget_peer, args=(ghost,), timeout=10)
    _torch.forget_locally(ghost, [], nobody)
    after = sorted((w.name, w.id) for w in _torch.agent().get_worker_infos())
    _pin(after == before, "a leave's update changed the other members", "forget_locally")
    _pin(
        nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).item() == 2.0,
        "a call",
        "same",
    )


def test_autograd_internals_exist(cluster):
    with dist_autograd.context() as context_id:
        _pin(
            _torch.current_autograd_context_id() == context_id,
            "_current_context()._context_id()",
            "current_autograd_context_id",
        )
        _torch.validate_autograd_context(context_id)
        sends, recvs = _torch.autograd_messages(context_id)
        _pin(sends == {} and recvs == {}, "_send_functions/_recv_functions", "autograd_messages")
        _pin(_torch.autograd_known_workers(context_id) == [], "_known_worker_ids", "same")


def test_builtins_are_recognised():
    for func in (torch.add, torch.ones, dict, __import__("math").sqrt):
        _pin(_torch.is_builtin(func), f"{func} is no longer a TorchScript builtin", "is_builtin")
    _pin(not _torch.is_builtin(lambda: 0), "a lambda counts as builtin", "is_builtin")
    takes = _torch.builtin_accepts
    _pin(takes(torch.add, (torch.ones(2), 1), None), "_jit_resolve_packet", "builtin_accepts")
    _pin(takes(torch.ones, ((3,),), None), "_jit_resolve_packet", "builtin_accepts")
    _pin(not takes(torch.ones, (3,), None), "torch.ones(3) matches a schema", "builtin_accepts")
    _pin(not takes(dict, (), {"k": 1}), "dict(k=1) matches a schema", "builtin_accepts")


def test_error_wording_matches():
    timeout = RuntimeError("RPC ran for more than set timeout (0.5 seconds) and will now be marked")
    _pin(_torch.is_timeout(timeout), "the timeout wording", "is_timeout")
    missing = RuntimeError(
        "Failed to deserialize ... ModuleNotFoundError: No module named 'helpers'"
    )
    _pin(_torch.missing_module(missing) == "helpers", "the unpickling wording", "missing_module")
    lost = RuntimeError("EOF: end of file (this error originated at tensorpipe/transport/...)")
    _pin(_torch.is_connection_loss(lost), "TensorPipe's EOF wording", "CONNECTION_LOST")
    _pin(not _torch.is_connection_loss(ValueError("EPIPE")), "only RuntimeErrors", "same")


def test_internal_deprecations_are_quieted_and_still_emitted_by_torch():
    import warnings

    import torch.distributed.optim._deprecation_warning as optim_notice
    import torch.jit._script as jit_script

    sources = inspect.getsource(jit_script) + inspect.getsource(optim_notice)
    for text in _torch.INTERNAL_DEPRECATIONS:
        _pin(text in sources, f"torch no longer says {text!r}", "INTERNAL_DEPRECATIONS")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _torch.quiet_internal_deprecations()
        for text in _torch.INTERNAL_DEPRECATIONS:
            warnings.warn(text + " and ...", DeprecationWarning, stacklevel=1)
    assert caught == []


def test_no_private_torch_name_outside_the_seam():
    """The other modules reach torch through public names only (code, not docstrings)."""
    import io
    import pathlib
    import tokenize

    private = re.compile(
        r"rpc_api\.|torch\._C|torch\.jit\._|_jit_internal|rpc\.internal|\brpc\._|dist_autograd\._|"
        r"\._(serialize|deserialize|get_type)\(|(?<!_torch\.)(TP|GLOO)_SOCKET_IFNAME|_transports|"
        r"backend_registry"
    )
    package = pathlib.Path(nbrpc.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "_torch":
            continue
        lines: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type not in (tokenize.STRING, tokenize.COMMENT):
                lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
        where = path.relative_to(package)
        found += [f"{where}:{n}: {code}" for n, code in lines.items() if private.search(code)]
    assert found == [], "private torch names outside nbrpc/_torch/:\n" + "\n".join(found)


def test_pickled_rref_reducer_is_ours():
    pickling.install()
    table = {}
    pickler = pickling.RpcPickler(__import__("io").BytesIO())
    pickler.dispatch_table = table
    _pin(
        pickler.dispatch_table[_torch.PyRRef].__module__ == "nbrpc._ledger",
        "RRef reducers",
        "the pickler",
    )


def test_functional_optimizers_call_the_notice_nbrpc_silences():
    import sys

    from torch.distributed.optim.utils import functional_optim_map

    modules = {sys.modules[cls.__module__] for cls in functional_optim_map.values()}
    _pin(
        all(hasattr(m, _torch.OPTIMIZER_NOTICE) for m in modules),
        f"functional optimizers no longer call {_torch.OPTIMIZER_NOTICE}",
        "quiet_optimizer_notice_if_loaded",
    )
    _torch.quiet_optimizer_notice_if_loaded()
    assert {getattr(m, _torch.OPTIMIZER_NOTICE) for m in modules} == {_torch.no_optimizer_notice}


def test_the_calls_a_notebook_makes_can_be_routed_and_torchs_stay_reachable():
    for name in _torch.USER_CALLS:
        _pin(
            callable(getattr(rpc_api, name, None)) and hasattr(rpc, name),
            f"torch.distributed.rpc.{name} (or the api module's) is gone",
            "route_user_calls and rpc_sync/rpc_async/remote",
        )
    _pin(
        callable(getattr(torch.futures, "wait_all", None)),
        "torch.futures.wait_all is gone",
        "route_user_calls and wait_all",
    )


def test_tensor_backward_calls_torch_autograd_backward():
    source = inspect.getsource(torch.Tensor.backward)
    _pin(
        "torch.autograd.backward(" in source,
        "Tensor.backward no longer calls torch.autograd.backward",
        "route_local_backward",
    )


def test_the_releases_differ_where_versions_says():
    """Each flag of ``nbrpc._torch.versions`` against the torch it runs on."""
    import torch.distributed.optim.optimizer as optimizer

    from nbrpc._torch import versions

    scripted = hasattr(optimizer, "_ScriptLocalOptimizer")
    _pin(
        scripted == versions.OPTIMIZER_SCRIPTED,
        f"DistributedOptimizer {'scripts' if scripted else 'no longer scripts'} its functional "
        "optimizers with TorchScript",
        "versions.OPTIMIZER_SCRIPTED",
    )
    _pin(
        scripted or hasattr(optimizer, "_FunctionalLocalOptimizer"),
        "DistributedOptimizer's local optimizer is neither scripted nor functional",
        "versions.OPTIMIZER_SCRIPTED",
    )


def test_autograd_contexts_are_made_and_released_through_the_names_nbrpc_counts():
    source = inspect.getsource(dist_autograd.context)
    for name in ("_new_context()", "_release_context("):
        _pin(
            name in source,
            f"dist_autograd.context no longer calls {name}",
            "track_autograd_contexts",
        )
    _torch.track_autograd_contexts()
    _pin(not _torch.in_autograd_context(), "a context outside one", "in_autograd_context")
    with dist_autograd.context():
        _pin(_torch.in_autograd_context(), "_current_context inside one", "in_autograd_context")
    _pin(not _torch.in_autograd_context(), "a released context", "track_autograd_contexts")


@pytest.mark.usefixtures("cluster")
def test_a_context_a_stop_ended_is_looked_at_again_at_a_shutdown(monkeypatch):
    """A worker's late message about a context the kernel released (a stop ended the
    backward pass while gradients were on their way) makes torch create it again in the
    kernel, where nothing released it: the soak (seed 66, step 36) found one live after
    every later shutdown; stopping backward passes at random moments, 40 stops a run,
    brought one back in 3 runs of 10. A shutdown asks torch again for the contexts
    whose block a stop or an error ended, and releases those it holds."""
    _pin(
        hasattr(dist_autograd, "_retrieve_context"),
        "dist_autograd._retrieve_context is gone",
        "release_leftover_contexts",
    )
    _torch.track_autograd_contexts()
    _torch.release_leftover_contexts()  # what earlier tests left to look at
    with pytest.raises(KeyboardInterrupt), dist_autograd.context() as stopped:
        raise KeyboardInterrupt
    with dist_autograd.context():
        pass  # ended as it should: not looked at again
    probed = []

    def held_again(context_id: int) -> object:
        probed.append(context_id)
        return object()  # torch holds it again (made by a late message)

    monkeypatch.setattr(dist_autograd, "_retrieve_context", held_again)
    assert _torch.release_leftover_contexts() == 1
    assert probed == [stopped]
    assert _torch.release_leftover_contexts() == 0  # looked at once


def test_gathers_and_the_wait_all_block_keep_their_state_where_nbrpc_reads_it():
    for name in ("_all_gather_dict_lock", "_all_gather_sequence_id"):
        _pin(hasattr(rpc_api, name), f"rpc.api.{name} is gone", "reset_all_gather")
    _pin(
        isinstance(rpc_api._all_gather_sequence_id_to_states, dict),
        "rpc.api._all_gather_sequence_id_to_states",
        "reset_all_gather",
    )
    params = list(inspect.signature(rpc_api._all_gather).parameters)
    _pin(params == ["obj", "worker_names", "timeout"], f"_all_gather{params}", "route_all_gather")
    _pin(
        "_thread_local_var.future_list" in inspect.getsource(rpc_api.rpc_async)
        and hasattr(rpc_api, "_thread_local_var"),
        "rpc_async no longer lists its future for _wait_all()",
        "rpc_async and list_future",
    )
    _pin(issubclass(rpc_api.RRef, _torch.PyRRef), "rpc.api.RRef", "patch_api('RRef.__init__')")
    from torch.distributed.rpc import server_process_global_profiler as server

    for name in (
        "_enable_server_process_global_profiler",
        "_disable_server_process_global_profiler",
    ):
        _pin(
            f"{name}(" in inspect.getsource(server) and hasattr(server, name),
            f"server_process_global_profiler no longer calls {name}",
            "server_profiling",
        )
    _pin(not _torch.server_profiling(), "no server-process profile here", "server_profiling")
    params = list(inspect.signature(rpc_api._invoke_rpc).parameters)
    _pin(
        params == ["to", "func", "rpc_type", "args", "kwargs", "rpc_timeout"]
        and "_invoke_rpc(to, func, RPCExecMode.SYNC" in inspect.getsource(rpc_api.rpc_sync),
        f"rpc_sync no longer starts with _invoke_rpc{params}, RPCExecMode.SYNC",
        "rpc_sync_started",
    )


def test_reducer_classes_and_the_profiler_flag_are_read_where_torch_keeps_them():
    reducers = getattr(_torch.default_pickler(), "_class_reducer_dict", None)
    _pin(
        isinstance(reducers, dict),
        "_InternalRPCPickler._class_reducer_dict",
        "custom_reducer_classes",
    )
    _pin(not _torch.profiler_enabled(), "the profiler flag outside a profile", "profiler_enabled")
    with torch.autograd.profiler.profile():
        _pin(_torch.profiler_enabled(), "torch._C._autograd._profiler_enabled", "profiler_enabled")


def test_a_local_backward_across_workers_fails_with_the_words_nbrpc_recognises(cluster):
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context():
        loss = rpc_api.rpc_sync("worker1", torch.mul, args=(x, 2)).sum()
        try:
            _torch.local_backward(loss)
        except RuntimeError as exc:
            words = str(exc)
        else:
            words = "(no error)"
    _pin(
        _torch.LOCAL_BACKWARD_ACROSS_WORKERS in words,
        f"the local engine's words for a graph that crossed workers ({words[:120]!r})",
        "LOCAL_BACKWARD_ACROSS_WORKERS",
    )


def test_module_names_and_the_callees_hint_are_where_the_seam_says():
    import importlib.util

    _pin(
        _torch.RRefProxy.__module__ == _torch.RREF_PROXY_MODULE,
        "RRefProxy moved",
        "RREF_PROXY_MODULE",
    )
    for name in _torch.TORCH_OWN_CALL_MODULES:
        _pin(
            importlib.util.find_spec(name) is not None, f"{name} is gone", "TORCH_OWN_CALL_MODULES"
        )
    _pin(
        _torch.NOT_ON_CALLEE in inspect.getsource(rpc_internal),
        "the unpickler's hint for a function missing on the callee",
        "NOT_ON_CALLEE",
    )


SCRIPTED_SOURCE = """
import torch

def seam_script_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b
"""


def test_a_notebook_script_function_compiles_elsewhere_under_its_name(tmp_path):
    """What nbrpc._torch.script relies on: torch.jit.script keeps the Python function
    (``_torchdynamo_inline``), the global compilation unit finds a function by its
    qualified name, and ``_jit_script_compile`` compiles one under a name given."""
    import importlib.util

    path = tmp_path / "seam_scripted.py"
    path.write_text(SCRIPTED_SOURCE)
    spec = importlib.util.spec_from_file_location("seam_scripted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scripted = torch.jit.script(module.seam_script_add)
    found = _torch.script_source(scripted)
    _pin(found is not None, "torch.jit.script keeps no Python function", "script_source")
    original, lines = found
    _pin(
        original is module.seam_script_add, "_torchdynamo_inline is another object", "script_source"
    )
    assert "".join(lines) == SCRIPTED_SOURCE
    name = "__torch__.___torch_mangle_999.seam_script_add"  # as a cell run again names it
    _pin(_torch.compile_script_as(name, original, lines), "nothing compiled", "compile_script_as")
    assert not _torch.compile_script_as(name, original, lines)  # there already
    again = _torch.script_function_named(name)
    _pin(again.qualified_name == name, "compiled under another name", "compile_script_as")
    assert torch.equal(again(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    assert _torch.script_functions_used(original) == []


def test_torchscript_calling_torchs_backward_compiles_to_torchs_operator():
    """nbrpc routes ``torch.distributed.autograd.backward`` through its check; TorchScript
    code that calls it (torch's JitDistAutogradTest) must still find torch's operator."""
    import torch.distributed.autograd as dist_autograd

    from nbrpc import autograd

    autograd.install()
    _pin(
        torch.jit._builtins._find_builtin(dist_autograd.backward) == "aten::dist_backward",
        "TorchScript's builtin table no longer takes a registered function",
        "route_dist_backward",
    )

    def backward_in_script(context_id: int, loss: torch.Tensor) -> None:
        dist_autograd.backward(context_id, [loss])

    scripted = torch.jit.script(backward_in_script)
    assert "dist_backward" in str(scripted.graph)
