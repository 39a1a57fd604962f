"""``%rpc_init``, ``%rpc_shutdown``, ``%rpc_status``, ``%rpc_debug``, ``%%rpc``: parse
arguments, call the public API.

Registered only by ``%load_ext nbrpc`` (``load_ipython_extension``), never on import.
Arguments the parser refuses raise IPython's ``UsageError``; nbrpc's own errors
(``ConfigError``, ``BootError``, ...) reach the cell with their type, so ``except`` clauses
and nbval see the same exception as from :func:`nbrpc.init`.
"""

from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import _cells, _cluster, _postmortem, _shm
from ._devices import parse_device_map
from ._progress import in_notebook

__all__ = ["RpcMagics"]


@magics_class
class RpcMagics(Magics):
    @magic_arguments()
    @argument(
        "targets",
        nargs="?",
        default="all",
        help="'all' (every worker, not the kernel) or worker names, comma-separated",
    )
    @cell_magic
    def rpc(self, line: str, cell: str) -> _cells.CellResults:
        """Run the cell on workers, each in its own persistent namespace; output streams
        live as ``[worker1] ...`` and the last expression shows as ``Out[worker1]:``."""
        args = parse_argstring(self.rpc, line)
        return _cells.run(cell, args.targets)

    @magic_arguments()
    @argument("-n", type=int, default=None, help="number of workers to start (default 2)")
    @argument("--names", default=None, help="comma-separated worker names, e.g. ps,trainer1")
    @argument("--self", dest="self_name", default="worker0", help="the kernel's name")
    @argument("--threads", type=int, default=None, help="RPC threads per process (default 16)")
    @argument("--timeout", type=float, default=None, help="default RPC timeout, seconds (60)")
    @argument("--init-method", default=None, help="tcp://HOST:PORT for groups across hosts")
    @argument("--profile", default=None, help="attach to the ipyparallel cluster of this profile")
    @argument("--cluster-id", default=None, help="attach to the ipyparallel cluster with this id")
    @argument(
        "--listen",
        default=None,
        metavar="ADDR",
        help="this host's address for workers on other hosts (default: loopback only; "
        "anyone who reaches it can run code: see docs/security.md)",
    )
    @argument("--gpus", default=None, help="'auto': one GPU per process, device maps for all pairs")
    @argument(
        "--device-map",
        action="append",
        default=[],
        metavar="WORKER=LOCAL->REMOTE",
        help="the kernel's device map to WORKER, e.g. worker1=cuda:0->cuda:1 (repeatable)",
    )
    @argument(
        "--no-shm",
        action="store_true",
        help="send large CPU tensors through TensorPipe, not shared memory",
    )
    @argument(
        "--python",
        default=None,
        metavar="PATH",
        help="the interpreter workers run (default: the kernel's); it needs torch and nbrpc",
    )
    @argument(
        "--process-group",
        default=None,
        metavar="BACKEND",
        help="the workers also form a torch.distributed process group: gloo or nccl",
    )
    @argument(
        "--process-group-workers",
        default=None,
        metavar="NAMES",
        help="its members in rank order, comma-separated (default: every worker)",
    )
    @argument(
        "--hosts",
        default=None,
        metavar="HOST[,HOST...]",
        help="workers on other hosts over ssh, one per entry ([user@]address), named in "
        "order; a host listed N times gets N workers (docs/multi-host.md)",
    )
    @argument(
        "--ssh-args",
        default=None,
        metavar="ARGS",
        help="extra ssh options for --hosts, quoted, e.g. --ssh-args '-F ~/.ssh/cluster_config'",
    )
    @argument(
        "--remote-python",
        default=None,
        metavar="PATH",
        help="the interpreter on the hosts (default: the kernel's path)",
    )
    @argument("--quiet", action="store_true", help="no progress display and no summary")
    @line_magic
    def rpc_init(self, line: str) -> None:
        """Start workers (or attach to an ipyparallel cluster) and join them with the kernel."""
        args = parse_argstring(self.rpc_init, line)
        names = [s for s in args.names.split(",") if s.strip()] if args.names else None
        maps = dict(parse_device_map(text) for text in args.device_map)
        cluster = _cluster.init(
            args.n,
            names=names,
            self_name=args.self_name,
            num_worker_threads=args.threads,
            rpc_timeout=args.timeout,
            init_method=args.init_method,
            listen=args.listen,
            gpus=args.gpus,
            device_maps=maps or None,
            shm_threshold=None if args.no_shm else _shm.DEFAULT_THRESHOLD,
            profile=args.profile,
            cluster_id=args.cluster_id,
            progress="off" if args.quiet else "auto",
            python=args.python,
            process_group=args.process_group,
            process_group_workers=args.process_group_workers.split(",")
            if args.process_group_workers
            else None,
            hosts=args.hosts,
            ssh_args=_unquote(args.ssh_args),
            remote_python=args.remote_python,
        )
        if not args.quiet:
            print(cluster.summary())

    @magic_arguments()
    @argument(
        "--release",
        action="store_true",
        help="also stop the controller and the warm spare engines kept for a fast next %%rpc_init",
    )
    @line_magic
    def rpc_shutdown(self, line: str) -> None:
        """Workers leave gracefully; engines started by %rpc_init stop."""
        args = parse_argstring(self.rpc_shutdown, line)
        if not _cluster._current:
            _cluster.shutdown(release=args.release)
            print(
                "nbrpc: no cluster is running"
                + ("; released the controller and spare engines" if args.release else "")
            )
            return
        cluster = _cluster.current()
        cluster.shutdown(release=args.release)
        print(
            f"nbrpc: shut down ({', '.join(r.name for r in cluster.records[1:])} left)"
            + ("; controller and spare engines released" if args.release else "")
        )

    @line_magic
    def rpc_status(self, line: str) -> None:
        """Show the cluster: a live ClusterView in a notebook, a table elsewhere."""
        if not _cluster._current:
            print("nbrpc: no cluster is running; start one with %rpc_init -n 2")
            return
        if in_notebook():
            from IPython.display import display

            from .widgets import ClusterView

            display(ClusterView())
            return
        print(_cluster.current().summary())

    @line_magic
    def rpc_debug(self, line: str) -> None:
        """Post-mortem: pdb on the worker frame that raised the last remote exception
        (up/down walk its frames, p prints its locals, c or q leaves)."""
        _postmortem.post_mortem()


def _unquote(value: str | None) -> str | None:
    """IPython splits magic lines keeping quotes: ``--ssh-args '-F cfg'`` arrives quoted."""
    if value and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value
