"""Run torch's own RPC test classes on nbrpc clusters: the compatibility tier.

nbrpc promises that torch's spelling behaves as torch does (docs/compatibility.md); the
reference for "as torch does" is torch's own RPC test suite, which ships in the wheel
under ``torch/testing/_internal/distributed/``. This tool runs those test classes, built the
way torch's ``test/distributed/rpc/test_tensorpipe_agent.py`` builds them
(``rpc_utils.generate_tests``), on real nbrpc clusters, and writes a table of the results.

How a test runs. torch's ``MultiProcessTestCase`` runs every test method once per rank, in
``world_size`` fresh processes, and ``dist_init`` wraps each body in ``init_rpc`` ...
``shutdown``. Here the ranks are an nbrpc cluster of the class's world size: the calling
process (a *kernel*, as a notebook's) is rank 0 and runs the method on its main thread;
each worker runs the same method for its own rank at the same time, on its engine's main
thread (started through ipyparallel, not over RPC). The fixture's ``init_rpc`` and
``shutdown`` become barriers over a TCP store, because the group already exists and
nbrpc, not the test, owns its lifetime; everything in between is torch's test, unchanged.
Each test gets a fresh cluster (a re-init takes well under a second) so that no worker
state crosses tests, as torch's fresh processes ensure.

Crashes and hangs. The kernel side runs in a child process (``--kernel``) for the classes
that need one environment (all but ``DdpUnderDistAutogradTest``), which this process
watches: a test that outlives ``--timeout`` is recorded as hung (with the stacks of every
rank in the log), a kernel that dies as crashed, and the run goes on with a fresh kernel
and cluster for the rest.

The second look. Only a kernel's first cluster gives workers torch ids equal to their
ranks, so each test that failed in a kernel's later cluster runs again at the end, alone
in a fresh kernel (:func:`second_look`): passing there, it counts as "first cluster only";
failing there too, it is a failure of its own cause. ``--no-second-look`` leaves it out.

Usage::

    python tools/compat.py [--classes RpcTest,DistAutogradTest] [-k PATTERN]
                           [--out FILE.md] [--json FILE.json] [--timeout SECONDS]
                           [--tests-per-kernel N] [--no-second-look]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

#: The module name this file has in every process of a run: the kernel loads it under this
#: name and installs it on each engine, so its functions travel to engines by reference.
MODULE_NAME = "torch_compat_tier"

#: The classes of the tier, in the order of the report; torch's names without the
#: ``TensorPipe`` prefix that ``generate_tests`` adds.
CLASS_ORDER = [
    "RpcTest",
    "DistAutogradTest",
    "DistOptimizerTest",
    "JitRpcTest",
    "JitDistAutogradTest",
    "TensorPipeAgentRpcTest",
    "TensorPipeAgentDistAutogradTest",
    "DdpComparisonTest",
    "ParameterServerTest",
    "ReinforcementLearningRpcTest",
    "RemoteModuleTest",
    "ThreeWorkersRemoteModuleTest",
    "DdpUnderDistAutogradTest",
]
#: torch's CUDA classes, built as torch's ``test/distributed/rpc/cuda/test_tensorpipe_agent.py``
#: builds them (``GENERIC_CUDA_TESTS + TENSORPIPE_CUDA_TESTS``): in the default selection
#: where CUDA is, by name anywhere (each test then says how many GPUs it needs)
CUDA_CLASS_ORDER = [
    "CudaRpcTest",
    "CudaDistAutogradTest",
    "CudaRemoteModuleTest",
    "CudaDdpComparisonTest",
    "TensorPipeAgentCudaRpcTest",
    "TensorPipeCudaDistAutogradTest",
]

#: Per-test limit (seconds) once every rank is ready; torch's own default is 300 s per
#: test, but its RPC timeouts are 60 s, so a test alive at 180 s is stuck.
DEFAULT_TIMEOUT_S = 180.0
#: After one rank fails, how long the others get to finish before the test is decided
#: (torch's MultiProcessTestCase terminates the remaining ranks at once).
GRACE_S = 5.0
#: How much longer than the kernel's own deadline this process waits before it kills it.
BACKSTOP_S = 45.0

#: Tests whose own ``init_rpc``/``shutdown`` are exactly the standard join and leave that
#: ``dist_init`` does (same name, rank, world size and options, once each, graceful): they
#: run with the same substitution. Any other use is caught at run time (NotApplicable).
STANDARD_JOIN = {
    "test_batch_updating_parameter_server",
    "test_rl_rpc",
}

#: Tests that leave a thread of rank 0 stuck for good, on purpose: torch's process ends
#: after them, a kernel would carry the thread into every later test. The kernel ends
#: after such a test and the rest of its class goes on in a fresh one.
#: ``test_backward_unused_send_function`` hangs a distributed backward whose send function
#: never gets its gradient (torch's documented hang); torch cannot end that wait, so the
#: process keeps one backward pass and its contexts, and ``test_debug_info``'s counts of
#: them, checked later in the same kernel, failed (docs/compatibility.md).
LEAVES_A_THREAD_STUCK = {"test_backward_unused_send_function"}

#: Reasons for tests that the source rules below would not explain well.
SPECIAL_REASONS = {
    "test_pg_init_no_rpc_init": "expects a process with no RPC agent "
    "('Current RPC agent is not set'); every process of an nbrpc cluster is in the group",
    "test_backward_unused_send_function": "asserts that torch's distributed backward hangs "
    "on a graph whose send function never gets its gradient; in an nbrpc cluster torch's "
    "spelling refuses that graph at once (AutogradContextError), by design",
}

OUTCOMES = ("passed", "failed", "hung", "crashed", "n.a.")

#: torch's test modules, imported once in a kernel's zygote (``NBRPC_PRELOAD``): every
#: fresh cluster's workers are forks that have them, where each imported them anew (about
#: 2 s a cluster of 3 on 2 cores, more than the boot itself); a fork has their state as
#: first imported, as a fresh process of torch's own runner does.
PRELOADED = (
    "expecttest",
    "torch.testing._internal.distributed.rpc_utils",
    "torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture",
)

#: The kernels' environment (the workers inherit it): torch's tests append a "to execute
#: this test, run ..." paragraph to every failure, which names a file that is not there.
KERNEL_ENV = {
    **os.environ,
    "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
    "NBRPC_PRELOAD": ",".join(PRELOADED),
}

#: What a class's kernel (and so its workers) gets in its environment besides.
#: ``DdpUnderDistAutogradTest``: its master sends ``rpc.remote(trainer, Trainer)`` as soon
#: as its own ``init_process_group`` returns, and ``Trainer.__init__`` calls
#: ``dist.new_group``, which needs the trainer's default group. torch used to end
#: ``init_process_group`` with a barrier over all ranks; since that is off by default
#: (``TORCH_DIST_INIT_BARRIER``, 2023) a trainer whose main thread had not yet set
#: its default group fails its ``Trainer`` ("Default process group has not been
#: initialized", seen in a full run), the other trainers wait for it in the gloo rendezvous
#: of ``new_group`` (their stacks, in the tier's log), and the master's first wait times out
#: after 60 s: 2 of 5 class runs here beside a busy core, as torch's own CI saw it
#: (pytorch/pytorch#40378, #45123). The barrier the test was written against comes back.
CLASS_ENV: dict[str, dict[str, str]] = {
    "DdpUnderDistAutogradTest": {"TORCH_DIST_INIT_BARRIER": "1"},
}


# -- the test classes and which tests apply ------------------------------------------------


@functools.cache
def test_classes() -> dict[str, type]:
    """The tier's classes, built as torch's test_tensorpipe_agent.py builds them."""
    from torch.testing._internal.distributed import rpc_utils
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    generated = rpc_utils.generate_tests(
        "TensorPipe",
        TensorPipeRpcAgentTestFixture,
        rpc_utils.GENERIC_TESTS
        + rpc_utils.TENSORPIPE_TESTS
        + rpc_utils.GENERIC_CUDA_TESTS
        + rpc_utils.TENSORPIPE_CUDA_TESTS,
        MODULE_NAME,
    )
    by_name = {name.removeprefix("TensorPipe"): cls for name, cls in generated.items()}
    return {name: by_name[name] for name in CLASS_ORDER + CUDA_CLASS_ORDER}


def default_classes() -> list[str]:
    """The classes a run takes when none are named: the CUDA ones too where CUDA is."""
    import torch

    return CLASS_ORDER + (CUDA_CLASS_ORDER if torch.cuda.is_available() else [])


def gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_names(cls: type) -> list[str]:
    """The test methods unittest would run, in its order."""
    return list(unittest.TestLoader().getTestCaseNames(cls))


def world_size(cls: type) -> int:
    """The class's world size (a property of the fixture, read without an instance)."""
    return int(cls.world_size.fget(object.__new__(cls)))  # type: ignore[attr-defined]


def _source(func: Callable[..., Any]) -> str:
    try:
        return inspect.getsource(inspect.unwrap(func))
    except (OSError, TypeError):
        return ""


def _code_with_helpers(cls: type, name: str, depth: int = 2) -> str:
    """A test's source and that of the ``self._helpers`` it calls (``depth`` levels)."""
    seen: set[str] = set()
    parts: list[str] = []
    todo = [name]
    for _ in range(depth + 1):
        found: list[str] = []
        for method in todo:
            if method in seen or not callable(getattr(cls, method, None)):
                continue
            seen.add(method)
            text = _source(getattr(cls, method))
            parts.append(text)
            found += re.findall(r"self\.(_\w+)\(", text)
        todo = found
    return "\n".join(parts)


_OWN_INIT = re.compile(r"\b(init_rpc|_init_rpc_backend|_set_and_start_rpc_agent)\(")
_OWN_SHUTDOWN = re.compile(r"\brpc\.shutdown\(")


def _gpus_needed(func: Any, head: str) -> int | None:
    """How many GPUs ``skip_if_lt_x_gpu(N)`` asks for; N a number or a name of the test's
    module (``skip_if_lt_x_gpu(NUM_TRAINERS)``: 4, in the DDP comparison test)."""
    needs = re.search(r"skip_if_lt_x_gpu\((\w+)\)", head)
    if needs is None:
        return None
    word = needs.group(1)
    if word.isdigit():
        return int(word)
    value = getattr(inspect.getmodule(inspect.unwrap(func)), word, None)
    return value if isinstance(value, int) else None


def not_applicable(cls: type, name: str) -> str | None:
    """Why test ``name`` of ``cls`` cannot run on an nbrpc cluster (None: it can).

    Read from the test's source: a test that starts or stops its own RPC group tests
    torch's group lifecycle, which nbrpc replaces; one that needs CUDA needs a GPU; one
    torch skips here is skipped.
    """
    func = getattr(cls, name)
    if getattr(func, "__unittest_skip__", False):
        return f"torch skips it here: {getattr(func, '__unittest_skip_why__', '')}"
    test = _source(func)
    head = test.split("def ", 1)[0]  # the decorators
    count = _gpus_needed(func, head)
    have = gpus_here()
    if count and count > have:
        plural = "s" if count > 1 else ""
        return f"needs {count} CUDA GPU{plural} (this machine has {have or 'none'})"
    if not have and re.search(r"requires_nccl|skip_if_no_gpu", head):
        return "needs CUDA GPUs (this machine has none)"
    if name in SPECIAL_REASONS:
        return SPECIAL_REASONS[name]
    if name in STANDARD_JOIN:
        return None
    if "clean_shutdown=False" in head:
        return "ends with an ungraceful shutdown of the group (dist_init(clean_shutdown=False))"
    code = _code_with_helpers(cls, name)
    body = "\n".join(line for line in code.splitlines() if not line.strip().startswith("@"))
    own_init, own_shutdown = _OWN_INIT.search(body), _OWN_SHUTDOWN.search(body)
    if own_init and own_shutdown:
        return "starts and stops its own RPC group (init_rpc and rpc.shutdown in the test)"
    if own_init:
        return f"calls {own_init.group(1)} itself (tests the group's start-up)"
    if own_shutdown:
        return "calls rpc.shutdown itself in the middle of the test"
    return None


# -- one rank of one test (runs in every process) --------------------------------------------


class NotApplicable(BaseException):
    """The test did something at run time that only a group of its own allows.

    A BaseException so that a test's ``except Exception`` does not swallow it.
    """


class PeerFailed(BaseException):
    """Another rank failed: this rank's barrier gives up (not this rank's own error)."""


_stores: dict[tuple[str, int], Any] = {}


def _store(host: str, port: int) -> Any:
    """This process's client of the run's TCP store (the kernel hosts it)."""
    from torch.distributed import TCPStore

    key = (host, port)
    if key not in _stores:
        _stores[key] = TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
        )
    return _stores[key]


class Fence:
    """Stand-ins for ``rpc.init_rpc`` and ``rpc.shutdown`` during one test in one rank.

    torch's ``dist_init`` joins a fresh static group before the body and leaves it after;
    on an nbrpc cluster the group exists already and outlives the test, so joining is a
    barrier of all ranks (everyone is in the test before anyone calls) and a graceful
    shutdown is a barrier too (nobody leaves while another still calls). Any other use of
    the two (a second join, other names or ranks, an ungraceful shutdown) is torch's
    group lifecycle itself, which a shared cluster cannot offer: NotApplicable.
    """

    def __init__(self, spec: dict[str, Any], store: Any) -> None:
        self.spec = spec
        self.store = store
        self.key = spec["key"]
        self.joined = False
        self.rounds: dict[str, int] = {}

    def init_rpc(
        self,
        name: str | None = None,
        backend: Any = None,
        rank: int = -1,
        world_size: int | None = None,
        rpc_backend_options: Any = None,
    ) -> None:
        expected = f"worker{self.spec['rank']}"
        if self.joined:
            raise NotApplicable("calls init_rpc a second time")
        if (name, rank, world_size) != (expected, self.spec["rank"], self.spec["world_size"]):
            raise NotApplicable(
                f"joins as {name!r} rank {rank} of {world_size} (the cluster has {expected} "
                f"rank {self.spec['rank']} of {self.spec['world_size']})"
            )
        self.barrier("init")
        self.joined = True

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        if not graceful:
            raise NotApplicable("shuts the group down ungracefully")
        if not self.joined:
            raise NotApplicable("calls rpc.shutdown without a matching init_rpc")
        self.barrier("shutdown")
        self.joined = False

    def fail(self, text: str) -> None:
        """Tell the other ranks that this one failed (the first failure is kept)."""
        with contextlib.suppress(Exception):
            if int(self.store.add(f"{self.key}/nfailed", 1)) == 1:
                self.store.set(f"{self.key}/failed", text)

    def barrier(self, phase: str) -> None:
        n = self.rounds[phase] = self.rounds.get(phase, 0) + 1
        name = f"{self.key}/{phase}{n}"
        world = self.spec["world_size"]
        self.store.add(name, 1)
        deadline = time.monotonic() + self.spec["timeout"]
        pause = 0.002
        while True:
            arrived = int(self.store.add(name, 0))
            if arrived >= world:
                return
            if self.store.check([f"{self.key}/failed"]):
                raise PeerFailed(self.store.get(f"{self.key}/failed").decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{phase} barrier: {arrived} of {world} ranks arrived")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _where(exc: BaseException) -> str:
    """The innermost frame of torch's test code that the exception went through."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "testing/_internal" in f.filename] or frames
    if not inside:
        return ""
    f = inside[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} ({f.name})"


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one test method as rank ``spec['rank']`` in this process; its outcome.

    The instance is set up as MultiProcessTestCase sets up a rank's (``rank``,
    ``file_name``, torch's seed) without its ``setUp``, which would spawn processes.
    """
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    import torch.distributed.rpc.api as rpc_api
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    cls = test_classes()[spec["class"]]
    store = _store(spec["store_host"], spec["store_port"])
    fence = Fence(spec, store)
    result: dict[str, Any] = {"rank": spec["rank"], "outcome": "passed", "error": ""}
    saved = (rpc.init_rpc, rpc.shutdown, rpc_api._ignore_rref_leak)
    timeout_before = rpc.get_rpc_timeout()
    started = time.monotonic()
    try:
        instance = cls(spec["test"])
        instance.rank = spec["rank"]
        instance.file_name = spec["file_name"]
        rpc.init_rpc, rpc.shutdown = fence.init_rpc, fence.shutdown  # type: ignore[assignment]
        common_utils.set_rng_seed()
        getattr(instance, spec["test"])()
    except unittest.SkipTest as exc:
        result.update(outcome="skipped", error=f"torch skips it: {exc}")
    except SystemExit as exc:  # torch's skip decorators exit the process with a code
        skips = {s.exit_code: s.message for s in TEST_SKIPS.values()}
        if exc.code in skips:
            result.update(outcome="skipped", error=f"torch skips it: {skips[exc.code]}")
        else:
            result.update(outcome="failed", error=f"SystemExit: {exc.code}")
            result["failed_at"] = time.monotonic()
            fence.fail(f"rank {spec['rank']}: SystemExit {exc.code}")
    except NotApplicable as exc:
        result.update(outcome="n.a.", error=str(exc))
        fence.fail(f"rank {spec['rank']} cannot run here: {exc}")
    except PeerFailed as exc:
        result.update(outcome="peer", error=f"gave up: {exc}")
    except BaseException as exc:
        result.update(
            failed_at=time.monotonic(),
            outcome="failed",
            error=_first_line(exc),
            where=_where(exc),
            traceback="".join(traceback.format_exception(exc))[-6000:],
        )
        fence.fail(f"rank {spec['rank']}: {_first_line(exc)}")
    finally:
        rpc.init_rpc, rpc.shutdown, rpc_api._ignore_rref_leak = saved  # type: ignore[assignment]
        with contextlib.suppress(Exception):
            rpc._set_rpc_timeout(timeout_before)
        if dist.is_initialized():  # as MultiProcessTestCase.run_test does after each test
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    result["finished"] = time.monotonic()
    result["seconds"] = round(result["finished"] - started, 2)
    return result


def prepare_engine() -> int:
    """On a fresh engine: build torch's test classes before the clock starts (their modules
    came with the fork: :data:`PRELOADED`)."""
    test_classes()
    return os.getpid()


#: What the kernel runs on each fresh engine, with the builtin ``exec`` (a builtin travels
#: by reference): load this file as MODULE_NAME, so that its functions can follow by name.
_INSTALL = """
import importlib.util, sys
if {name!r} not in sys.modules:
    spec = importlib.util.spec_from_file_location({name!r}, {path!r})
    module = importlib.util.module_from_spec(spec)
    sys.modules[{name!r}] = module
    spec.loader.exec_module(module)
"""


# -- the kernel side: one child process per environment (or the rest of its tests) ----------


@dataclass
class TestResult:
    """The outcome of one test, as the report shows it."""

    cls: str
    test: str
    outcome: str  # one of OUTCOMES
    error: str = ""  # the first line of the deciding error, or why it does not apply
    where: str = ""  # the innermost frame of torch's test code it came from
    rank: int | None = None  # the rank whose error decided the outcome
    seconds: float = 0.0
    detail: str = ""  # a traceback or stacks, for the log
    #: set where a test that failed in a kernel's later cluster ran again in a fresh
    #: kernel's first one (:func:`second_look`): what it said the first time
    after_reinit: str = ""


class _Snapshot:
    """Module-level lists, dicts and sets of torch's test modules, as first imported.

    Tests keep state there (``rpc_done``, ``known_context_ids`` ...) and assume a fresh
    process; the kernel outlives its tests, so it gets them back before each one. A
    ``concurrent.futures.Future`` there (``VALUE_FUTURE``, ``DONE_FUTURE``: one test's
    rank tells another it may go on) comes back unset: a value left by an earlier test
    would let ``test_function_not_on_callee`` call before its callee removed the function.
    """

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []
        for name, module in list(sys.modules.items()):
            if not name.startswith(
                ("torch.testing._internal.distributed", "torch.testing._internal.dist_utils")
            ):
                continue
            for attr, value in vars(module).items():
                if attr.startswith("__"):
                    continue
                if isinstance(value, concurrent.futures.Future):
                    self.saved.append((module, attr, _UNSET_FUTURE))
                elif isinstance(value, list | dict | set):
                    with contextlib.suppress(Exception):
                        self.saved.append((module, attr, copy.deepcopy(value)))

    def restore(self) -> None:
        for module, attr, value in self.saved:
            fresh = concurrent.futures.Future() if value is _UNSET_FUTURE else copy.deepcopy(value)
            setattr(module, attr, fresh)


_UNSET_FUTURE = object()  # a module's concurrent.futures.Future, made anew at each restore


class Kernel:
    """Runs tests as rank 0, each on a fresh cluster of its class's world size, and
    reports each (the job's ``tests``: ``[class, world_size, test]`` entries)."""

    def __init__(self, job: dict[str, Any], report_path: str) -> None:
        from torch.distributed import TCPStore

        self.job = job
        self.report = open(report_path, "a", buffering=1)  # noqa: SIM115 (open for the run)
        self.lock = threading.Lock()
        self.decided = False
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.tmp = tempfile.mkdtemp(prefix="torch-compat-")
        self.count = 0
        self.last_outcome = ""
        self.cls, self.size = "", 0  # the running test's class and world size

    def emit(self, record: dict[str, Any]) -> None:
        self.report.write(json.dumps(record) + "\n")
        self.report.flush()
        os.fsync(self.report.fileno())

    def decide(self, result: TestResult) -> bool:
        """Report ``result`` unless the test was decided already (main thread vs monitor)."""
        with self.lock:
            if self.decided:
                return False
            self.decided = True
            self.emit({"event": "result", **asdict(result)})
            return True

    def run(self) -> None:
        import nbrpc

        test_classes()
        snapshot = _Snapshot()
        for cls_name, size, test in self.job["tests"]:
            self.cls, self.size = cls_name, size
            snapshot.restore()
            try:
                cluster = nbrpc.init(self.size - 1, progress=False)
                ids = [r.engine_id for r in cluster.records[1:]]
                code = _INSTALL.format(name=MODULE_NAME, path=os.path.abspath(__file__))
                for ar in [cluster.engines.apply(i, exec, code, {}) for i in ids]:
                    ar.get(60)
                for ar in [cluster.engines.apply(i, prepare_engine) for i in ids]:
                    ar.get(120)
            except Exception as exc:
                self.emit({"event": "start", "class": self.cls, "test": test})
                self.decide(TestResult(self.cls, test, "crashed", f"no cluster: {exc!r}"))
                os._exit(5)
            self.run_test(cluster, test)
            try:
                nbrpc.shutdown(graceful=self.last_outcome == "passed", timeout=15)
            except Exception as exc:  # the driver starts a fresh kernel for the rest
                sys.stderr.write(f"shutdown after {test} failed: {exc!r}\n")
                os._exit(6)
        nbrpc.shutdown(release=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_test(self, cluster: Any, test: str) -> None:
        self.count += 1
        self.decided = False
        file_name = os.path.join(self.tmp, f"init{self.count}")
        open(file_name, "w").close()
        base = {
            "class": self.cls,
            "test": test,
            "world_size": self.size,
            "file_name": file_name,
            "store_host": "127.0.0.1",
            "store_port": self.store.port,
            "key": f"{os.getpid()}/{self.count}",
            "timeout": self.job["timeout"],
        }
        self.emit({"event": "start", "class": self.cls, "test": test})
        started = time.monotonic()
        deadline = started + self.job["timeout"]
        # torch's rank of a worker is its place in the cluster (its name is worker{rank});
        # its torch worker id may differ after a re-init of the kernel's group
        workers = {
            rank: cluster.engines.apply(r.engine_id, run_rank, {**base, "rank": rank})
            for rank, r in enumerate(cluster.records)
            if rank
        }
        own: dict[int, dict[str, Any]] = {}
        watch = threading.Thread(
            target=self.monitor, args=(test, workers, own, started, deadline), daemon=True
        )
        watch.start()
        own[0] = run_rank({**base, "rank": 0})  # on this process's main thread
        while not self.decided and not all(ar.ready() for ar in workers.values()):
            time.sleep(0.02)
        if self.decided:  # by the monitor, which is ending this process
            time.sleep(60)
            os._exit(3)
        results = self.collect(workers, own)
        result = self.verdict(test, results, time.monotonic() - started)
        self.last_outcome = result.outcome
        self.decide(result)
        with contextlib.suppress(OSError):
            os.remove(file_name)

    def collect(
        self, workers: dict[int, Any], own: dict[int, dict[str, Any]]
    ) -> dict[int, dict[str, Any]]:
        """Every rank's result so far (an engine that died is a crash of that rank)."""
        results = dict(own)
        for rank, ar in workers.items():
            if not ar.ready():
                continue
            try:
                results[rank] = ar.get(0)
            except Exception as exc:
                results[rank] = {
                    "rank": rank,
                    "outcome": "crashed",
                    "error": f"rank {rank}'s process: {_first_line(exc)}",
                    "finished": time.monotonic(),
                }
        return results

    def verdict(self, test: str, results: dict[int, dict[str, Any]], seconds: float) -> TestResult:
        """One outcome from every rank's: torch's rule, where one failing rank fails it."""
        cls_name = self.cls
        seconds = round(seconds, 2)
        for outcome in ("crashed", "n.a."):
            for rank, r in sorted(results.items()):
                if r["outcome"] == outcome:
                    return TestResult(
                        cls_name, test, outcome, r["error"], rank=rank, seconds=seconds
                    )
        failed = [r for r in results.values() if r["outcome"] == "failed"]
        if failed:
            # the first to fail decided it: a peer that failed later (a collective whose
            # other end closed, as the failed rank cleaned up) only followed
            first = min(failed, key=lambda r: r.get("failed_at", r["finished"]))
            return TestResult(
                cls_name,
                test,
                "failed",
                f"rank {first['rank']}: {first['error']}",
                first.get("where", ""),
                first["rank"],
                seconds,
                first.get("traceback", ""),
            )
        if any(r["outcome"] == "peer" for r in results.values()):
            peer = next(r for r in results.values() if r["outcome"] == "peer")
            return TestResult(cls_name, test, "failed", peer["error"], seconds=seconds)
        if results.get(0, {}).get("outcome") == "skipped":
            return TestResult(cls_name, test, "n.a.", results[0]["error"], seconds=seconds)
        return TestResult(cls_name, test, "passed", seconds=seconds)

    def monitor(
        self,
        test: str,
        workers: dict[int, Any],
        own: dict[int, dict[str, Any]],
        started: float,
        deadline: float,
    ) -> None:
        """Decide a test the main thread cannot: a rank failed and others never finish,
        or the deadline passed. Then end this process (its watchdog stops the engines)."""
        first_failure: float | None = None
        while not self.decided:
            time.sleep(0.2)
            results = self.collect(workers, own)
            failures = [r for r in results.values() if r["outcome"] in ("failed", "crashed")]
            if failures and first_failure is None:
                first_failure = time.monotonic()
            if len(results) == self.size:
                return  # the main thread decides
            late = first_failure is not None and time.monotonic() > first_failure + GRACE_S
            if late or time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(results))
                stacks = self.stacks(missing)
                seconds = time.monotonic() - started
                if late:
                    result = self.verdict(test, results, seconds)
                    result.detail += f"\nranks {missing} still running:\n{stacks}"
                else:
                    result = TestResult(
                        self.cls,
                        test,
                        "hung",
                        f"ranks {missing} still running after {self.job['timeout']:.0f} s",
                        rank=missing[0] if missing else None,
                        seconds=round(seconds, 2),
                        detail=stacks,
                    )
                if self.decide(result):
                    sys.stderr.write(f"\n=== {test}: {result.outcome}\n{stacks}\n")
                    sys.stderr.flush()
                    os._exit(3)

    def stacks(self, ranks: list[int]) -> str:
        """The Python stacks of ``ranks`` (rank 0: this process's main thread, and its
        other threads that are in torch's code: the calls it serves)."""
        out: list[str] = []
        if 0 in ranks:
            main = threading.main_thread().ident or 0
            for ident, frame in sys._current_frames().items():
                lines = traceback.format_stack(frame)
                if ident == main:
                    out.insert(0, "rank 0 (main thread):\n" + "".join(lines))
                elif any("torch/" in line for line in lines):
                    out.append(f"rank 0 (thread {ident}):\n" + "".join(lines[-14:]))
        others = [f"worker{r}" for r in ranks if r]
        if others:
            try:
                import nbrpc

                for row in nbrpc.stacks(*others, timeout=10):
                    for thread in row["threads"]:
                        frames = thread["frames"]
                        # only threads in torch's code: ipyparallel's and nbrpc's own
                        # idle threads say nothing about the test
                        if not any("torch/" in f["file"] for f in frames):
                            continue
                        text = "\n".join(
                            f"  {f['file']}:{f['line']} {f['function']}" for f in frames[-14:]
                        )
                        out.append(f"{row['name']} thread {thread['name']}:\n{text}")
            except Exception as exc:
                out.append(f"no worker stacks: {exc!r}")
        return "\n".join(out)


# -- the driver: this process ---------------------------------------------------------------


@dataclass
class Selection:
    """The tests of one class to run, and those that do not apply (with why)."""

    cls: str
    world_size: int
    run: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def select(
    classes: Iterable[str] | None = None,
    pattern: str | None = None,
    tests: Iterable[str] | None = None,
) -> list[Selection]:
    """The tier's tests by class: ``classes`` (default all), names matching ``pattern``
    (a regex), or exactly ``tests`` (``Class.test_name``)."""
    available = test_classes()
    wanted = list(classes or default_classes())
    exact: dict[str, set[str]] | None = None
    if tests:
        exact = {}
        for item in tests:
            cls_name, _, name = item.partition(".")
            exact.setdefault(cls_name, set()).add(name)
        wanted = [c for c in CLASS_ORDER + CUDA_CLASS_ORDER if c in exact]
    for name in wanted:
        if name not in available:
            known = ", ".join(CLASS_ORDER + CUDA_CLASS_ORDER)
            raise SystemExit(f"unknown class {name!r}; known: {known}")
    chosen = []
    for cls_name in wanted:
        cls = available[cls_name]
        sel = Selection(cls_name, world_size(cls))
        for name in test_names(cls):
            if exact is not None and name not in exact[cls_name]:
                continue
            if pattern and not re.search(pattern, name):
                continue
            reason = not_applicable(cls, name)
            if reason:
                sel.skipped[name] = reason
            else:
                sel.run.append(name)
        if sel.run or sel.skipped:
            chosen.append(sel)
    return chosen


def _read_lines(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    lines = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return lines, offset + len(complete.encode())


def _crash_line(log_path: str) -> str:
    """The line of a kernel's log that most likely says why it died."""
    with contextlib.suppress(OSError), open(log_path, errors="replace") as f:
        tail = f.read()[-20000:].splitlines()
        for marker in ("Fatal Python error", "terminate called", "Segmentation", "Aborted"):
            for line in reversed(tail):
                if marker in line:
                    return line.strip()[:300]
    return ""


#: a kernel's files in the log folder: its job, its report of each test, its output
KERNEL_FILES = ("job.json", "report.jsonl", "log")
#: a test to run, as a kernel's job lists it: its class, the class's world size, its name
Entry = tuple[str, int, str]


def _kernels_tests(pending: list[Entry], per_kernel: int | None) -> list[Entry]:
    """The tests the next kernel runs: ``per_kernel`` of them (None: all), up to and with
    the first that leaves a thread stuck (:data:`LEAVES_A_THREAD_STUCK`)."""
    batch = pending[:per_kernel] if per_kernel else list(pending)
    for index, (_cls, _size, name) in enumerate(batch):
        if name in LEAVES_A_THREAD_STUCK:
            return batch[: index + 1]
    return batch


def _kernel_groups(selections: list[Selection]) -> list[list[Selection]]:
    """Consecutive classes whose kernels need the same environment (:data:`CLASS_ENV`)
    share kernels: a kernel's start (its torch, the zygote's preload, the controller) cost
    about 9 s, more than most classes' tests."""
    groups: list[list[Selection]] = []
    for sel in selections:
        env = CLASS_ENV.get(sel.cls, {})
        if groups and CLASS_ENV.get(groups[-1][0].cls, {}) == env:
            groups[-1].append(sel)
        else:
            groups.append([sel])
    return groups


def run_kernels(
    sels: list[Selection],
    timeout: float,
    log_dir: str,
    echo: Callable[[str], None],
    per_kernel: int | None = None,
) -> dict[tuple[str, str], TestResult]:
    """Run the tests of ``sels`` (classes of one environment) in kernel processes, a fresh
    one after each hang or crash, and after every ``per_kernel`` tests (None: as many as it
    runs); the results by class and test."""
    results: dict[tuple[str, str], TestResult] = {
        (sel.cls, name): TestResult(sel.cls, name, "n.a.", why)
        for sel in sels
        for name, why in sel.skipped.items()
    }
    pending: list[Entry] = [(sel.cls, sel.world_size, name) for sel in sels for name in sel.run]
    env = {**KERNEL_ENV, **CLASS_ENV.get(sels[0].cls, {})}
    attempt = 0
    while pending:
        attempt += 1
        batch = _kernels_tests(pending, per_kernel)
        stem = os.path.join(log_dir, f"{batch[0][0]}.{attempt}")
        job_path, report_path, log_path = (f"{stem}.{kind}" for kind in KERNEL_FILES)
        with open(job_path, "w") as f:
            json.dump({"tests": batch, "timeout": timeout}, f)
        open(report_path, "w").close()
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--kernel", job_path, report_path],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        offset, since, killed = 0, time.monotonic(), False
        current: tuple[str, str] | None = None
        while True:
            lines, offset = _read_lines(report_path, offset)
            for line in lines:
                if line["event"] == "start":
                    current, since = (line["class"], line["test"]), time.monotonic()
                else:
                    line.pop("event")
                    result = TestResult(**line)
                    results[result.cls, result.test] = result
                    current, since = None, time.monotonic()
                    echo(f"{result.cls}.{result.test}: {result.outcome} {result.error}".rstrip())
            if child.poll() is not None and not lines:
                break
            limit = timeout + BACKSTOP_S + (120 if current is None else 0)  # boot allowance
            if time.monotonic() - since > limit:
                killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                break
            time.sleep(0.2)
        if current is not None and current not in results:
            if killed:
                results[current] = TestResult(
                    *current, "hung", "the kernel stopped answering (killed)"
                )
            else:
                code = child.returncode
                why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                detail = _crash_line(log_path)
                results[current] = TestResult(
                    *current, "crashed", f"the kernel (rank 0) died: {why} {detail}".strip()
                )
            echo(f"{'.'.join(current)}: {results[current].outcome} {results[current].error}")
        progressed = [e for e in pending if (e[0], e[2]) in results]
        pending = [e for e in pending if (e[0], e[2]) not in results]
        if pending and not progressed:
            for cls_name, _size, name in pending:  # a kernel that cannot even start: say
                results[cls_name, name] = TestResult(  # so, once per test
                    cls_name, name, "crashed", f"the kernel did not start (see {log_path})"
                )
            pending = []
    return results


def run(
    selections: list[Selection],
    timeout: float = DEFAULT_TIMEOUT_S,
    log_dir: str | None = None,
    echo: Callable[[str], None] = print,
    per_kernel: int | None = None,
) -> list[TestResult]:
    """Run every selected test; the results in the report's order. ``per_kernel``: how
    many tests one kernel process runs (each on a fresh cluster) before a fresh kernel."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="torch-compat-logs-")
    os.makedirs(log_dir, exist_ok=True)
    results: list[TestResult] = []
    for group in _kernel_groups(selections):
        for sel in group:
            echo(f"== {sel.cls}: {len(sel.run)} to run, {len(sel.skipped)} not applicable")
        found = run_kernels(group, timeout, log_dir, echo, per_kernel)
        for sel in group:
            order = test_names(test_classes()[sel.cls])
            mine = [r for (cls_name, _), r in found.items() if cls_name == sel.cls]
            results += sorted(mine, key=lambda r: order.index(r.test))
    return results


def second_look(
    results: list[TestResult],
    timeout: float,
    log_dir: str,
    echo: Callable[[str], None] = print,
) -> list[TestResult]:
    """Run each test that failed in a kernel's later cluster again, alone in a fresh
    kernel, whose first cluster it then is: there torch ids are ranks, as in torch's fresh
    processes, so a test that compares the two (the id kind, docs/compatibility.md) is
    judged where its ids allow. A test that fails there too fails for a cause of its own,
    and keeps its outcome from this run. The results, in the same order."""
    again = [r for r in results if r.outcome == "failed" and not r.after_reinit]
    if not again:
        return results
    echo(f"== second look: {len(again)} failed tests, each in a fresh kernel's first cluster")
    chosen = select(tests=[f"{r.cls}.{r.test}" for r in again])
    redone: dict[tuple[str, str], TestResult] = {}
    for group in _kernel_groups(chosen):
        redone.update(run_kernels(group, timeout, log_dir, echo, per_kernel=1))
    out = []
    for r in results:
        new = redone.get((r.cls, r.test))  # only the tests of ``again`` ran again
        if new is not None:
            new.after_reinit = r.error or "failed"
            r = new
        out.append(r)
    return out


def counts(results: list[TestResult]) -> dict[str, int]:
    found = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    found["applicable"] = len(results) - found["n.a."]
    found["first cluster only"] = sum(
        r.outcome == "passed" and bool(r.after_reinit) for r in results
    )
    return found


def markdown(results: list[TestResult], selections: list[Selection], seconds: float) -> str:
    """The report: a table per class, then every failure, hang, crash and exclusion."""
    import torch

    sizes = {s.cls: s.world_size for s in selections}
    by_class = {s.cls: [r for r in results if r.cls == s.cls] for s in selections}
    lines = [
        "# torch RPC test suite on nbrpc: results",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {seconds / 60:.1f} min. "
        "Written by `python tools/compat.py` (see docs/compatibility.md).",
        "",
        "*passed*: in the cluster the run gave it; *of which first cluster only*: failed "
        "in a kernel's later cluster, then passed alone in a fresh kernel's first one "
        "(the id kind: docs/compatibility.md).",
        "",
        "| class | ranks | tests | applicable | passed | of which first cluster only "
        "| failed | hung | crashed | n.a. |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for cls_name, rows in by_class.items():
        c = counts(rows)
        lines.append(
            f"| {cls_name} | {sizes[cls_name]} | {len(rows)} | {c['applicable']} | "
            f"{c['passed']} | {c['first cluster only']} | {c['failed']} | {c['hung']} | "
            f"{c['crashed']} | {c['n.a.']} |"
        )
    c = counts(results)
    lines.append(
        f"| **all** | | {len(results)} | {c['applicable']} | {c['passed']} | "
        f"{c['first cluster only']} | {c['failed']} | {c['hung']} | {c['crashed']} | "
        f"{c['n.a.']} |"
    )
    for outcome, title in (("failed", "Failed"), ("hung", "Hung"), ("crashed", "Crashed")):
        rows = [r for r in results if r.outcome == outcome]
        if not rows:
            continue
        lines += ["", f"## {title} ({len(rows)})", ""]
        for r in rows:
            where = f" ({r.where})" if r.where else ""
            again = (
                " (failed alone in a fresh kernel's first cluster too)" if r.after_reinit else ""
            )
            lines.append(f"- `{r.cls}.{r.test}`: {_md(r.error)}{where}{again}")
    rows = [r for r in results if r.outcome == "passed" and r.after_reinit]
    if rows:
        lines += ["", f"## Passed in a kernel's first cluster only ({len(rows)})", ""]
        lines.append("What each said in a later cluster of its kernel:")
        lines.append("")
        for r in rows:
            lines.append(f"- `{r.cls}.{r.test}`: {_md(r.after_reinit)}")
    rows = [r for r in results if r.outcome == "n.a."]
    if rows:
        lines += ["", f"## Not applicable ({len(rows)})", ""]
        for r in rows:
            lines.append(f"- `{r.cls}.{r.test}`: {_md(r.error)}")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    text = " ".join(text.split())
    return text.replace("|", "\\|")[:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", help="comma-separated classes (default: all)")
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    parser.add_argument("--tests", help="comma-separated Class.test_name (exactly these)")
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--json", help="write every result as JSON here")
    parser.add_argument("--log-dir", help="kernels' logs (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument(
        "--tests-per-kernel",
        type=int,
        help="start a fresh kernel process after this many tests (1: every test in a "
        "process whose first cluster it is, as torch's fresh processes; default: no limit)",
    )
    parser.add_argument(
        "--no-second-look",
        action="store_true",
        help="do not run the tests that failed in a kernel's later cluster again, each "
        "alone in a fresh kernel's first cluster (default: they run again)",
    )
    parser.add_argument("--kernel", nargs=2, metavar=("JOB", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kernel:
        return _kernel_entry(*args.kernel)
    selections = select(
        args.classes.split(",") if args.classes else None,
        args.pattern,
        args.tests.split(",") if args.tests else None,
    )
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="torch-compat-logs-")
    print(f"kernels' logs: {log_dir}", flush=True)
    started = time.monotonic()
    results = run(
        selections, args.timeout, log_dir, lambda s: print(s, flush=True), args.tests_per_kernel
    )
    if args.tests_per_kernel != 1 and not args.no_second_look:
        results = second_look(results, args.timeout, log_dir, lambda s: print(s, flush=True))
    report = markdown(results, selections, time.monotonic() - started)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(report)
    return 0


def _kernel_entry(job_path: str, report_path: str) -> int:
    """The child process: load this file as MODULE_NAME (the name engines know it by) and
    run the job there."""
    if MODULE_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, os.path.abspath(__file__))
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module
        spec.loader.exec_module(module)
    with open(job_path) as f:
        job = json.load(f)
    sys.modules[MODULE_NAME].Kernel(job, report_path).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
