"""Every private torch name, patch and error wording nbrpc depends on, in one place.

torch's RPC is in maintenance mode and its Python layer is mostly private: the pickler,
the remote-call wrapper, RRef forks, the dynamic group's membership messages and the
autograd context's graph are underscore names. nbrpc uses them, but only through this
folder, so a torch upgrade is checked here and nowhere else. ``tests/test_torch_seam.py``
pins each entry on every torch release of the supported range; a failure there names the
torch change and the function to update.

Public torch API (``rpc.rpc_async``, ``dist_autograd.context``, ``RRef`` methods without
an underscore) is used directly by the other modules and is not listed here. The other
modules import the names below from this package (``from nbrpc import _torch``), never from
its modules, so that a name can move between them.

What is here, by module:

* :mod:`.versions`: the releases nbrpc is tested with (``OLDEST_TESTED``,
  ``NEWEST_TESTED``), what differs between them (``OPTIMIZER_SCRIPTED``), and the one line
  a torch outside them gets at import;
* :mod:`.group`: the current agent and its store (``agent``, ``set_rpc_timeout``), the
  dynamic group's membership (``GROUP_TOKEN_KEY``, ``MEMBER_LIST_KEY``,
  ``update_group_membership``, ``forget_locally``, ``keep_through_leaves``,
  ``hold_devices``), the kernel's
  devices lent cluster by cluster (``devices_withheld``, ``advertise_devices``,
  ``can_lend_devices``), torch's gathers
  (``route_all_gather``) and TensorPipe options that are not public
  (``tensorpipe_options``, ``TP_SOCKET_IFNAME``);
* :mod:`.rrefs`: RRef internals (``PyRRef``, ``rref_fork``, ``rref_from_fork``,
  ``rref_type_future``, ``original_get_type``, ``rref_id``, ``owned_rref_count``,
  ``pending_user_rrefs``, ``delete_user_rrefs``, ``patch_rref_method``);
* :mod:`.calls`: torch's own senders and the names a notebook calls (``rpc_sync``,
  ``route_user_calls``), the hooks nbrpc installs into ``torch.distributed.rpc.internal``
  and the patches of ``torch.distributed.rpc.api`` (``install_rpc_hooks``,
  ``patch_api``), the pickler CUDA-aware futures use to find a value's tensors
  (``TENSOR_EXTRACTOR``), TorchScript's builtin table (``is_builtin``);
* :mod:`.autograd`: distributed autograd's context internals
  (``current_autograd_context_id``, ...), the local backward's routing, and the notices
  ``DistributedOptimizer`` prints about torch's own internals;
* :mod:`.script`: a notebook's TorchScript function compiled on a worker under the
  kernel's name (``script_source``, ``compile_script_as``);
* :mod:`.wording`: torch's error wording (``is_timeout``, ``missing_module``,
  ``missing_module_here``,
  ``is_connection_loss``).
"""

from __future__ import annotations

from .autograd import (
    INTERNAL_DEPRECATIONS as INTERNAL_DEPRECATIONS,
    LOCAL_BACKWARD_ACROSS_WORKERS as LOCAL_BACKWARD_ACROSS_WORKERS,
    OPTIMIZER_NOTICE as OPTIMIZER_NOTICE,
    autograd_known_workers as autograd_known_workers,
    autograd_messages as autograd_messages,
    current_autograd_context_id as current_autograd_context_id,
    dist_backward as dist_backward,
    in_autograd_context as in_autograd_context,
    local_backward as local_backward,
    no_optimizer_notice as no_optimizer_notice,
    quiet_internal_deprecations as quiet_internal_deprecations,
    quiet_optimizer_notice_if_loaded as quiet_optimizer_notice_if_loaded,
    release_leftover_contexts as release_leftover_contexts,
    route_dist_backward as route_dist_backward,
    route_local_backward as route_local_backward,
    track_autograd_contexts as track_autograd_contexts,
    validate_autograd_context as validate_autograd_context,
)
from .calls import (
    HELD_SENDS as HELD_SENDS,
    INTERNAL_PICKLER as INTERNAL_PICKLER,
    NBRPCS_OWN as NBRPCS_OWN,
    RREF_PROXY_MODULE as RREF_PROXY_MODULE,
    TENSOR_EXTRACTOR as TENSOR_EXTRACTOR,
    TORCH_INTERNAL_HOOKS as TORCH_INTERNAL_HOOKS,
    TORCH_OWN_CALL_MODULES as TORCH_OWN_CALL_MODULES,
    USER_CALLS as USER_CALLS,
    PythonUDF as PythonUDF,
    RemoteException as RemoteException,
    RRefProxy as RRefProxy,
    builtin_accepts as builtin_accepts,
    custom_reducer_classes as custom_reducer_classes,
    default_pickler as default_pickler,
    held_sends as held_sends,
    install_rpc_hooks as install_rpc_hooks,
    install_tensor_extractor as install_tensor_extractor,
    is_builtin as is_builtin,
    list_future as list_future,
    on_done as on_done,
    patch_api as patch_api,
    profiler_enabled as profiler_enabled,
    remote as remote,
    route_user_calls as route_user_calls,
    route_user_shutdown as route_user_shutdown,
    rpc_async as rpc_async,
    rpc_sync as rpc_sync,
    rpc_sync_of_nbrpcs as rpc_sync_of_nbrpcs,
    rpc_sync_started as rpc_sync_started,
    run_udf as run_udf,
    server_profiling as server_profiling,
    udf_function as udf_function,
)
from .group import (
    GLOO_SOCKET_IFNAME as GLOO_SOCKET_IFNAME,
    GROUP_TOKEN_KEY as GROUP_TOKEN_KEY,
    MEMBER_LIST_KEY as MEMBER_LIST_KEY,
    TP_SOCKET_IFNAME as TP_SOCKET_IFNAME,
    advertise_devices as advertise_devices,
    agent as agent,
    agent_is_set as agent_is_set,
    can_lend_devices as can_lend_devices,
    devices_withheld as devices_withheld,
    forget_locally as forget_locally,
    guard_ddp as guard_ddp,
    hold_devices as hold_devices,
    keep_through_leaves as keep_through_leaves,
    leave_group as leave_group,
    membership_changes as membership_changes,
    reset_all_gather as reset_all_gather,
    route_all_gather as route_all_gather,
    set_rpc_timeout as set_rpc_timeout,
    tensorpipe_options as tensorpipe_options,
    update_group_membership as update_group_membership,
)
from .rrefs import (
    RREF_ID as RREF_ID,
    UNSET_RPC_TIMEOUT as UNSET_RPC_TIMEOUT,
    PyRRef as PyRRef,
    delete_user_rrefs as delete_user_rrefs,
    original_get_type as original_get_type,
    original_owner as original_owner,
    original_to_here as original_to_here,
    owned_rref_count as owned_rref_count,
    owner_name as owner_name,
    patch_rref_method as patch_rref_method,
    pending_user_rrefs as pending_user_rrefs,
    remember_creation as remember_creation,
    rref_creation_future as rref_creation_future,
    rref_fork as rref_fork,
    rref_from_fork as rref_from_fork,
    rref_id as rref_id,
    rref_type_future as rref_type_future,
)
from .script import (
    compile_script_as as compile_script_as,
    script_function_named as script_function_named,
    script_functions_used as script_functions_used,
    script_source as script_source,
)
from .versions import (
    NEWEST_TESTED as NEWEST_TESTED,
    OLDEST_TESTED as OLDEST_TESTED,
    OPTIMIZER_SCRIPTED as OPTIMIZER_SCRIPTED,
    RUNNING as RUNNING,
    TorchVersionWarning as TorchVersionWarning,
    in_tested_range as in_tested_range,
    release as release,
    spelled as spelled,
    untested_notice as untested_notice,
    warn_if_untested as warn_if_untested,
)
from .wording import (
    CONNECTION_LOST as CONNECTION_LOST,
    NOT_ON_CALLEE as NOT_ON_CALLEE,
    UNKNOWN_DESTINATION as UNKNOWN_DESTINATION,
    is_connection_loss as is_connection_loss,
    is_timeout as is_timeout,
    missing_module as missing_module,
    missing_module_here as missing_module_here,
    serialization_failure as serialization_failure,
    undefined_script_function as undefined_script_function,
)

warn_if_untested()  # one line, where torch is outside the tested releases
