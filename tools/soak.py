"""The soak: one real Jupyter kernel, a seeded random mix of what a person does, for minutes.

    python tools/soak.py --minutes 20 [--seed S] [--out build/soak]     (make soak MINUTES=20)

The kernel is started as tests/conftest.py's ``Kernel`` starts one (jupyter_client, a
user's environment); cells are typed as a person types them (``%load_ext nbrpc``,
``%rpc_init -n 2``, ...) and the stop button is the kernel manager's interrupt. The mix
is in tools/soak_mix.py: calls of every size, fan-outs, RRefs among workers, distributed
autograd with optimizer steps against a local twin, ``%%rpc`` cells, views, recordings,
stacks, output floods, the stop button at random moments of calls and of ``%rpc_init``,
``%rpc_restart``, ``%rpc_scale`` and ``%rpc_shutdown``, bad input to every magic, workers
killed with SIGKILL, and shutdowns and inits at sizes 1..3 with and without shared memory.

Every cell has a time limit: a cell that outlives it is a hang, and a kernel that dies is
the end; both name the operation, the seed and the step. Each minute, and after each
shutdown, the figures are sampled (figures.jsonl, and soak.png at the end): the kernel's
RSS, open files, threads by name, processes under the kernel, its /dev/shm and $TMPDIR
entries, ipyparallel's files, live RRefs and autograd contexts per process. The bounds of
docs/soak.md are checked at the end. The exit status is 0 only when no check failed, no
finding was recorded and no bound was broken; report.json says what and where.

The kernel gets a private $TMPDIR and IPYTHONDIR (removed at the end), so its files are
counted apart from any other kernel's on the machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import soak_mix as mix

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import Kernel  # noqa: E402  (tests/ is not a package)

MB = 1024 * 1024

#: seconds each kind of cell may take before it counts as a hang (a loaded 2-core machine)
LIMITS = {
    "call": 120,
    "flood": 120,
    "view": 60,
    "check": 60,
    "bad": 30,
    "init": 180,
    "restart": 120,
    "scale": 180,
    "scale_dead": 150,
    "shutdown": 90,
    "figures": 60,
    "setup": 180,
}
#: a stopped cell must end this soon after the press
STOP_ENDS_WITHIN_S = 10.0
#: lines of a stopped flood a later cell may show: the one message in flight at the stop
#: (nbrpc._wire.output.MESSAGE_CHARS, 16,384 characters: about 1,500 of its lines)
FLOOD_AFTER_STOP = 2000
#: what each worker that joined may leave in the kernel after it left: torch's TensorPipe
#: agent keeps its pipe, 4 sockets (docs/architecture.md; tests/test_reliability.py's
#: SOCKETS_PER_DEPARTED_WORKER)
SOCKETS_PER_WORKER = 4
#: the bounds of docs/soak.md
RSS_GROWTH_MB = 50.0
#: the kernel's descriptors are listed twice this far apart, and those in both counted:
#: one listing's count and its kinds, read a moment apart, differed by one (a socket
#: closing), and a file open for a moment (IPython's history being written) is not held
FD_SECOND_LOOK_S = 0.3
#: how long a level after a shutdown may take to settle (processes exit, files go)
SETTLE_S = 20.0
#: what runs under the kernel while a local cluster is up, or after a shutdown that kept
#: the controller and spares: the watchdog, the zygote, the controller and its child
NON_ENGINES = {"watchdog": 1, "zygote": 1, "controller": 2}
#: the live views' threads: at most one each (%rpc_status's view, the panel, its card)
VIEW_THREADS = ("nbrpc-ClusterView", "nbrpc-ClusterPanel")
#: the sizes the mix gives a cluster
CLUSTER_SIZES = (1, 2, 3)
#: ipywidgets' widgets the kernel may hold after a shutdown: what stays live by design (the
#: newest 32 finished bars, 11 each: 352; the newest boot's progress, 38 for three
#: workers; the newest %rpc_status view, 2; a panel, its side bar and its card, 8), and
#: room for the soak's own. Each boot's, view's and bar's were held for good (docs/soak.md).
WIDGETS_MAX = 450
#: warm spare engines kept after a shutdown at most (warmed to the largest cluster)
SPARES_MAX = max(CLUSTER_SIZES)


class Fatal(Exception):
    """The soak cannot go on: the kernel died, or stays stuck after the stop button."""


@dataclass
class Cell:
    """One executed cell, as the notebook showed it."""

    code: str
    out: str = ""
    errors: list[str] = field(default_factory=list)
    shown: str = ""  # the errors' tracebacks as shown
    seconds: float = 0.0
    pressed: bool = False  # the stop button was pressed while it ran
    ran_on: float = 0.0  # seconds it ran after the press
    hung: bool = False
    said: list[str] = field(default_factory=list)  # nbrpc's own lines on stderr

    def describe(self) -> str:
        how = f"ended {self.ran_on:.2f} s after the press" if self.pressed else "not stopped"
        err = f", {self.errors[0].splitlines()[0][:120]}" if self.errors else ""
        said = f"; said {self.said[:4]}" if self.said else ""
        return f"{how} ({self.seconds:.1f} s{err}){said}"


#: --trace-memory: tracemalloc from the kernel's first cells; a snapshot after the
#: warm-up; at the end, what was allocated since and is still held, by traceback
TRACE_START = "import tracemalloc\ntracemalloc.start(12)"
TRACE_FROM = """
soak_memory_from = tracemalloc.take_snapshot()

def soak_memory_kept(top=25):
    now = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)])
    diff = now.compare_to(soak_memory_from, "traceback")
    lines = [f"traced now {sum(s.size for s in now.statistics('filename')) / 2**20:.1f} MB, "
             f"grown {sum(d.size_diff for d in diff) / 2**20:+.1f} MB since the snapshot"]
    for d in diff[:top]:
        lines.append(f"{d.size_diff / 1024:+9.1f} KB {d.count_diff:+7d} blocks")
        lines += ["    " + line for line in d.traceback.format()[-12:]]
    return "\\n".join(lines)
"""


class Soak:
    """The driver: the kernel, the model of its cluster, the records and the figures."""

    def __init__(
        self, seed: int, minutes: float, warmup: float, out: Path, trace_memory: bool = False
    ) -> None:
        self.seed, self.minutes, self.warmup, self.out = seed, minutes, warmup, out
        #: tracemalloc in the kernel: what Python allocated after the warm-up and kept,
        #: by where, to build/soak/memory.txt (it slows the kernel's allocations)
        self.trace_memory = trace_memory
        self.limits = dict(LIMITS)
        self.stop_chance = 0.35
        self.model: dict[str, Any] = {"running": False, "workers": []}
        self.step = 0
        self.op = "setup"
        self.records: list[dict[str, Any]] = []  # failures and findings
        self.notes: dict[str, list[Any]] = collections.defaultdict(list)
        self.durations: dict[str, list[float]] = collections.defaultdict(list)
        self.samples: list[dict[str, Any]] = []
        self.ops_run: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "soak.log", "w")  # noqa: SIM115  (open for the whole run)
        self.figures = open(out / "figures.jsonl", "w")  # noqa: SIM115
        self.private = Path(tempfile.mkdtemp(prefix="soak-"))
        self.tmpdir = self.private / "tmp"
        self.ipython = self.private / "ipython"
        self.tmpdir.mkdir()
        self.kernel: Kernel | None = None
        self.kernel_pid = 0
        self.segment = 0  # the kernel's number (a new one after a kernel that cannot go on)
        self.segment_started = self.started
        self.seen_pids: set[int] = set()
        #: tags of floods the stop button ended: their lines must not show in later cells
        self.stopped_floods: list[str] = []
        #: workers a magic may have started so far (an upper bound: a stopped one counts)
        self.joined = 0

    # -- records ----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        line = f"{self.elapsed():7.1f}s step {self.step:4d} {self.op}: {text}"
        self.log.write(line + "\n")
        self.log.flush()

    def _record(self, kind: str, what: str) -> None:
        entry = {"kind": kind, "seed": self.seed, "step": self.step, "op": self.op,
                 "t": round(self.elapsed(), 1), "what": what}  # fmt: skip
        self.records.append(entry)
        self.say(f"{kind.upper()}: {what}")
        print(f"soak {kind}: seed {self.seed} step {self.step} ({self.op}): {what}", flush=True)

    def failure(self, what: str) -> None:
        """A check failed: a wrong result, a hang, an unclear error."""
        self._record("failure", what)

    def finding(self, what: str) -> None:
        """A behaviour issue 66 rules out: the next magic after a stop or a kill did not
        work from the state left, processes left behind."""
        self._record("finding", what)

    def note(self, key: str, value: Any) -> None:
        self.notes[key].append(value)

    def typical(self, kind: str) -> float:
        """How long a magic of ``kind`` took lately (a first guess before any ran)."""
        took = self.durations.get(kind)
        guess = {"init": 3.0, "restart": 3.0, "scale": 3.0, "shutdown": 1.5}
        return sorted(took[-5:])[len(took[-5:]) // 2] if took else guess.get(kind, 2.0)

    # -- the kernel -------------------------------------------------------------------------

    def start_kernel(self) -> None:
        os.environ["TMPDIR"] = str(self.tmpdir)  # the kernel's, through user_environment()
        os.environ["IPYTHONDIR"] = str(self.ipython)
        os.environ.pop("PYTEST_CURRENT_TEST", None)
        self.kernel = Kernel()
        self.kernel_pid = self.kernel.km.provisioner.process.pid
        self.say(f"kernel pid {self.kernel_pid}, seed {self.seed}, private dir {self.private}")

    def alive(self) -> bool:
        assert self.kernel is not None
        return bool(self.kernel.km.is_alive())

    def cell(self, code: str, limit: float, stop_at: float | None = None) -> Cell:
        """Run ``code``, pressing the stop button ``stop_at`` seconds into it. A cell that
        outlives ``limit`` is a hang: the stop button is pressed, and a kernel that then
        does not answer within a minute ends the soak (:class:`Fatal`)."""
        assert self.kernel is not None
        k = self.kernel
        result = Cell(code)
        pressed: list[float] = []
        timer = None
        if stop_at is not None:

            def press() -> None:
                pressed.append(time.monotonic())
                k.km.interrupt_kernel()

            timer = threading.Timer(stop_at, press)
            timer.start()
        # a cell still running at half its limit: the kernel's stacks go to the log then,
        # while it is still stuck (at the limit it may just have ended)
        slow = threading.Timer(limit / 2, self.stacks_of_kernel, args=(f"slow: {code[:80]!r}",))
        slow.daemon = True
        slow.start()
        t0 = time.monotonic()
        try:
            result.out, result.errors = k.execute(code, timeout=limit)
        except TimeoutError:
            result.hung = True
        finally:
            slow.cancel()
            if timer is not None:
                timer.cancel()
        end = time.monotonic()
        result.seconds = end - t0
        result.shown = k.shown_error()
        result.said = [line[:160] for line in k.stderr.splitlines() if line.startswith("nbrpc:")]
        if pressed:
            result.pressed, result.ran_on = True, end - pressed[0]
        if not self.alive():
            raise Fatal(f"the kernel died during {self.op} (cell {code[:80]!r})")
        for tag in [t for t in self.stopped_floods if t in result.out and t not in code]:
            lines = result.out.count(tag)
            self.note("flood_lines_after_stop", [tag, lines])
            if lines > FLOOD_AFTER_STOP:  # more than the message in flight at the stop
                self.stopped_floods.remove(tag)
                self.finding(
                    f"the flood the stop button ended (step {tag[7:-1]}) went on: "
                    f"{lines} of its lines in a later cell ({code[:60]!r})"
                )
        if result.errors:
            # ipykernel aborts the requests that reach it in the moment after a cell's error
            # (stop_on_error), and then sends no idle status for them: a person is never
            # that fast, and the soak waits as long as one would
            time.sleep(0.3)
        if result.seconds > 20 and not result.hung:
            self.say(f"slow cell: {result.seconds:.1f} s for {code[:80]!r}")
        if result.hung:
            self.failure(f"hang: no answer in {limit:.0f} s to {code[:200]!r}")
            self.stacks_of_kernel("hang")
            k.km.interrupt_kernel()
            try:
                k.execute("1", timeout=60)
            except TimeoutError as exc:
                raise Fatal(f"the kernel stays stuck after {self.op}: {code[:80]!r}") from exc
            if not self.alive():
                raise Fatal(f"the kernel died after a hang in {self.op}")
        return result

    def stacks_of_kernel(self, why: str) -> None:
        """A hang: the kernel's stacks (py-spy, Python and native) into the log."""
        self.say(f"the kernel's stacks ({why}):")
        py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(py_spy):
            return
        with contextlib.suppress(Exception):
            done = subprocess.run(
                [py_spy, "dump", "--native", "--pid", str(self.kernel_pid)],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            self.log.write(done.stdout + done.stderr)

    def ok(self, code: str, limit: float, what: str, finding: bool = False) -> bool:
        """Run ``code``, which prints SOAK-OK once its checks passed; anything else is a
        failure (a finding, with ``finding``). Whether it passed."""
        cell = self.cell(code, limit)
        if cell.errors or "SOAK-OK" not in cell.out:
            why = cell.errors[0][:400] if cell.errors else "no answer" if cell.hung else "no OK"
            (self.finding if finding else self.failure)(f"{what}: {why}")
            return False
        return True

    def value(self, expr: str, limit: float) -> Any:
        """The JSON value of ``expr`` in the kernel (None, and a failure, when it fails)."""
        cell = self.cell(f"print('SOAK-VALUE', json.dumps({expr}, default=str))", limit)
        found = re.search(r"SOAK-VALUE (.*)", cell.out)
        if cell.errors or not found:
            self.failure(f"{expr}: {cell.errors[:1] or cell.out[-200:]}")
            return None
        return json.loads(found.group(1))

    def probe(self) -> dict[str, Any] | None:
        """The cluster as the kernel has it; the model follows it."""
        state = self.value("soak_probe()", self.limits["check"])
        if state is not None:
            ready = [n for n, s in state["workers"].items() if s == "ready"]
            self.model = {"running": state["running"], "workers": ready if state["running"] else []}
        return state

    def sync(self) -> None:
        self.probe()

    def magic(self, line: str, kind: str, why: str, finding: bool = False) -> bool:
        """Run lifecycle magic ``line`` to its end; an error is a failure (a finding with
        ``finding``). Whether it worked."""
        self.joined += mix.started_by(line, len(self.model["workers"]))
        cell = self.cell(line, self.limits[kind])
        if not cell.hung:
            self.durations[kind].append(cell.seconds)
        self.sync()
        if cell.errors or cell.hung:
            why_not = cell.errors[0][:400] if cell.errors else "a hang"
            (self.finding if finding else self.failure)(f"{why}: {line!r} failed: {why_not}")
            return False
        self.say(f"{line!r} in {cell.seconds:.1f} s")
        return True

    def fresh(self, why: str) -> None:
        """Start afresh after something that failed: ``%rpc_shutdown --release`` and a new
        cluster of 2; when even that fails the soak cannot go on."""
        self.say(f"starting afresh after {why}")
        for line, kind in (("%rpc_shutdown --release", "shutdown"), ("%rpc_init -n 2", "init")):
            self.joined += mix.started_by(line, 0)
            cell = self.cell(line, self.limits[kind])
            if cell.errors or cell.hung:
                raise Fatal(f"starting afresh after {why}: {line!r}: {cell.errors[:1]}")
        self.sync()
        if not self.model["running"]:
            raise Fatal(f"starting afresh after {why}: no cluster after %rpc_init")

    def check_stop(self, cell: Cell, what: str) -> None:
        """The stop button during ``what``: the cell ends at once, as a KeyboardInterrupt
        (or nbrpc's own error that says so), and shows short."""
        if cell.ran_on > STOP_ENDS_WITHIN_S:
            self.failure(f"the stop button during {what}: the cell ran on {cell.ran_on:.1f} s")
        error = cell.errors[0].split(":", 1)[0] if cell.errors else None
        self.note("stop_shown", [what, error, len(cell.shown.splitlines())])

    def forget(self) -> None:
        """Drop what the operation's cells kept (soak_mix.FORGET)."""
        cell = self.cell(mix.FORGET, self.limits["check"])
        if cell.errors:
            self.failure(f"dropping the operation's names: {cell.errors[0][:200]}")

    def kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    # -- processes and files ----------------------------------------------------------------

    def processes(self) -> dict[str, list[int]]:
        """What runs under the kernel, by role."""
        roles: dict[str, list[int]] = collections.defaultdict(list)
        try:
            kernel = psutil.Process(self.kernel_pid)
            children = kernel.children(recursive=True)
        except psutil.Error:
            return roles
        for p in children:
            try:
                cmd = " ".join(p.cmdline())
                if p.status() == psutil.STATUS_ZOMBIE:
                    roles["zombie"].append(p.pid)
                    continue
            except psutil.Error:
                continue
            self.seen_pids.add(p.pid)
            if "watchdog.py" in cmd:
                roles["watchdog"].append(p.pid)
            elif "nbrpc._engines.zygote" in cmd:
                roles["zygote" if p.ppid() == self.kernel_pid else "engine"].append(p.pid)
            elif "controller_process.py" in cmd:
                roles["controller"].append(p.pid)
            else:
                roles["other"].append(p.pid)
        return roles

    def check_processes(self, why: str) -> None:
        """While a local cluster runs: the watchdog, the zygote, the controller (two
        processes), the workers' engines and at most a few spares, nothing more (a stopped
        init once left a second set)."""
        workers = len(self.model["workers"])
        want = f"{NON_ENGINES}, {workers}..{workers + SPARES_MAX} engines"
        deadline = time.monotonic() + SETTLE_S
        while True:
            roles = self.processes()
            counts = {role: len(pids) for role, pids in roles.items()}
            engines = counts.get("engine", 0)
            extra = {r: n for r, n in counts.items() if r not in NON_ENGINES and r != "engine"}
            good = all(counts.get(r, 0) == n for r, n in NON_ENGINES.items())
            good = good and workers <= engines <= workers + SPARES_MAX and not extra
            if good or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not good:
            self.finding(f"after {why}: processes under the kernel {counts}, wanted {want}")

    def outside(self) -> dict[str, Any]:
        """The figures read from outside the kernel."""
        fig: dict[str, Any] = {}
        try:
            kernel = psutil.Process(self.kernel_pid)
            fig["rss_mb"] = round(kernel.memory_info().rss / MB, 1)
            fig["threads"] = kernel.num_threads()
            with open(f"/proc/{self.kernel_pid}/status") as status:
                for line in status:  # RssAnon, RssFile, RssShmem (kB)
                    if line.startswith("Rss") and ":" in line:
                        key, value = line.split(":", 1)
                        fig[key.lower() + "_mb"] = round(int(value.split()[0]) / 1024, 1)
        except (psutil.Error, OSError):
            return fig
        names: collections.Counter[str] = collections.Counter()
        for task in Path(f"/proc/{self.kernel_pid}/task").iterdir():
            with contextlib.suppress(OSError):
                names[re.sub(r"[0-9]+", "N", (task / "comm").read_text().strip())] += 1
        fig["native_threads"] = dict(names)
        held = _descriptors(self.kernel_pid)
        time.sleep(FD_SECOND_LOOK_S)
        held &= _descriptors(self.kernel_pid)  # what both looks saw: held, not passing
        kinds = collections.Counter(_fd_kind(target) for _, target in held)
        fig["fds"] = len(held)
        fig["fd_kinds"] = dict(sorted(kinds.items()))
        fig["fd_files"] = sorted(t for _, t in held if _fd_kind(t) == "file")
        fig["sockets"] = kinds.get("socket", 0)
        fig["arenas_held"] = kinds.get("arena (deleted)", 0)
        fig["fds_other"] = fig["fds"] - fig["sockets"] - fig["arenas_held"]
        fig["joined"] = self.joined
        roles = self.processes()
        fig["processes"] = sum(len(p) for p in roles.values())
        fig["process_roles"] = {r: len(p) for r, p in roles.items()}
        prefix = f"nbrpc-{self.kernel_pid}-"
        fig["shm"] = sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))
        fig["tmp"] = sorted(os.listdir(self.tmpdir))
        fig["tmp_nbrpc"] = len([f for f in fig["tmp"] if f.startswith("nbrpc-")])
        profile = self.ipython / "profile_default"
        logs = sorted(p.name for p in (profile / "log").glob("*")) if profile.exists() else []
        security = profile / "security"
        secrets = sorted(p.name for p in security.glob("*")) if security.exists() else []
        fig["ipp_log"], fig["ipp_security"] = len(logs), len(secrets)
        fig["ipp_files"] = logs + secrets
        return fig

    def sample(self, kind: str) -> dict[str, Any]:
        """One line of figures.jsonl: outside figures and the kernel's own."""
        untrimmed = None
        with contextlib.suppress(psutil.Error):
            untrimmed = round(psutil.Process(self.kernel_pid).memory_info().rss / MB, 1)
        inside = self.value("soak_figures()", self.limits["figures"]) or {}
        fig = {"t": round(self.elapsed(), 1), "kind": kind, "step": self.step,
               "kernel": self.segment,
               "kernel_t": round(time.monotonic() - self.segment_started, 1),
               "rss_untrimmed_mb": untrimmed, **self.outside(), **inside}  # fmt: skip
        views = fig.get("py_threads") or {}
        fig["view_threads"] = sum(views.get(n, 0) for n in VIEW_THREADS)
        fig["threads_other"] = fig.get("threads", 0) - fig["view_threads"]
        fig["shm_n"], fig["tmp_n"] = len(fig.get("shm", [])), len(fig.get("tmp", []))
        self.samples.append(fig)
        self.figures.write(json.dumps(fig, sort_keys=True) + "\n")
        self.figures.flush()
        self.say(
            f"figures ({kind}): rss {fig.get('rss_mb')} MB, fds {fig.get('fds')}, threads "
            f"{fig.get('threads')}, processes {fig.get('process_roles')}, shm {fig['shm_n']}, "
            f"tmp {fig['tmp_n']}, rrefs {fig.get('rrefs')}, contexts {fig.get('contexts')}, "
            f"widgets {fig.get('widgets')}"
        )
        return fig

    def level(self, kind: str) -> None:
        """After a shutdown (``kind``: "shutdown" keeps the controller and spares,
        "release" does not): wait for processes and shared memory to settle, then sample."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            roles = self.processes()
            engines = len(roles.get("engine", []))
            rest = sum(len(p) for r, p in roles.items() if r != "engine")
            settled = (
                rest == 0
                if kind == "release"
                else engines <= SPARES_MAX and rest == sum(NON_ENGINES.values())
            )
            shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"nbrpc-{self.kernel_pid}-")]
            if settled and not shm:
                break
            time.sleep(0.5)
        self.sample(kind)

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> int:
        """The mix until the minutes are up. A kernel that dies, or that cannot start a
        cluster any more, is a failure; the soak then goes on in a new kernel (a new
        segment: its figures are bounded on their own) while a minute or more is left."""
        ended_by: list[str] = []
        end = self.started + self.minutes * 60
        try:
            while True:
                try:
                    self.start_segment()
                    self.mix(end)
                    break
                except Fatal as exc:
                    ended_by.append(f"kernel {self.segment}: {exc}")
                    self.failure(str(exc))
                    self.end_kernel()
                    if time.monotonic() > end - 60:
                        break
        except KeyboardInterrupt:
            ended_by.append("interrupted (Ctrl-C)")
            self.failure(ended_by[-1])
        finally:
            self.end_kernel()
            self.log.close()
            self.figures.close()
            shutil.rmtree(self.private, ignore_errors=True)
        return self.report("; ".join(ended_by))

    def start_segment(self) -> None:
        """A new kernel: its first cells, its first figures."""
        self.segment += 1
        self.segment_started = time.monotonic()
        self.model = {"running": False, "workers": []}
        self.stopped_floods.clear()
        self.start_kernel()
        self.op = "setup"
        for code in (mix.LOAD, mix.NOTEBOOK):
            if not self.ok(code + "\nprint('SOAK-OK')", self.limits["setup"], "setup"):
                raise Fatal("the notebook's first cells failed")
        if self.trace_memory:
            self.ok(TRACE_START + "\nprint('SOAK-OK')", self.limits["setup"], "tracemalloc")
        self.sample("start")

    def mix(self, end: float) -> None:
        next_sample = time.monotonic() + 60
        traced_from = self.segment_started + self.warmup * 60 if self.trace_memory else None
        while time.monotonic() < end:
            if time.monotonic() >= next_sample:
                self.op = "figures"
                self.sample("minute")
                next_sample += 60
            if traced_from is not None and time.monotonic() >= traced_from:
                ok = TRACE_FROM + "\nprint('SOAK-OK')"
                self.ok(ok, self.limits["figures"], "tracemalloc's snapshot")
                traced_from = None
            self.step += 1
            rng = random.Random(f"{self.seed}:{self.step}")
            op = mix.draw(rng, self.model["running"])
            self.op = op.__name__.removeprefix("op_")
            self.ops_run[self.op] += 1
            t0 = time.monotonic()
            op(self, rng)
            self.say(f"done in {time.monotonic() - t0:.1f} s")
            self.forget()
        self.op = "end"
        self.sample("end")
        if self.trace_memory and traced_from is None:
            kept = self.value("soak_memory_kept()", 10 * self.limits["figures"])
            (self.out / "memory.txt").write_text(f"segment {self.segment}\n{kept}\n")

    def end_kernel(self) -> None:
        """``%rpc_shutdown --release`` (a level), then the kernel's end; nothing of it
        may stay (a process left is killed and recorded)."""
        if self.kernel is None:
            return
        self.op = "teardown"
        with contextlib.suppress(Fatal):
            if self.alive():
                cell = self.cell("%rpc_shutdown --release", self.limits["shutdown"])
                if cell.errors or cell.hung:
                    self.failure(f"the last %rpc_shutdown --release: {cell.errors[:1]}")
                else:
                    self.level("release")
        self.processes()  # remember what runs, to check it ends with the kernel
        with contextlib.suppress(Exception):
            self.kernel.close()
        self.kernel = None
        left = [p for p in self.seen_pids if _running(p)]
        deadline = time.monotonic() + 20
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [p for p in left if _running(p)]
        for pid in left:
            self.kill(pid, signal.SIGKILL)
        if left:
            self.finding(f"processes left after the kernel ended: {left}")
        self.seen_pids.clear()

    # -- the bounds -------------------------------------------------------------------------

    def bounds(self) -> list[str]:
        """What grew past docs/soak.md's bounds, each a sentence (each kernel's figures
        on their own, from its warm-up on)."""
        broken = []
        for segment in sorted({s["kernel"] for s in self.samples}):
            ours = [s for s in self.samples if s["kernel"] == segment]
            broken += [
                f"kernel {segment}: {what}" if segment > 1 else what
                for what in self._bounds_of(ours)
            ]
        return broken

    def _bounds_of(self, samples: list[dict[str, Any]]) -> list[str]:
        broken = []
        after = [s for s in samples if s["kernel_t"] >= self.warmup * 60 and "rss_mb" in s]
        minutes = [s for s in after if s["kind"] in ("minute", "end")]
        if len(minutes) >= 2:
            first, last = _own_rss(minutes[0]), _own_rss(minutes[-1])
            if last - first > RSS_GROWTH_MB:
                broken.append(
                    f"kernel RSS grew {last - first:.0f} MB after the warm-up, shared "
                    f"memory aside ({first:.1f} -> {last:.1f} MB; bound {RSS_GROWTH_MB:.0f} MB)"
                )
        levels: dict[tuple[str, int], dict[str, Any]] = {}
        for s in after:
            if s["kind"] not in ("shutdown", "release"):
                continue
            where = f"after the {s['kind']} at {s['t']:.0f} s (step {s['step']})"
            if s["shm_n"]:
                broken.append(f"/dev/shm kept {s['shm']} {where}")
            if s.get("rrefs"):
                broken.append(f"{s['rrefs']} RRefs live {where}")
            held = {p: n for p, n in (s.get("contexts") or {}).items() if n}
            if held:
                broken.append(f"autograd contexts live {where}: {held}")
            if s.get("arenas_held", 0) > 1 + max(CLUSTER_SIZES):
                broken.append(f"{s['arenas_held']} arenas of gone clusters held {where}")
            if s.get("widgets", 0) > WIDGETS_MAX:
                broken.append(f"{s['widgets']} widgets held {where} (at most {WIDGETS_MAX})")
            if s.get("view_threads", 0) > 3:
                broken.append(f"{s['view_threads']} live views' threads {where}")
            if s["kind"] == "release" and s.get("processes"):
                broken.append(f"processes under the kernel {where}: {s['process_roles']}")
            key = (s["kind"], s.get("process_roles", {}).get("engine", 0))
            first = levels.setdefault(key, s)
            allowed = SOCKETS_PER_WORKER * (s.get("joined", 0) - first.get("joined", 0))
            if s.get("sockets", 0) > first.get("sockets", 0) + allowed:
                broken.append(
                    f"sockets {s['sockets']} {where}: more than the level of the first such "
                    f"shutdown after the warm-up ({first['sockets']} at {first['t']:.0f} s) "
                    f"and {SOCKETS_PER_WORKER} per worker started since (torch's pipes to "
                    f"them: {allowed})" + _grew(first, s)
                )
            for figure in (
                "fds_other",
                "threads_other",
                "processes",
                "tmp_n",
                "ipp_log",
                "ipp_security",
            ):
                allowed = _notebook_sockets_more(first, s) if figure == "fds_other" else 0
                if s.get(figure, 0) > first.get(figure, 0) + allowed:
                    broken.append(
                        f"{figure} {s[figure]} {where}, above the level of the first such "
                        f"shutdown after the warm-up ({first[figure]} at {first['t']:.0f} s)"
                        + _grew(first, s)
                    )
        return broken

    def report(self, ended_by: str) -> int:
        broken = self.bounds() if self.samples else ["no figures were sampled"]
        after = [s for s in self.samples if "rss_mb" in s]
        report = {
            "seed": self.seed,
            "minutes": self.minutes,
            "warmup_minutes": self.warmup,
            "steps": self.step,
            "seconds": round(self.elapsed(), 1),
            "ops": dict(self.ops_run),
            "ended_by": ended_by,
            "kernels": self.segment,
            "failures": [r for r in self.records if r["kind"] == "failure"],
            "findings": [r for r in self.records if r["kind"] == "finding"],
            "bounds_broken": broken,
            "figures": _summary(after, self.warmup * 60),
            "magic_seconds": {k: _spread(v) for k, v in self.durations.items()},
            "notes": {k: v[-20:] for k, v in self.notes.items()},
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        with contextlib.suppress(Exception):
            plot(self.samples, self.warmup * 60, self.out / "soak.png", self.seed)
        print(json.dumps({k: report[k] for k in ("seed", "steps", "seconds", "ops")}))
        print(json.dumps(report["figures"], indent=1))
        for what in broken:
            print(f"soak bound broken: {what}")
        bad = report["failures"] or report["findings"] or broken
        print(
            f"soak: {'FAILED' if bad else 'passed'}: seed {self.seed}, {self.step} steps, "
            f"{len(report['failures'])} failures, {len(report['findings'])} findings, "
            f"{len(broken)} bounds broken; see {self.out}"
        )
        return 1 if bad else 0


def _own_rss(sample: dict[str, Any]) -> float:
    """The kernel's RSS less its shared memory (RssShmem): the arenas of the running
    cluster it maps (37 MB at one run's end, mid-work, 0 at the release after) are the
    cluster's, bounded after each shutdown on their own (arenas held)."""
    return sample["rss_mb"] - (sample.get("rssshmem_mb") or 0.0)


def _descriptors(pid: int) -> set[tuple[int, str]]:
    """The process's open file descriptors: (number, what it links to)."""
    found: set[tuple[int, str]] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError, ValueError):
            found.add((int(fd.name), os.readlink(fd)))
    return found


def _fd_kind(target: str) -> str:
    """What a file descriptor is, from its link: socket, pipe, eventfd, eventpoll, pidfd,
    a file; an arena of the last cluster the kernel keeps mapped once its file is gone."""
    if target.startswith("anon_inode:"):
        return target.removeprefix("anon_inode:").strip("[]")
    if target.startswith("/dev/shm/") and target.endswith("(deleted)"):
        return "arena (deleted)"
    return target.split(":")[0] if not target.startswith("/") else "file"


def _notebook_sockets_more(first: dict[str, Any], s: dict[str, Any]) -> int:
    """The descriptors ``s`` may hold more than ``first`` for ipykernel's sake: it keeps a
    socket (an eventfd) for each live thread that sent to the notebook, and a thread that
    sends for the first time after the level was taken (a live view's, the timer service
    that shows workers' output) adds one, held while the thread lives. Counted in the
    kernel where the figures have it, else one per live view's thread more."""
    if "notebook_pipes" in first and "notebook_pipes" in s:
        return max(0, s["notebook_pipes"] - first["notebook_pipes"])
    return max(0, s.get("view_threads", 0) - first.get("view_threads", 0))


def _grew(first: dict[str, Any], now: dict[str, Any]) -> str:
    """What grew between two samples, by name (threads, fds, processes, files)."""
    parts = []
    for key in ("native_threads", "py_threads", "fd_kinds", "process_roles"):
        a, b = first.get(key) or {}, now.get(key) or {}
        more = {k: b[k] - a.get(k, 0) for k in b if b[k] > a.get(k, 0)}
        if more:
            parts.append(f"{key} +{more}")
    for key, where in (
        ("tmp", "$TMPDIR"),
        ("ipp_files", "ipyparallel's profile"),
        ("fd_files", "the kernel's open files"),
    ):
        new = sorted(set(now.get(key, [])) - set(first.get(key, [])))
        if new:
            parts.append(f"new in {where}: {new[:5]}")
    return ": " + "; ".join(parts) if parts else ""


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(ordered), "median": round(ordered[len(ordered) // 2], 2),
            "max": round(ordered[-1], 2)}  # fmt: skip


FIGURES = (
    "rss_mb",
    "rss_untrimmed_mb",
    "rssanon_mb",
    "rssshmem_mb",
    "fds",
    "sockets",
    "fds_other",
    "arenas_held",
    "threads",
    "processes",
    "shm_n",
    "tmp_n",
    "ipp_log",
    "rrefs",
    "joined",
)


def _summary(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Each figure at the start, after the warm-up, at its highest and at the end (of the
    last kernel, where there were several)."""
    samples = [s for s in samples if s["kernel"] == samples[-1]["kernel"]] if samples else []
    if not samples:
        return {}
    warm = next((s for s in samples if s["kernel_t"] >= warmup_s), samples[-1])
    return {
        name: {
            "start": samples[0].get(name),
            "after_warmup": warm.get(name),
            "max": max((s.get(name) or 0) for s in samples),
            "end": samples[-1].get(name),
        }
        for name in FIGURES
    }


def plot(samples: list[dict[str, Any]], warmup_s: float, path: Path, seed: int) -> None:
    """The figures over time, one panel each; shutdowns marked, the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (
            "kernel RSS (MB): after malloc_trim, anonymous, shared memory; before trim"
            if any(s.get("rss_untrimmed_mb") for s in samples)
            else "kernel RSS (MB): all, anonymous, shared memory (not trimmed)",
            ["rss_mb", "rssanon_mb", "rssshmem_mb", "rss_untrimmed_mb"],
        ),
        ("kernel: open files (sockets, others), threads", ["sockets", "fds_other", "threads"]),
        ("processes under the kernel", ["processes"]),
        ("/dev/shm, $TMPDIR entries", ["shm_n", "tmp_n"]),
        ("ipyparallel files (log, security)", ["ipp_log", "ipp_security"]),
        ("live RRefs, autograd contexts", ["rrefs", "contexts_n"]),
        ("the kernel's widgets (ipywidgets)", ["widgets"]),
    ]
    for s in samples:
        s["contexts_n"] = sum(v for v in (s.get("contexts") or {}).values() if isinstance(v, int))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 11.5), sharex=True)
    minutes = [s["t"] / 60 for s in samples]
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for key in keys:
            ax.plot(minutes, [s.get(key) for s in samples], marker=".", lw=1, label=key)
        ax.set_title(title, fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
        for s in samples:
            if s["kind"] == "start":  # a kernel's start and its warm-up
                ax.axvspan(s["t"] / 60, (s["t"] + warmup_s) / 60, color="0.9")
                if s["kernel"] > 1:
                    ax.axvline(s["t"] / 60, color="tab:red", lw=1)
            if s["kind"] in ("shutdown", "release"):
                ax.axvline(s["t"] / 60, color="0.7", lw=0.5, ls=":")
        if len(keys) > 1:
            ax.legend(fontsize=6, loc="upper left")
    axes[-1].set_xlabel(
        "minutes (shaded: a kernel's warm-up; dotted: shutdowns; red: a new kernel)", fontsize=8
    )
    fig.suptitle(f"nbrpc soak, seed {seed}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the mix runs")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument(
        "--warmup", type=float, default=None, help="minutes before the bounds apply (default 2)"
    )
    parser.add_argument("--out", default=str(ROOT / "build" / "soak"), help="where the figures go")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="tracemalloc in the kernel: what Python kept after the warm-up, by traceback, "
        "to OUT/memory.txt (slower)",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    warmup = args.warmup if args.warmup is not None else min(2.0, args.minutes / 3)
    print(f"soak: seed {seed}, {args.minutes:g} minutes, figures in {args.out}", flush=True)
    return Soak(seed, args.minutes, warmup, Path(args.out), args.trace_memory).run()


if __name__ == "__main__":
    sys.exit(main())
