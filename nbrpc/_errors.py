"""Every error nbrpc raises on its own account.

One base class, so ``except nbrpc.NbrpcError`` catches them all; each also derives from
the builtin a caller would naturally catch (``ValueError`` for bad names, ``TimeoutError``
for deadlines, ``RuntimeError`` for lifecycle mistakes)::

    NbrpcError
    ├── NotInitializedError      (RuntimeError)   a call before %rpc_init / nbrpc.init
    ├── AlreadyInitializedError  (RuntimeError)   %rpc_init twice without %rpc_shutdown
    ├── ClusterClosedError       (RuntimeError)   a handle used after its cluster shut down
    ├── BootError                (RuntimeError)   workers did not start or join in time
    ├── AutogradContextError     (RuntimeError)   distributed autograd outside its context
    ├── ConfigError              (ValueError)     a bad setting: n, names, --listen, ...
    ├── UnknownWorkerError       (ValueError)     a worker name that is not in the group
    ├── DeviceMapError           (ValueError)     a device map names a device a process lacks
    ├── RpcTimeoutError          (TimeoutError)   a call outlived its timeout
    ├── SerializationError       (TypeError)      an argument or result cannot be pickled
    ├── WorkerDiedError          (ConnectionError) the worker's process is gone
    ├── DebuggerQuitError        (RuntimeError)   q (or the stop button) in a worker's pdb
    └── RemoteError                               a worker raised, and the original type
                                                  could not be rebuilt here

A worker's exception whose type *can* be rebuilt is re-raised as that type (a
``ZeroDivisionError`` stays a ``ZeroDivisionError``); it carries ``worker`` and
``remote_traceback`` attributes and a note with the remote traceback. Messages say what
happened and what to do next.
"""

from __future__ import annotations


class NbrpcError(Exception):
    """Base class of every error nbrpc raises itself."""

    _init_args: tuple = ()  # set by subclasses whose __init__ builds the message

    def __reduce__(self) -> tuple:
        # Pickled (a worker's error travelling to the kernel) with the constructor's own
        # arguments, not the finished message, which __init__ would wrap a second time.
        args = self._init_args or self.args
        return (type(self), args, self.__dict__)


class NotInitializedError(NbrpcError, RuntimeError):
    def __init__(self, what: str = "this call") -> None:
        self._init_args = (what,)
        super().__init__(
            f"nbrpc is not initialized, so {what} has no workers to reach. "
            "Run `%rpc_init -n 2` in the notebook (or `nbrpc.init(n=2)` in a script) first."
        )


class AlreadyInitializedError(NbrpcError, RuntimeError):
    pass


class ClusterClosedError(NbrpcError, RuntimeError):
    pass


class BootError(NbrpcError, RuntimeError):
    pass


class AutogradContextError(NbrpcError, RuntimeError):
    """A distributed autograd call outside of (or after) its context."""


class ConfigError(NbrpcError, ValueError):
    """A setting nbrpc cannot use (checked before any process starts)."""


class UnknownWorkerError(NbrpcError, ValueError):
    def __init__(self, name: object, known: list[str]) -> None:
        self.name = name
        self.known = list(known)
        self._init_args = (name, self.known)
        super().__init__(
            f"No worker named {name!r} in this RPC group. "
            f"Known workers: {', '.join(known) or '(none)'}. "
            "Check the spelling, or list them with nbrpc.workers()."
        )


class RpcTimeoutError(NbrpcError, TimeoutError):
    pass


class SerializationError(NbrpcError, TypeError):
    pass


class DeviceMapError(NbrpcError, ValueError):
    """A device map or ``--gpus`` plan that the processes' devices cannot satisfy."""


class WorkerDiedError(NbrpcError, ConnectionError):
    """A worker's process is gone (killed, crashed, out of memory) or unreachable."""

    def __init__(self, worker: str, detail: str = "", last_output: str = "") -> None:
        self.worker = worker
        self._init_args = (worker, detail, last_output)
        super().__init__(
            f"{worker} is gone: its connection closed (the process died or was killed)"
            + (f"; torch said: {detail}" if detail else "")
            + f". Calls to {worker} fail and the objects it owned (RRefs) are lost. "
            "%rpc_status shows which workers are dead; %rpc_shutdown then %rpc_init "
            "rebuilds the cluster in this kernel."
            + (f"\nThe last output of {worker}'s process:\n{last_output}" if last_output else "")
        )


class DebuggerQuitError(NbrpcError, RuntimeError):
    """The debugger on a worker was left with ``q`` (or the stop button): the call ends."""

    def __init__(self, worker: str, call: str = "?") -> None:
        self.worker = worker
        self._init_args = (worker, call)
        super().__init__(
            f"the call of {call} on {worker} was ended in the debugger (q, or the stop "
            "button). Type c (continue) at the (Pdb) prompt to let a call run on and return."
        )


class RemoteError(NbrpcError):
    """A worker raised an exception whose type could not be rebuilt in this process.

    ``ename`` is the remote type's qualified name, ``evalue`` its message, ``worker`` the
    worker's name and ``remote_traceback`` the formatted remote traceback.
    """

    def __init__(self, ename: str, evalue: str, worker: str, remote_traceback: str) -> None:
        self.ename = ename
        self.evalue = evalue
        self.worker = worker
        self.remote_traceback = remote_traceback
        super().__init__(f"{ename}: {evalue} (raised on {worker})")

    def __reduce__(self):
        return (
            type(self),
            (self.ename, self.evalue, self.worker, self.remote_traceback),
        )
