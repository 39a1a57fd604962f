"""What a process installs to take part in a cluster: every step, in order, per role.

Two roles, and everything a worker is given in this module, each step called from one
place:

* :func:`kernel` -- the notebook's kernel, or a script's main process; run by
  ``Cluster.start`` before each boot (every step is idempotent);
* :func:`worker` -- an engine that becomes a worker: its steps, its join, and what it
  turns on once joined; run by ``_engines.worker.join``;
* :func:`fast_path` -- run by the kernel once workers joined (a boot's, or a restart's):
  shared memory for large tensors and, in a local cluster, lanes for small calls, set up
  on those workers over RPC (:mod:`nbrpc._wire.shm_setup`, :mod:`nbrpc._wire.lanes`);
* :func:`device_replies` -- run by the kernel whenever a cluster with device maps changed
  (its boot, a restart, a shrink): what torch's dynamic group lost, back in every process.

The steps before a join finish before the process's ``init_rpc``: torch's C++ looks up
the Python hooks that :func:`nbrpc._wire.pickling.install` sets when its first agent
starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _devices, _fence, _group, _process, _torch, autograd
from ._calls import cancel, facade, rrefs, spelling
from ._debugger import remote_pdb
from ._wire import (
    bars,
    cancelling,
    lanes,
    namespace,
    native_output,
    output,
    pickling,
    shm_setup,
    stacks,
)


def _both() -> None:
    """The steps of every process, in order."""
    cancelling.forget_cancelled()  # what an earlier cluster's stop or shutdown cancelled
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
    cancel.watch_cells()  # the stop button cancels the cell's calls on the workers
    _process.keep_stops()  # and is never lost in a finalizer (a freed tensor's slot)
    _process.guard_stops()  # nor in ipykernel's code around a cell (it loses the reply)
    output.remember_stderr()  # a failed call is logged only to a stderr code put there


def worker(
    kernel_name: str,
    name: str,
    rank: int,
    spec: _group.StoreSpec,
    rpc_timeout: float,
    num_worker_threads: int,
    device_maps: dict | None,
    devices: list[str] | None,
    members: list[str] | None,
    transport_names: list[str] | None = None,
) -> None:
    """A worker's steps, in order: before it joins as ``name`` (its output goes to
    ``kernel_name``), the join (rank ``rank`` in the group of store ``spec``), and after
    it. ``members``: the cluster's addresses, when it listens beyond loopback: then this
    process's listening sockets admit those alone (:mod:`nbrpc._fence`)."""
    _both()
    output.forward_output_to(kernel_name, name)  # print() during a call: the calling cell
    native_output.start_tail()  # what C and C++ write too
    bars.install()  # tqdm.auto here draws its widget in the calling cell
    remote_pdb.install()  # breakpoint() opens pdb in the calling cell
    namespace.share()  # notebook functions keep their module-level names here
    output.remember_stderr()  # a failed call is logged only to a stderr code put there
    _group.join(
        name,
        rank,
        spec,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps,
        devices=devices,
        transport_names=transport_names,
    )
    _fence.admit(members)  # before the first call reaches this worker's listeners
    facade.set_active(True)  # code running here may call nbrpc.rpc_sync & co. too


@dataclass
class FastPath:
    """What :func:`fast_path` set up: shared memory with any worker (``shm``), the
    workers each one shares it with across hosts (``shm_peers``; None: a local
    cluster), and whether the kernel's lanes are open (``lanes``; None: not asked)."""

    shm: bool
    shm_peers: dict[str, list[str]] | None = None
    lanes: bool | None = None


def fast_path(
    prefix: str,
    threshold: int | None,
    kernel_name: str,
    names: list[str],
    *,
    remote: bool,
    loopback: bool,
    lanes_asked: bool,
    threads: int,
) -> FastPath:
    """On the kernel, once the workers ``names`` joined: shared memory for large tensors
    with them (across hosts: host by host, and ``names`` are then every worker, whose
    peers are worked out again); in a local cluster on loopback, lanes for small calls
    when ``lanes_asked`` (the settings ask for them)."""
    if remote:
        peers = shm_setup.set_up_by_host(prefix, threshold, kernel_name, names)
        done = FastPath(any(peers.values()), shm_peers=peers)
    else:
        done = FastPath(shm_setup.set_up(prefix, threshold, names, loopback))
    if lanes_asked and not remote and loopback:
        done.lanes = lanes.set_up(prefix, names, threads)
    return done


def device_replies(maps: dict[str, dict[str, dict[str, str]]], workers: list[str]) -> None:
    """On the kernel, once the group changed (``maps``: every process's device maps, as
    the boot planned them; ``workers``: the live ones): each process of the cluster gets
    back its CUDA devices and the maps its replies go by (:func:`nbrpc._torch.hold_devices`
    says what torch's dynamic group loses). Nothing without maps."""
    if not maps:
        return
    replies = _devices.inverse(maps)
    _group.hold_devices(replies.get(_group.joined_name() or "", {}))
    for name in workers:
        with contextlib.suppress(Exception):  # one that died meanwhile: nothing to give back
            _torch.rpc_sync(name, _group.hold_devices, args=(replies.get(name, {}),), timeout=30)
