"""Where engines come from: one process imports torch once, then forks every engine.

``python -m nbrpc._engines.zygote`` is the *zygote* that :mod:`.local` starts next to the
controller (through :class:`.forked.Zygote`, the kernel's side). It imports torch, nbrpc's
worker side and ipyparallel's engine (about 2.6 s of CPU here, most of it torch), then
waits on stdin for requests, one JSON line each::

    {"argv": [...ipengine options], "env": {...}, "cwd": "...", "output": "LOGFILE"}

and answers each with ``{"pid": PID}`` on stdout after forking a child that becomes that
ipyparallel engine. A cluster of N workers then pays for one import instead of N (on 2
cores: first boot 4.25 s -> about 3 s), and a spare engine costs a fork instead of a
whole interpreter start. The zygote idles blocked on stdin (no CPU) and exits when stdin
closes: when the kernel releases it, or dies. Each engine also exits within a second of
its kernel's death (a kernel killed while a fork was under way never learnt that pid).

Why forking is safe here: the zygote has created no RPC agent, CUDA context, zmq context
or event loop; each child creates its own after the fork. Each child re-seeds Python's
and torch's random generators, which it would otherwise share with its siblings.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
from typing import Any

from ipykernel.iostream import OutStream

from nbrpc import _timers
from nbrpc._engines.forked import KERNEL_ENV, MARKS_ENV
from nbrpc._engines.watchdog import process_alive

#: Modules each engine would otherwise import after the fork, when its IPython kernel
#: starts (ipykernel's debugger brings debugpy and pydevd: 145 modules measured).
_ENGINE_MODULES = (
    "ipyparallel.engine.app",
    "ipykernel.debugger",
    "IPython.core.completerlib",
    "IPython.extensions.storemagic",
    "sqlite3",
    "tornado.queues",
    "torch.distributed.rpc.rref_proxy",
)


class EngineOutStream(OutStream):
    """ipykernel's stdout/stderr for an engine, without taking over file descriptors 1, 2.

    By default ipykernel points fds 1 and 2 of an engine at a pipe that one of its threads
    reads and forwards to the controller, where nothing shows it: what C++ writes there (a
    crash's "terminate called ...", faulthandler's report) was lost with the process, and
    a user's WorkerDiedError had no last words. ipykernel skips that takeover under pytest
    (``PYTEST_CURRENT_TEST``), which every engine of the test suite inherited, so the suite
    saw a log no user had. Engines now keep fds 1 and 2 on their log everywhere
    (``--IPEngine.out_stream_factory``, in :data:`nbrpc._engines.controller.ENGINE_ARGS`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["watchfd"] = False
        super().__init__(*args, **kwargs)


#: The environment variable naming modules every local worker starts with, comma-separated:
#: the zygote imports them after its own, so each fork (a boot, a restart, a scale, a
#: re-init's spares) has them for free. For a library whose import costs seconds
#: (``NBRPC_PRELOAD=transformers``), and torch's RPC test classes in the compatibility tier
#: (2 s a fresh cluster). Set before ``%load_ext nbrpc``, which starts the zygote.
PRELOAD_ENV = "NBRPC_PRELOAD"
KERNEL_CHECK_S = 1.0  # how often a forked engine looks whether its kernel is alive


def preload() -> list[str]:
    """Import the modules :data:`PRELOAD_ENV` names; a line for each that failed, which
    the kernel shows at the first fork (a worker then imports it itself where it is used,
    and shows that error in the calling cell)."""
    import importlib

    said = []
    for name in filter(None, (n.strip() for n in os.environ.get(PRELOAD_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit in a module's top level too
            said.append(
                f"nbrpc: {PRELOAD_ENV} names {name!r}, which the workers' zygote could not "
                f"import ({type(exc).__name__}: {exc}); workers start without it. Fix the "
                "name or install it, then restart the kernel."
            )
    return said


def _imports() -> None:
    """Import what every engine needs (``-m`` already imported the nbrpc package)."""
    import importlib

    # ipyparallel's engine sets this too; debugpy (imported below) warns without it
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    import torch  # noqa: F401  (the point: pay for it once, before any engine exists)

    from nbrpc import _group  # noqa: F401
    from nbrpc._engines import worker  # noqa: F401
    from nbrpc._wire import callee  # noqa: F401

    for name in _ENGINE_MODULES:
        importlib.import_module(name)


def _become_engine(request: dict) -> None:
    """In a forked child: turn into the ipyparallel engine the request describes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; user code must not
    os.setsid()  # like ipyparallel's launchers: the kernel's signals are not the engine's
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])

    import random

    import torch

    random.seed()
    torch.seed()
    kernel = int(os.environ.get(KERNEL_ENV) or 0)
    if kernel:  # a kernel killed before it learnt this pid cannot have it stopped
        _exit_with(kernel)
    marks = os.environ.get(MARKS_ENV)
    if marks:
        with open(os.path.join(marks, str(os.getpid())), "w"):
            pass
    code = _run_ipengine(request["argv"])
    if code and marks:  # it never ran as an engine: say so to the launcher
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(marks, str(os.getpid())))
    os._exit(code)


def _run_ipengine(argv: list[str]) -> int:
    """ipyparallel's engine, in this process; its exit code.

    The caller leaves with ``os._exit``: an engine that stopped (asked to, or after
    missing the controller's heartbeats) must not wait in torch RPC's exit handlers for
    a group it can no longer leave cleanly.
    """
    import faulthandler

    from ipyparallel.engine.app import main as ipengine

    # a crash (a C++ abort, a segfault) writes the Python stack of its thread to the log,
    # where the kernel reads it for the WorkerDiedError (``controller.last_words``)
    faulthandler.enable(all_threads=False)
    sys.argv = ["ipengine", *argv]
    code = 0
    try:
        ipengine()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _exit_with(kernel: int) -> None:
    """Exit this engine once its kernel is gone: checked every second, on the process's
    timer service (:mod:`nbrpc._timers`), not a thread of its own."""
    if not process_alive(kernel):
        os._exit(0)
    _timers.after(KERNEL_CHECK_S, _exit_with, kernel)


def engine(argv: list[str]) -> None:
    """``python -m nbrpc._engines.zygote --engine ARGS``: one engine, no zygote (other hosts).

    ipyparallel's SSH launcher starts this on a worker host: torch is imported before the
    engine registers (so the join is quick), and the process ends with ``os._exit`` once
    the engine stops, as forked engines do.
    """
    _imports()
    os._exit(_run_ipengine(argv))


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        engine(sys.argv[2:])
    kernel = os.getppid()
    _imports()
    said = preload()
    # What the imports made (torch's ~190,000 objects) lives as long as any engine: frozen,
    # a full collection in an engine walks only what the engine made since (measured:
    # about 90 ms each time otherwise, inside the calls that set one off), and the forked
    # engines leave those pages shared (Python's advice for a process that forks workers)
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel watches engines by pid
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        if not line.strip():
            continue
        if os.getppid() != kernel:  # the kernel died while this process was importing
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _become_engine(request)
        replies.write(json.dumps({"pid": pid, "said": said}) + "\n")
        said = []  # said once


if __name__ == "__main__":
    main()
