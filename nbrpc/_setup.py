"""What a process installs to take part in a cluster: every step, in order, per role.

Two roles, one function each, each called from one place:

* :func:`kernel` -- the notebook's kernel, or a script's main process; run by
  ``Cluster.start`` before each boot (every step is idempotent);
* :func:`worker` -- an engine that becomes a worker; run by ``_engines.worker.join``.

Both finish before the process's ``init_rpc``: torch's C++ looks up the Python hooks that
:func:`nbrpc._wire.pickling.install` sets when its first agent starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _group, _process, _torch, autograd
from ._calls import rrefs, spelling
from ._debugger import remote_pdb
from ._wire import bars, namespace, native_output, output, pickling, stacks


def _both() -> None:
    """The steps of every process, in order."""
    _torch.quiet_internal_deprecations()  # the optimizer's TorchScript notice, see there
    pickling.install()  # notebook code by value, tensors out of band; RRef handles recorded
    rrefs.install()  # RRefs: to_here, owner and proxies with nbrpc's errors
    spelling.route_torch_calls()  # torch's spelling (rpc.rpc_sync & co.) is nbrpc's
    _torch.route_all_gather(_group.member_names)  # torch's barriers span the cluster
    autograd.install()  # loss.backward() inside a context says what to use instead
    stacks.install()  # RPC threads say what they serve, for nbrpc.stacks()
    _torch.track_autograd_contexts()  # a call inside one goes through TensorPipe (lanes)


def kernel(torch_shutdown: Callable[..., Any]) -> None:
    """The kernel's steps; ``torch_shutdown`` stands in for ``rpc.shutdown()``."""
    _both()
    _torch.reset_all_gather()  # a new cluster's fresh workers count their gathers from 0
    _torch.route_user_shutdown(torch_shutdown)  # tutorials end with rpc.shutdown()
    native_output.quiet_kernel_stderr()  # torch's lines about workers nbrpc stops
    _process.watch_cells()  # a worker's native output goes to the running cell
    output.remember_stderr()  # a failed call is logged only to a stderr code put there


def worker(kernel_name: str, name: str) -> None:
    """A worker's steps, before it joins as ``name``; its output goes to ``kernel_name``."""
    _both()
    output.forward_output_to(kernel_name, name)  # print() during a call: the calling cell
    native_output.start_tail()  # what C and C++ write too
    bars.install()  # tqdm.auto here draws its widget in the calling cell
    remote_pdb.install()  # breakpoint() opens pdb in the calling cell
    namespace.share()  # notebook functions keep their module-level names here
    output.remember_stderr()  # a failed call is logged only to a stderr code put there
