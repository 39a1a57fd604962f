"""The kernel's CUDA devices across the clusters of its life: CPU and GPU clusters in one
kernel, without a restart.

torch builds a process's TensorPipe agent once, at its join, with the device maps it
will send requests by, and the kernel joins once (``nbrpc._group``). So whether a later
``%rpc_init --gpus auto`` can move the kernel's CUDA tensors device to device is decided
by the first ``%rpc_init``, which is often a CPU cluster. Three things make the choice
reversible where torch allows it:

* **Maps prepared at the first join.** On a host with CUDA devices the kernel joins with
  maps to the default names ``worker1`` .. ``worker16`` (:data:`_devices.PREPARED_GPU_WORKERS`,
  ``NBRPC_PREPARED_GPU_WORKERS``), the ones a ``--gpus auto`` cluster of those names on this
  host plans (:func:`nbrpc._devices.prepared_maps`), plus the first cluster's own. A map
  costs nothing while no CUDA tensor is sent: torch consults it per tensor.
* **Devices lent per cluster.** Maps would make torch give the agent their devices, and an
  agent with devices takes CUDA streams for every message it reads, which brings CUDA up.
  So a first join for a CPU cluster keeps the agent's devices empty
  (:func:`nbrpc._torch.devices_withheld`), and before each cluster's workers join the
  kernel's agent gets exactly the devices that cluster uses, none for a CPU cluster
  (:func:`lend`).
* **What a joiner learns.** A joining worker asks each member for its maps and devices and
  derives its own from the answer; the kernel answers with this cluster's
  (:func:`nbrpc._torch.advertise_devices`), so a CPU cluster's workers start no CUDA.

While the kernel lends no device but holds maps, a CUDA tensor it sends would be mapped by
torch, find no CUDA stream, and fail only after torch counted the call as active: the
kernel's leave would then wait forever. The kernel refuses such a tensor first, with a line
that says what to do (:func:`nbrpc._wire.pickling.refuse_devices`). And the kernel's agent
must hold every device a map of the cluster's names: a worker's reply that a map sends to
a device the kernel's agent lacks finds no stream where torch reads it, on TensorPipe's
loop thread, and that ends the process (:func:`lend` lends them all).

What stays fixed: maps to other names or other devices than the first join's (refused
before anything starts: :func:`nbrpc._devices.check_fixed`), the transports, and CUDA
once it is up in the kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import _devices, _group, _torch
from ._wire import pickling

#: what a CUDA tensor sent to a cluster without device maps is told
REFUSAL = (
    "this cluster has no device maps (it started without --gpus or --device-map), so its "
    "calls carry CPU tensors only: move the tensor to the CPU (.cpu()), or start the "
    "cluster with --gpus auto."
)


@dataclass
class _Lent:
    """What the kernel lends the cluster now up: its maps to the workers, which a joiner
    learns with the kernel's devices (``_group.cuda_devices()``)."""

    maps: dict[str, dict[str, str]] = field(default_factory=dict)
    installed: bool = False


_lent = _Lent()


def prepared_count() -> int:
    """How many default names a first join maps (``NBRPC_PREPARED_GPU_WORKERS``)."""
    text = os.environ.get("NBRPC_PREPARED_GPU_WORKERS", "").strip()
    try:
        return max(0, int(text)) if text else _devices.PREPARED_GPU_WORKERS
    except ValueError:
        return _devices.PREPARED_GPU_WORKERS


def first_join(kernel_devices: list[str], maps: dict) -> tuple[dict, bool]:
    """For the kernel's first join (``maps``: the kernel's maps this cluster needs): the
    maps to join with, and whether it withholds its devices (a CPU cluster)."""
    if not _torch.can_lend_devices():
        return maps, False
    _install()
    prepared = _devices.prepared_maps(kernel_devices, prepared_count())
    joined = {**prepared, **maps}
    return joined, bool(joined) and not maps


def lend(maps: dict, devices: list[str] | None) -> None:
    """Before a cluster's workers join (``maps``: the kernel's maps to them; ``devices``:
    its GPU under ``--gpus auto``): the kernel's agent holds exactly these devices and the
    sources of these maps (maps by hand name no GPU of their own), joiners learn these
    maps, and CUDA tensors are refused while none is lent. Nothing to do in a kernel whose
    first join set no maps (a host without CUDA devices)."""
    member = _group.current_kernel_membership()
    if member is None or not member.device_maps or not _lent.installed:
        return
    lent = _group.local_cuda_devices(maps, devices)
    _lent.maps = dict(maps)
    _group.lend_devices(lent, maps, agent=True)
    pickling.refuse_devices(None if lent else REFUSAL)


def _install() -> None:
    if not _lent.installed:
        _torch.advertise_devices(lambda: (_lent.maps, list(_group.cuda_devices())))
        _lent.installed = True
