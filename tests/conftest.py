"""Shared fixtures: one real cluster for the session, notebook-style code, leak checks.

The test process plays the notebook kernel: it joins the RPC group as ``worker0`` and
real ipyparallel engines join as workers. Workers are expensive (each imports torch), so
one cluster serves the whole session; lifecycle tests that shut it down leave a fresh one
behind through :func:`ensure_cluster`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import linecache
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from kernel_ports import install as _kernel_ports_outside_the_ephemeral_range

import nbrpc

_kernel_ports_outside_the_ephemeral_range()  # every kernel this process starts (nbval's too)

_cells = itertools.count(1)


def notebook_code(source: str) -> SimpleNamespace:
    """Run ``source`` the way an IPython cell runs: in ``__main__``, source in linecache.

    Functions and classes defined this way are not importable on workers, exactly like
    notebook code, so they must travel by value.
    """
    filename = f"<notebook-cell-{next(_cells)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return SimpleNamespace(**{k: v for k, v in namespace.items() if not k.startswith("__")})


#: A float64 model stage and a gradient reader, as a notebook defines them; shared by the
#: autograd and trace tests.
STAGE_CELL = """
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

class Stage(torch.nn.Module):
    def __init__(self, seed, n_in, n_out):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(n_in, n_out).double()
    def forward(self, x):
        return torch.tanh(self.lin(x))
    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]
    def weights(self):
        return [p.detach().clone() for p in self.parameters()]

def grads_of(module_rref, context_id):
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module_rref.local_value().parameters()]
"""


def ensure_cluster() -> nbrpc.Cluster:
    """The running cluster, started (2 workers) when none is, or made again when one of
    its workers is not ready: a test that lost a worker does not take the next with it."""
    try:
        cluster = nbrpc.current()
    except nbrpc.NotInitializedError:
        return nbrpc.init(n=2, progress=False)
    if all(r.state == "ready" for r in cluster.records[1:]):
        return cluster
    nbrpc.shutdown(graceful=False)
    return nbrpc.init(n=2, progress=False)


def signature_strays(base: type, made: type, names) -> list[str]:
    """How class ``made`` strays from ``base`` for the methods ``names``: a different
    signature, or (for a protocol the subclass must write) the base's own method kept.
    Each a sentence naming both; ``names`` maps a name to whether ``made`` must write it."""
    strays = []
    for name, must_write in names.items():
        want = inspect.signature(getattr(base, name))
        got = inspect.signature(getattr(made, name))
        if got != want:
            strays.append(
                f"{made.__module__}.{made.__name__}.{name}{got} differs from "
                f"{base.__name__}'s {name}{want}: every one takes the same arguments"
            )
        if must_write and getattr(made, name) is getattr(base, name):
            strays.append(f"{made.__name__} does not write {name}, which every one must")
    return strays


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def steady(read, quiet: float = 0.5, timeout: float = 10.0):
    """``read()`` once two reads ``quiet`` seconds apart agree (the last one): an owner's
    RRef count, say, while an earlier test's dropped RRefs still go (a kernel lets go of
    a ``remote()``'s handle up to 0.4 s after its owner confirmed it)."""
    deadline = time.monotonic() + timeout
    last = read()
    while True:
        time.sleep(quiet)
        now = read()
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def run_script(path, source: str, timeout: float = 180) -> str:
    """Run ``source`` as a fresh Python process (a kernel of its own); return its stdout.

    For what must happen in a process whose RPC state is new: torch fixes a process's
    rendezvous, listen address and device maps at its first join.
    """
    path.write_text(source)
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def user_environment() -> dict[str, str]:
    """This environment as a user's kernel would have it: without pytest's
    ``PYTEST_CURRENT_TEST``, which makes ipykernel leave file descriptors 1 and 2 alone (it
    forwards them to the cell otherwise): under it, the suite once saw what users did not."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


#: A class the tests make remote objects of (an RRef's owner keeps its state).
COUNTER = """
class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n
"""

#: What the restart and scale tests type into their kernel: a counter, a process's pid, a
#: call to a peer (by name or WorkerInfo), and a layer to train on a worker.
MEMBER_CODE = (
    COUNTER
    + """
def whoami():
    return os.getpid()

def call_peer(to):
    return nbrpc.rpc_sync(to, whoami)

def double(t):
    return t * 2

def make_layer():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)

def forward(layer_rref, x):
    return layer_rref.local_value()(x)

def params(layer_rref):
    return [nbrpc.RRef(p) for p in layer_rref.local_value().parameters()]

def weights(layer_rref):
    return [p.detach().clone() for p in layer_rref.local_value().parameters()]
"""
)

#: One step of distributed autograd and the DistributedOptimizer through worker ``{w}``,
#: and the same step here: ``same`` says whether the weights agree.
TRAIN_ON = """
layer = nbrpc.remote('{w}', make_layer)
x = torch.ones(3, 4)
with dist_autograd.context() as ctx:
    loss = nbrpc.rpc_sync('{w}', forward, args=(layer, x)).sum()
    dist_autograd.backward(ctx, [loss])
    rrefs = nbrpc.rpc_sync('{w}', params, args=(layer,))
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    opt.step(ctx)
remote_w = nbrpc.rpc_sync('{w}', weights, args=(layer,))
ref = make_layer()
ref(x).sum().backward()
torch.optim.SGD(ref.parameters(), lr=0.1).step()
same = all(torch.allclose(a, b) for a, b in zip(remote_w, ref.parameters()))
"""


def first_error(errors: list[str]) -> str:
    """A cell's first error ("" when it raised none)."""
    return errors[0] if errors else ""


class Kernel:
    """A real Jupyter kernel, driven as a notebook would drive it.

    ``answers``: lines typed into the notebook's input box, one per input request (a
    callable instead is given the prompt and the kernel, and answers itself or not);
    ``prompts`` then lists the prompts asked, in order. Prompts come on the stdin channel
    and output on iopub: their relative order is not kept in the text returned.
    ``allow_stdin=False`` runs the cell as nbval and nbclient do, with no input box.
    """

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", env=user_environment())
        self.prompts: list[str] = []
        #: the last cell's errors as the notebook shows them (one list of lines each), and
        #: what it wrote to stderr (red in a notebook)
        self.tracebacks: list[list[str]] = []
        self.stderr = ""

    def execute(
        self, code: str, timeout: float = 120, answers=None, allow_stdin: bool = True
    ) -> tuple[str, list[str]]:
        """Execute ``code``: its stdout and display text, and its errors' texts."""
        out: list[str] = []
        errors: list[str] = []
        err: list[str] = []
        self.prompts = []
        self.tracebacks = []
        pending = list(answers or [])

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "error":
                self.tracebacks.append(content["traceback"])
            if kind == "stream" and content["name"] == "stderr":
                err.append(content["text"])
            if kind == "stream" and "UsageError" not in content["text"]:
                out.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error" or (kind == "stream" and "UsageError" in content["text"]):
                errors.append(
                    f"{content['ename']}: {content['evalue']}"
                    if kind == "error"
                    else content["text"]
                )

        def stdin_hook(msg):
            prompt = msg["content"]["prompt"]
            self.prompts.append(prompt)
            if not pending:
                raise AssertionError(f"unexpected input request {prompt!r}")
            answer = pending.pop(0)
            if callable(answer):
                answer = answer(prompt, self)
            if answer is not None:
                self.kc.input(answer)

        self.kc.execute_interactive(
            code,
            timeout=timeout,
            output_hook=hook,
            stdin_hook=stdin_hook,
            allow_stdin=allow_stdin,
        )
        self.stderr = "".join(err)
        return "".join(out), errors

    def shown_error(self) -> str:
        """The last cell's errors as the notebook shows them, as one text."""
        return "\n".join(line for tb in self.tracebacks for line in tb)

    def stop_after(self, code: str, seconds: float, timeout: float = 120) -> tuple[float, list]:
        """Run ``code`` and press the stop button ``seconds`` into it: how long the cell
        ran on after the press, and its errors."""
        import threading

        pressed: list[float] = []

        def press() -> None:
            pressed.append(time.monotonic())
            self.km.interrupt_kernel()

        timer = threading.Timer(seconds, press)
        timer.start()
        try:
            _, errors = self.execute(code, timeout)
        finally:
            timer.cancel()
        return (time.monotonic() - pressed[0] if pressed else 0.0), errors

    def late_output(self, seconds: float) -> str:
        """What the kernel shows in the next ``seconds`` while no cell runs, under any
        cell: a line that arrives after its cell ended shows under that cell in a
        notebook, and ``execute`` of the next cell would not see it."""
        import queue

        texts = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                break
            if msg["msg_type"] == "stream":
                texts.append(msg["content"]["text"])
        return "".join(texts)

    def run(self, code: str, timeout: float = 120, **kw) -> str:
        """Execute ``code``; its output. Raises with the error's text."""
        out, errors = self.execute(code, timeout, **kw)
        if errors:
            raise AssertionError(out + "\n".join(errors))
        return out

    def value(self, expr: str, timeout: float = 120):
        text = self.run(f"import json as _j; print('VALUE', _j.dumps({expr}))", timeout)
        return json.loads(text.split("VALUE ", 1)[1].splitlines()[0])

    def children(self) -> list[psutil.Process]:
        """Every process under this kernel (its clusters', warm spares included)."""
        return psutil.Process(self.km.provisioner.process.pid).children(recursive=True)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)  # as a notebook closes: its exit hooks run


RELEASE = "import nbrpc; nbrpc.shutdown(release=True)"


@contextlib.contextmanager
def running_kernel(*cells: str, closing: str = RELEASE):
    """A :class:`Kernel` that ran ``cells`` (a module's shared kernel), then ``closing``
    and its end when the block ends. A closing that releases (the default) is held to
    leave no process under the kernel: whatever the module's stop buttons and faults did
    to its clusters, nothing they started outlives a release (issue 66)."""
    k = Kernel()
    try:
        for cell in cells:
            k.run(cell, timeout=180)
        yield k
        k.run(closing, timeout=60)
        if "release" in closing:

            def left() -> list[psutil.Process]:
                return [p for p in k.children() if running(p.pid)]

            assert wait_until(lambda: not left(), timeout=10), (
                "left under the kernel after its release: " + "; ".join(described(left()))
            )
    finally:
        k.close()


def described(processes: list[psutil.Process]) -> list[str]:
    """Each process as a line: pid, parent, start, what it runs."""
    lines = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            started = time.strftime("%H:%M:%S", time.localtime(p.create_time()))
            lines.append(f"{p.pid} (of {p.ppid()}, {started}): {' '.join(p.cmdline()[1:3])}")
    return lines


def kernel_children() -> list[psutil.Process]:
    """Every process this test process started, except the hang watchdog and the fake hosts
    of tutorials 09 and 10 and their Slurm (not nbrpc's; removed at the end of the session)."""
    skip = {_watchdog_pid[0]}
    for hosts in _notebook_hosts:
        for root in hosts.root_pids():
            skip.add(root)
            with contextlib.suppress(psutil.Error):
                skip.update(c.pid for c in psutil.Process(root).children(recursive=True))
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in skip]


def wait_for_exit(pids: list[int], timeout: float = 20.0) -> list[int]:
    """PIDs from ``pids`` still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and running(p)]
        time.sleep(0.2)
    return alive


def running(pid: int) -> bool:
    """A process that exists and is not a zombie (exited, not yet reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_watchdog_pid: list[int | None] = [None]
_HANG_MARGIN_S = 60  # after pytest-timeout's own limit, which needs the GIL to fire


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm the hang watchdog (tools/hang_watchdog.py) for each test: a deadlock that holds
    the GIL then fails the run with native stacks instead of stalling it."""
    watchdog = _hang_watchdog(item.config)
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else item.config.getini("timeout")
    _hosts_for(item)
    watchdog.stdin.write(f"arm {float(limit or 300) + _HANG_MARGIN_S} {item.nodeid}\n")
    watchdog.stdin.flush()
    try:
        yield
    finally:
        watchdog.stdin.write("disarm\n")
        watchdog.stdin.flush()
        if nextitem is None or not _is_multi_host(nextitem):
            _notebook_hosts_down()  # after tutorial 10's kernel ended (its last cell's teardown)


def _hang_watchdog(config) -> subprocess.Popen:
    watchdog = getattr(config, "_nbrpc_hang_watchdog", None)
    if watchdog is None:
        tool = os.path.join(os.path.dirname(__file__), "..", "tools", "hang_watchdog.py")
        watchdog = subprocess.Popen(
            [sys.executable, tool, str(os.getpid())], stdin=subprocess.PIPE, text=True
        )
        config._nbrpc_hang_watchdog = watchdog
        _watchdog_pid[0] = watchdog.pid
    return watchdog


# -- tutorial 09 runs against fake hosts -------------------------------------------------------

MULTI_HOST_NOTEBOOK = "09_multi_host.ipynb"
SLURM_NOTEBOOK = "10_slurm.ipynb"
_notebook_hosts: list = []  # the fake hosts tutorials 09 and 10 run on, then their Slurm


def load_fakehosts():
    """tools/fakehosts.py as a module (tools/ is not a package), loaded once."""
    return load_tool("fakehosts")


def load_fakeslurm():
    """tools/fakeslurm.py as a module, loaded once."""
    load_fakehosts()  # it imports fakehosts by name
    return load_tool("fakeslurm")


def load_tool(name: str):
    """tools/NAME.py as a module named NAME (tools/ is not a package), loaded once."""
    import importlib.util

    if name not in sys.modules:
        path = os.path.join(os.path.dirname(__file__), "..", "tools", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _is_multi_host(item) -> bool:
    return os.path.basename(str(item.fspath)) in (MULTI_HOST_NOTEBOOK, SLURM_NOTEBOOK)


def _is_slurm(item) -> bool:
    return os.path.basename(str(item.fspath)) == SLURM_NOTEBOOK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a tutorial's kernel in the setup of its first cell: start it as a user's
    (see :func:`user_environment`)."""
    saved = os.environ.pop("PYTEST_CURRENT_TEST", None) if _is_notebook(item) else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["PYTEST_CURRENT_TEST"] = saved


def _is_notebook(item) -> bool:
    return str(item.fspath).endswith(".ipynb")


@pytest.hookimpl(tryfirst=True)  # before xdist's own reads the groups
def pytest_collection_modifyitems(config, items):
    """Without root there are no fake hosts: tutorials 09 and 10 are skipped, and say why
    (10 also without the Slurm packages). On pytest-xdist's workers the longest groups
    (:func:`_group_of`) go first."""
    why_hosts = load_fakehosts().missing()
    why_slurm = load_fakeslurm().missing()
    for item in items:
        why = why_slurm if _is_slurm(item) else why_hosts if _is_multi_host(item) else None
        if why:
            name = os.path.basename(str(item.fspath))
            item.add_marker(pytest.mark.skip(reason=f"{name}: {why}"))
    if hasattr(config, "workerinput"):  # an xdist worker: the order its controller deals in
        items.sort(key=lambda item: _rank_of(_group_of(item.nodeid)))  # stable: as written


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """xdist's workers (make test TEST_WORKERS=2) get whole groups (:func:`_group_of`), in
    the order the workers collected them (``--no-loadscope-reorder``: the longest first,
    not the most tests)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ByGroup(config, log)


#: the modules (and tutorials) that build fake hosts or a Slurm on them: network namespaces
#: and daemons with fixed names, one set at a time on this machine, so one xdist group
FAKE_HOSTS_GROUP = "fake-hosts"
_FAKE_HOSTS_MODULES = (
    "test_hosts.py",
    "test_who_may_connect.py",
    "test_slurm.py",
    MULTI_HOST_NOTEBOOK,
    SLURM_NOTEBOOK,
)
#: groups that start first on xdist's workers, the longest first (seconds measured
#: in a fresh clone's run, tests/README.md): a long group started last would end the run
#: alone on one worker
_LONG_FIRST = ("test_soak.py", FAKE_HOSTS_GROUP, "test_lifecycle.py")


def _group_of(nodeid: str) -> str:
    """The xdist group of a test (by its node id): its module's file name, or
    :data:`FAKE_HOSTS_GROUP`. A module stays on one worker, in its order, with its module
    fixtures (its kernel, its cluster) made once. (xdist's own ``xdist_group`` marks do not
    reach pytest 9.2's node ids, hence a scheduler of our own.)"""
    name = os.path.basename(nodeid.split("::", 1)[0])
    return FAKE_HOSTS_GROUP if name in _FAKE_HOSTS_MODULES else name


def _rank_of(group: str) -> int:
    return _LONG_FIRST.index(group) if group in _LONG_FIRST else len(_LONG_FIRST)


def _hosts_for(item) -> None:
    """Before tutorial 09's (or 10's) first cell starts its kernel: fake hosts, named in
    the environment the kernel inherits (``NBRPC_HOSTS``, ``NBRPC_SSH_ARGS``); for 10, a
    Slurm on them too (``SLURM_CONF``)."""
    if not _is_multi_host(item) or item.get_closest_marker("skip"):
        return
    if not _notebook_hosts:
        hosts = load_fakehosts().FakeHosts(2).up()
        _notebook_hosts.append(hosts)
        os.environ["NBRPC_HOSTS"] = "fakeh1,fakeh1,fakeh2"
        os.environ["NBRPC_SSH_ARGS"] = f"-F {hosts.ssh_config}"
    if _is_slurm(item) and len(_notebook_hosts) == 1:
        slurm = load_fakeslurm().FakeSlurm(_notebook_hosts[0]).up()
        _notebook_hosts.append(slurm)
        os.environ["SLURM_CONF"] = slurm.conf


def _notebook_hosts_down() -> None:
    """The fake hosts (and Slurm) of tutorials 09 and 10 go once the last of them ran: on
    xdist's workers more tests follow them, and a host's sshd, a child of this process
    listening in its namespace, would count as this process's listener or leftover."""
    while _notebook_hosts:
        _notebook_hosts.pop().down()


def pytest_sessionfinish(session):
    _notebook_hosts_down()


#: the plugin's name: ``-p no:nbrpc-notebook-outputs`` leaves build/executed-notebooks alone
NOTEBOOK_OUTPUTS = "nbrpc-notebook-outputs"
#: the check that a session leaves nothing behind (tests/leftovers.py; --leftovers=warn)
LEFTOVERS = "nbrpc-leftovers"
#: the seconds of each xdist group, at the session's end (tests/group_times.py)
GROUP_TIMES = "nbrpc-group-times"


def pytest_addoption(parser):
    from leftovers import add_option

    add_option(parser)


def pytest_configure(config):
    """Keep each tutorial as nbval ran it, outputs included, for the documentation site
    (tests/notebook_outputs.py writes build/executed-notebooks; tools/docs_site.py renders
    them)."""
    from notebook_outputs import NotebookOutputs

    out = config.rootpath / "build" / "executed-notebooks"
    if not config.pluginmanager.has_plugin(NOTEBOOK_OUTPUTS):  # once, loaded as -p conftest too
        config.pluginmanager.register(NotebookOutputs(out), NOTEBOOK_OUTPUTS)
    from leftovers import Leftovers

    if not config.pluginmanager.has_plugin(LEFTOVERS):
        config.pluginmanager.register(Leftovers(), LEFTOVERS)
    from group_times import GroupTimes

    if not config.pluginmanager.has_plugin(GROUP_TIMES) and not hasattr(config, "workerinput"):
        out = config.rootpath / "build" / "test-seconds.jsonl"
        config.pluginmanager.register(GroupTimes(_group_of, out), GROUP_TIMES)


def pytest_unconfigure(config):
    watchdog = getattr(config, "_nbrpc_hang_watchdog", None)
    if watchdog is not None:
        watchdog.stdin.close()  # it exits when the pipe closes
        watchdog.wait(timeout=10)


@pytest.fixture(scope="session")
def _cluster_session():
    yield
    nbrpc.shutdown(release=True)  # the controller and warm spares too
    children = [p.pid for p in kernel_children()]
    alive = wait_for_exit(children)
    described = []
    for pid in alive:  # only processes this test session started
        with contextlib.suppress(psutil.Error):
            described.append(f"{pid} {' '.join(psutil.Process(pid).cmdline()[:4])}")
            psutil.Process(pid).kill()
    assert not alive, f"processes left behind after the test session: {described}"


@pytest.fixture
def cluster(_cluster_session) -> nbrpc.Cluster:
    return ensure_cluster()


@pytest.fixture
def nb():
    return notebook_code


@pytest.fixture
def no_cluster():
    """No cluster in this process while the test runs: the shared one an earlier module
    started on this test worker is shut down (its next user starts it again:
    :func:`ensure_cluster`). For a unit test of what a lane carries (a cluster's fast path
    would carry a large tensor), and of the lifecycle's and the workers' global state (on
    three test workers one ran after a shared cluster and wiped its roster)."""
    with contextlib.suppress(nbrpc.NotInitializedError):
        nbrpc.current()
        nbrpc.shutdown()


def pytest_report_header(config):
    return f"nbrpc {nbrpc.__version__}, pid {os.getpid()}"
