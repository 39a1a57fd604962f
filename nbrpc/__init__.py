"""nbrpc: interactive distributed PyTorch from a Jupyter notebook.

In a notebook::

    %load_ext nbrpc
    %rpc_init -n 2          # the kernel joins as worker0; engines join as worker1, worker2

From a script::

    import nbrpc
    with nbrpc.init(n=2):
        nbrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))

The package is in layers, each importing only those below it; docs/architecture.md
declares them (and ``tests/unit/test_layers.py`` holds the code to that declaration): the
magics on top, then the widgets, ``%%rpc`` cells, the cluster's lifecycle and boot, the
engine sources (``_engines/``), the options, the call facade, the debugger
(``_debugger/``), RPC membership, what travels (``_wire/``), the ledger and autograd,
the torch seam, and plain data at the bottom.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.rpc import RRef, WorkerInfo

from . import autograd
from ._calls.cancel import cancel
from ._calls.facade import get_worker_info, remote, rpc_async, rpc_sync
from ._cells import CellResults, RpcCellError, pull, push, worker_namespace
from ._debugger.postmortem import post_mortem
from ._errors import (
    AlreadyInitializedError,
    AutogradContextError,
    BootError,
    CallCancelledError,
    ClusterClosedError,
    ConfigError,
    DebuggerQuitError,
    DeviceMapError,
    NbrpcError,
    NotInitializedError,
    RemoteError,
    RpcTimeoutError,
    SerializationError,
    SharedHostWarning,
    ThreadsExhaustedError,
    UnknownWorkerError,
    WorkerDiedError,
)
from ._gather.census import ownership
from ._gather.timeline import Recording, record
from ._lifecycle.api import current, init, restart, scale, shutdown, stacks, status, workers
from ._lifecycle.cluster import Cluster, ClusterState
from ._lifecycle.ranks import rank
from ._rows import CallRow, OwnershipRow, StackRow, StatusRow, Trace, WorkerRecord
from ._source_options import Slurm
from ._torch import TorchVersionWarning
from ._wire.pickling import register_by_value
from .autograd import trace_backward

__version__ = "0.1.0"

__all__ = [
    "AlreadyInitializedError",
    "AutogradContextError",
    "BootError",
    "CallCancelledError",
    "CallRow",
    "CellResults",
    "Cluster",
    "ClusterClosedError",
    "ClusterState",
    "ConfigError",
    "DebuggerQuitError",
    "DeviceMapError",
    "NbrpcError",
    "NotInitializedError",
    "OwnershipRow",
    "RRef",
    "Recording",
    "RemoteError",
    "RpcCellError",
    "RpcTimeoutError",
    "SerializationError",
    "SharedHostWarning",
    "Slurm",
    "StackRow",
    "StatusRow",
    "ThreadsExhaustedError",
    "TorchVersionWarning",
    "Trace",
    "UnknownWorkerError",
    "WorkerDiedError",
    "WorkerInfo",
    "WorkerRecord",
    "__version__",
    "autograd",
    "cancel",
    "current",
    "get_worker_info",
    "init",
    "load_ipython_extension",
    "optim",
    "ownership",
    "panel",
    "post_mortem",
    "pull",
    "push",
    "rank",
    "record",
    "register_by_value",
    "remote",
    "restart",
    "rpc_async",
    "rpc_sync",
    "scale",
    "shutdown",
    "stacks",
    "status",
    "trace_backward",
    "widgets",
    "worker_namespace",
    "workers",
]


if TYPE_CHECKING:  # loaded on first use at run time (see __getattr__), seen by type checkers
    from . import optim, widgets


def panel(*, interval: float = 1.0) -> None:
    """Open the cluster panel beside the notebook (``%rpc_panel``): the card of every
    process, the ownership view and the last timeline, live, with buttons that restart a
    worker, show stacks or shut the cluster down (:class:`nbrpc.widgets.ClusterPanel`).
    ``interval``: seconds between redraws. Raises nothing: without a cluster the panel
    says there is none (see :func:`nbrpc.widgets.panel`)."""
    from .widgets import panel as open_panel

    open_panel(interval=interval)


def __dir__() -> list[str]:  # tab completion lists the lazily loaded modules too
    return sorted({*globals(), "optim", "widgets"})


def __getattr__(name: str) -> Any:
    # nbrpc.optim imports torch.distributed.optim, which scripts torch's functional
    # optimizers: 0.7 s measured, paid in every worker. Load it on first use only.
    # nbrpc.widgets imports anywidget and ipywidgets, which workers never need.
    if name in ("optim", "widgets"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'nbrpc' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbrpc``: register the magics (the only place they are registered), and
    route the notebook's torch-style RPC calls through nbrpc (``rpc.rpc_sync`` before
    ``%rpc_init`` then says to run it). ``ipython``: the shell, which IPython passes.
    Starts the warm-up for the first ``%rpc_init`` in the background unless switched off
    (``NBRPC_PREWARM=0``). Raises nothing of its own: a warm-up that fails leaves the first
    ``%rpc_init`` to start afresh, which reports its own errors."""
    from ._calls.spelling import route_torch_calls
    from ._magics import RpcMagics, show_interrupts_short

    magics = RpcMagics(shell=ipython)
    ipython.register_magics(magics)
    show_interrupts_short(ipython)
    route_torch_calls()
    magics.start_warming()  # while the person reads: the first %rpc_init only joins
