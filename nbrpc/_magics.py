"""``%rpc_init``, ``%rpc_shutdown``, ``%rpc_scale``, ``%rpc_status``, ``%rpc_debug``, ``%%rpc``,
``%%rpc_timeline``, ``%rpc_stacks``: parse
arguments, call the public API.

Registered only by ``%load_ext nbrpc`` (``load_ipython_extension``), never on import.
Arguments the parser refuses raise IPython's ``UsageError``; nbrpc's own errors
(``ConfigError``, ``BootError``, ...) reach the cell with their type, so ``except`` clauses
and nbval see the same exception as from :func:`nbrpc.init`.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool

from . import _cells, _option_text, _process
from ._debugger import postmortem
from ._engines import local
from ._errors import raised_in_rpc_code, show_short
from ._gather import timeline
from ._lifecycle import actions, api as lifecycle

#: ``NBRPC_PREWARM=0`` in the environment: ``%load_ext nbrpc`` starts nothing.
PREWARM_ENV = "NBRPC_PREWARM"


@magics_class
class RpcMagics(Magics):
    prewarm = Bool(
        True,
        help="%load_ext nbrpc starts the controller, the zygote and 2 spare engines in the "
        "background, so that the first %rpc_init only joins them. False (or NBRPC_PREWARM=0 "
        "in the environment): nothing starts before %rpc_init.",
    ).tag(config=True)

    def start_warming(self) -> bool:
        """Warm up for the first ``%rpc_init`` unless switched off; whether it started."""
        if not self.prewarm or os.environ.get(PREWARM_ENV, "1").strip() == "0":
            return False
        return local.prewarm()

    @magic_arguments()
    @argument(
        "targets",
        nargs="*",
        default=[],
        help="'all' (every worker, not the kernel; the default) or worker names, separated "
        "by commas or spaces",
    )
    @cell_magic
    def rpc(self, line: str, cell: str) -> _cells.CellResults:
        """Run the cell on workers, each in its own persistent namespace; output streams
        live as ``[worker1] ...`` and the last expression shows as ``Out[worker1]:``."""
        args = _parse(self.rpc, line)
        return _cells.run(cell, ",".join(args.targets) or "all")

    @magic_arguments()
    @_option_text.magic_arguments
    @argument("--quiet", action="store_true", help="no progress display and no summary")
    @line_magic
    def rpc_init(self, line: str) -> None:
        """Start workers (or attach to an ipyparallel cluster) and join them with the kernel.

        Every option of nbrpc.init() with a flag is an argument here (docs/options.md).
        """
        args = _parse(self.rpc_init, line)
        options = _option_text.from_flags(args)
        if args.quiet:
            options["progress"] = "off"
        cluster = lifecycle.init(**options)
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
        args = _parse(self.rpc_shutdown, line)
        print(actions.shut_down(release=args.release))

    @magic_arguments()
    @argument("names", nargs="+", help="the workers to restart, separated by spaces or commas")
    @line_magic
    def rpc_restart(self, line: str) -> None:
        """Replace workers, dead or alive, with fresh processes under the same names; the
        kernel and the other workers keep everything (their RRefs, namespaces, processes)."""
        args = _parse(self.rpc_restart, line)
        names = [n for part in args.names for n in part.split(",") if n]
        print(actions.restart(*names))

    @magic_arguments()
    @argument("n", nargs="?", type=int, default=None, help="the number of workers to have")
    @argument(
        "--remove",
        default=None,
        help="the workers to leave, separated by commas (default: the highest ranks)",
    )
    @argument("--names", default=None, help="the new workers' names, separated by commas")
    @argument(
        "--hosts",
        default=None,
        help="where new workers start, separated by commas (a --hosts cluster; default: "
        "round-robin over the hosts given at %%rpc_init)",
    )
    @argument(
        "--force",
        action="store_true",
        help="cancel the leavers' calls in flight instead of waiting for them",
    )
    @line_magic
    def rpc_scale(self, line: str) -> None:
        """Grow or shrink the running cluster to N workers, from where its workers came;
        the workers that stay keep everything (their processes, namespaces and RRefs)."""
        args = _parse(self.rpc_scale, line)
        how: dict[str, Any] = {"force": args.force}
        for flag in ("remove", "names"):
            if getattr(args, flag):
                how[flag] = [n for n in getattr(args, flag).split(",") if n.strip()]
        if args.hosts:
            how["hosts"] = tuple(h for h in args.hosts.split(",") if h.strip())
        print(actions.scale(args.n, **how))

    @line_magic
    def rpc_status(self, line: str) -> None:
        """Show the cluster: a live ClusterView in a notebook, a table elsewhere."""
        _no_arguments("rpc_status", line, "nbrpc.status() has the figures of each process")
        if lifecycle.running() is None:
            print("nbrpc: no cluster is running; start one with %rpc_init -n 2")
            return
        if _process.in_notebook():
            from .widgets import show_status

            show_status()
            return
        print(lifecycle.current().summary())

    @magic_arguments()
    @argument("--save", default=None, help="also write the recording as a Chrome trace here")
    @argument(
        "--name",
        default="rpc_timeline",
        help="the notebook variable that keeps the recording (default: rpc_timeline)",
    )
    @cell_magic
    def rpc_timeline(self, line: str, cell: str) -> None:
        """Run the cell (in the kernel, as usual) recording every call the cluster makes;
        show the timeline, live while the cell runs (nbrpc.record())."""
        args = _parse(self.rpc_timeline, line)
        shell = self.shell
        assert shell is not None, "a magic runs in a shell"
        rec = timeline.record()
        shell.user_ns[args.name] = rec
        with rec:
            view = shown = None
            if _process.in_notebook():
                from .widgets import show_timeline

                view, shown = show_timeline(rec)
            shell.run_cell(cell)
        if view is not None and shown is not None:
            view.refresh()
            shown.update(view)  # the final text too, for front ends without widgets
        else:
            print(repr(rec))
        if args.save:
            print(f"nbrpc: trace written to {rec.save(args.save)} (open it in ui.perfetto.dev)")

    @magic_arguments()
    @argument(
        "names",
        nargs="*",
        default=[],
        help="the processes (the kernel's name, worker names; default: all), separated by "
        "spaces or commas",
    )
    @argument(
        "--all",
        action="store_true",
        dest="all_threads",
        help="every thread, also nbrpc's and the libraries' own that serve no call and run "
        "none of your code (left out by default, and counted)",
    )
    @line_magic
    def rpc_stacks(self, line: str) -> None:
        """Print the Python stack of each thread that serves a call or runs your code, in
        each process, with the call it serves and its caller (--all: every thread); read
        from outside each worker, so busy workers answer too."""
        args = _parse(self.rpc_stacks, line)
        print(actions.stacks(*args.names, all_threads=args.all_threads))

    @line_magic
    def rpc_panel(self, line: str) -> None:
        """Open the cluster panel in JupyterLab's right side bar: the card of every
        process, the ownership view, the last timeline, and buttons that restart a worker,
        show stacks or shut the cluster down; live, beside the notebook."""
        _no_arguments("rpc_panel", line, "it shows every process")
        from .widgets import panel

        panel()

    @line_magic
    def rpc_debug(self, line: str) -> None:
        """Post-mortem: pdb on the worker frame that raised the last remote exception
        (up/down walk its frames, p prints its locals, c or q leaves)."""
        _no_arguments("rpc_debug", line, "it opens the last remote exception")
        postmortem.post_mortem()


def show_interrupts_short(shell: Any) -> None:
    """The stop button's KeyboardInterrupt that lands in nbrpc's or torch's RPC code
    between nbrpc's waits (a loop of small calls spends much of its time there) shows the
    cell's lines, as one raised in a wait does (``nbrpc._errors.show_short``). Installed only
    where no other handler of IPython's custom exceptions is: a user's is kept."""
    if shell.custom_exceptions:
        return

    def interrupted(shell: Any, etype: Any, value: Any, tb: Any, tb_offset: Any = None) -> None:
        if raised_in_rpc_code(value):
            show_short(value)
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)

    shell.set_custom_exc((KeyboardInterrupt,), interrupted)


def _no_arguments(magic: str, line: str, instead: str) -> None:
    """A magic that takes no arguments refuses them rather than ignoring them: a person
    who typed ``%rpc_status worker1`` expected something else than the whole table."""
    extra = strip_comment(line).strip()
    if extra:
        raise UsageError(f"%{magic} takes no arguments (got {extra!r}): {instead}")


def _parse(magic: Any, line: str) -> Any:
    """The magic's arguments, read as a person types them: a trailing ``# comment`` is a
    comment, as in a Python line (``%rpc_init -n 2  # two workers``)."""
    return parse_argstring(magic, strip_comment(line))


def strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment: a ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line
