"""What the soak (tools/soak.py) does in its kernel: the notebook code it types first, and
the operations it draws from, each as a person would type its cells.

Every operation is a function ``op(run, rng)``: ``run`` is the soak's driver (its cells,
checks and records: :class:`soak.Soak`), ``rng`` the step's own ``random.Random``, seeded
from the soak's seed and the step's number, so a step draws the same choices from the same
state whatever came before. An operation checks every result against the same computation
done in the kernel without RPC (the local twin), and says what went wrong through
``run.failure`` (a wrong result, a hang, an unclear error) or ``run.finding`` (the next magic
after a stop or a kill did not work from the state left, processes left behind).
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Callable
from typing import Any

#: The notebook's first cells, as a person types them, then the code the soak calls.
LOAD = "%load_ext nbrpc"

NOTEBOOK = '''
import collections, gc, json, os, re, sys, threading, time
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import nbrpc
from nbrpc.optim import DistributedOptimizer

def scaled(t, k):                 # a call of any size
    return t * k + 1

def fill(n, v):                   # the value of an RRef, made on its owner
    return torch.full((n,), float(v), dtype=torch.float64)

def total(rref):                  # an RRef passed on: read where it was sent
    return float(rref.to_here().sum())

def make_on(dst, n, v):           # a worker makes an RRef that another one owns
    return nbrpc.remote(dst, fill, args=(n, v))

def shout(n, tag):                # an output flood
    for i in range(n):
        print(f"{tag} {i}")
    return n

def sleepy(seconds):
    time.sleep(seconds)
    return seconds

def spin(seconds):
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x += 1
    return x

def pid():
    return os.getpid()

class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n

class Stage(torch.nn.Module):
    def __init__(self, seed, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out).double()
        # not torch.manual_seed: two stages made at once on one worker share its RNG
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=g) / 2)
    def forward(self, x):
        return torch.tanh(self.lin(x))
    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]
    def weights(self):
        return [p.detach().clone() for p in self.parameters()]

def contexts():                   # live distributed autograd contexts in this process
    try:
        return int(dist_autograd._get_debug_info()["num_autograd_contexts"])
    except Exception:
        return None

def soak_probe():
    """Where the cluster stands: the soak's model of it is this."""
    try:
        cluster = nbrpc.current()
    except nbrpc.NotInitializedError:
        return {"running": False, "state": "none", "workers": {}}
    return {
        "running": cluster.state.value == "ready",
        "state": cluster.state.value,
        "workers": {r.name: str(r.state.value) for r in cluster.workers[1:]},
    }

def soak_figures():
    """The kernel's side of a sample: Python threads by name, live RRefs, autograd
    contexts per process (after a collection, so garbage is not counted as held, and
    glibc's malloc_trim, so memory freed but kept by the allocator is not counted either:
    a kernel that moved 16 MB tensors kept 100-180 MB so, measured)."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    names = collections.Counter(re.sub(r"[0-9]+", "N", t.name) for t in threading.enumerate())
    # ipykernel's sockets, one per live thread that sent to the notebook (an eventfd each)
    pipes = getattr(getattr(sys.stdout, "pub_thread", None), "_event_pipes", None)
    from ipywidgets.widgets.widget import _instances as widgets  # every widget not closed
    fig = {"py_threads": dict(names), "contexts": {"kernel": contexts()}, "rrefs": 0,
           "rrefs_owned": {}, "rrefs_held": {}, "notebook_pipes": len(pipes or ()),
           "widgets": len(widgets), **soak_probe()}
    if fig["running"]:
        fig["rrefs"] = len(nbrpc.ownership())
        for row in nbrpc.status():
            fig["rrefs_owned"][row["name"]] = row["rrefs_owned"]
            fig["rrefs_held"][row["name"]] = row["rrefs_held"]
            if row["role"] != "kernel" and row["state"] == "ready":
                try:
                    fig["contexts"][row["name"]] = nbrpc.rpc_sync(row["name"], contexts, timeout=10)
                except Exception as exc:
                    fig["contexts"][row["name"]] = type(exc).__name__
    return fig
'''

#: After each operation: the names its cells made are dropped, and IPython's output
#: history. A person keeps results in variables; the soak measures what nbrpc keeps, and
#: a received tensor kept in a variable keeps its shared-memory arena mapped, rightly.
FORGET = """
for _name in [n for n in list(globals()) if re.fullmatch(
        r"(t|r)[0-9]?|futs|c|m[12]?|opt|l[12]|lopt|g|x|loss|remote_w|local_w|rows|held|rec"
        r"|got|ready|soak_tl|soak_fut|w|i|view|views|step|_pids|_futs|_failed|big", n)]:
    del globals()[_name]
get_ipython().run_line_magic("reset", "-f out")
"""

KB, MB = 1024, 1024 * 1024
#: the sizes of a call's tensor: 1 KB (a lane) to 16 MB (the shared-memory arena)
SIZES = [KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB]

#: Bad input to every magic: what a person types by mistake, and what the error must name
#: (a regular expression on the error's text). ``when``: "running", "none" (no cluster) or
#: "any". An error must come at once, be a UsageError or one of nbrpc's, and name this.
BAD_INPUT: list[tuple[str, str, str]] = [
    ("%rpc_init -n 0", "none", r"-n|\bn\b|worker"),
    ("%rpc_init -n -3", "none", r"-3|-n|\bn\b"),
    ("%rpc_init -n two", "none", r"two"),
    ("%rpc_init -n 100000", "none", r"100000 workers do not fit.*Nothing was started"),
    ("%rpc_scale 100000", "running", r"do not fit.*Nothing was started"),
    ("%rpc_init -n 2 --bogus", "none", r"--bogus"),
    ("%rpc_init -n 2 --device-map nonsense", "none", r"nonsense|device"),
    ("%rpc_init -n 2 --device-map worker1=cuda:0->cuda:1", "none", r"cuda|device|GPU"),
    ("%rpc_init --names a,a", "none", r"\ba\b|twice|duplicate|unique"),
    ("%rpc_init -n 2 --threads 0", "none", r"thread"),
    ("%rpc_init -n 2 --timeout -5", "none", r"timeout|-5"),
    ("%rpc_init -n 2", "running", r"already|%rpc_shutdown"),
    ("%rpc_restart worker9", "running", r"worker9"),
    ("%rpc_restart worker0", "running", r"worker0|kernel"),
    ("%rpc_restart worker1", "none", r"%rpc_init|no cluster|not running|initiali"),
    ("%rpc_restart", "any", r"names|argument|worker"),
    ("%rpc_scale -1", "running", r"-1|at least|\bn\b"),
    ("%rpc_scale two", "any", r"two"),
    ("%rpc_scale 2 --remove worker9", "running", r"worker9"),
    ("%rpc_scale 2 --bogus", "any", r"--bogus"),
    ("%rpc_scale 2", "none", r"%rpc_init|no cluster|not running|initiali"),
    ("%rpc_shutdown --bogus", "any", r"--bogus"),
    ("%rpc_shutdown now", "any", r"now"),
    ("%%rpc worker9\n1 + 1", "running", r"worker9"),
    ("%%rpc --bogus\n1 + 1", "any", r"--bogus"),
    ("%%rpc all\n1 + 1", "none", r"%rpc_init|no cluster|not running|initiali"),
    ("%rpc_stacks worker9", "running", r"worker9"),
    ("%rpc_stacks --bogus", "any", r"--bogus"),
    ("%%rpc_timeline --bogus\n1 + 1", "any", r"--bogus"),
    ("%rpc_status --bogus", "any", r"--bogus"),
    ("%rpc_panel --bogus", "any", r"--bogus"),
    ("%rpc_debug --bogus", "any", r"--bogus"),
]
#: the errors a bad input may raise: IPython's for what the parser refuses, nbrpc's own
CLEAR_ERRORS = (
    "UsageError",
    "ConfigError",
    "UnknownWorkerError",
    "NotInitializedError",
    "AlreadyInitializedError",
    "DeviceMapError",
    "ClusterClosedError",
)

# -- helpers ----------------------------------------------------------------------------------


def workers(run: Any) -> list[str]:
    return list(run.model["workers"])


def pick(rng: random.Random, names: list[str], k: int = 1) -> list[str]:
    return [rng.choice(names) for _ in range(k)]


def tensor_code(name: str, nbytes: int, rng: random.Random) -> str:
    """A line making tensor ``name`` of ``nbytes`` (float32, float64 or int64)."""
    dtype, size = rng.choice([("float32", 4), ("float64", 8), ("int64", 8)])
    n = max(1, nbytes // size)
    return f"{name} = (torch.arange({n}, dtype=torch.{dtype}) % {rng.randint(3, 97)})"


def check_all(run: Any, why: str) -> bool:
    """Every worker of the cluster answers a call (after a stop, a kill, a lifecycle
    magic); a worker that does not is a finding. Whether all answered."""
    names = workers(run)
    if not names:
        return True
    cell = (
        f"_futs = {{w: nbrpc.rpc_async(w, pid, timeout=20) for w in {names!r}}}\n"
        "_pids, _failed = {}, {}\n"
        "for w, f in _futs.items():\n"
        "    try:\n"
        "        _pids[w] = f.wait()\n"
        "    except Exception as e:\n"
        "        _failed[w] = f'{type(e).__name__}: {e}'[:300]\n"
        "assert not _failed, _failed\n"
        "assert len(set(_pids.values())) == len(_pids), _pids\n"
        "print('SOAK-OK', _pids)"
    )
    return run.ok(cell, run.limits["check"], f"every worker answers after {why}", finding=True)


def settle(run: Any, rng: random.Random, after: str) -> None:
    """After a stop or a kill: the magic a person types next must work from the state left.

    Nothing running: ``%rpc_init``; a worker dead or restarting: ``%rpc_restart`` it; a
    cluster that is neither closed nor ready: ``%rpc_shutdown``. When that magic fails it
    is a finding, and the soak starts afresh (``%rpc_shutdown --release``, ``%rpc_init``).
    """
    state = run.probe()
    if state is None:
        return
    if state["running"]:
        stuck = [n for n, s in state["workers"].items() if s in ("dead", "restarting")]
        if stuck:
            magic = f"%rpc_restart {','.join(stuck)}"
            if not run.magic(magic, "restart", f"after {after}", finding=True):
                run.fresh(after)
                return
    elif state["state"] != "none":  # booting or shutting down: not a state to stay in
        run.finding(f"after {after} the cluster is {state['state']!r}, not ready or closed")
        if not run.magic("%rpc_shutdown", "shutdown", f"after {after}", finding=True):
            run.fresh(after)
            return
        run.level("shutdown")
    if not run.model["running"]:
        magic = f"%rpc_init -n {rng.randint(1, 3)}"
        if not run.magic(magic, "init", f"after {after}", finding=True):
            run.fresh(after)
            return
    if not check_all(run, after):
        run.fresh(after)
        return
    run.check_processes(after)


def stop_moment(run: Any, kind: str, rng: random.Random) -> float:
    """A random moment of a magic of ``kind`` (from how long the last ones took)."""
    return rng.uniform(0.02, max(0.3, run.typical(kind)))


def started_by(line: str, before: int) -> int:
    """How many workers magic ``line`` may start (at most), with ``before`` workers."""
    words = line.split("#")[0].split()
    if words[0] == "%rpc_restart":
        return len([n for w in words[1:] for n in w.split(",") if n])
    if words[0] == "%rpc_scale":
        return max(0, int(words[1]) - before)
    if words[0] == "%rpc_init":
        return int(words[words.index("-n") + 1]) if "-n" in words else len(words[2].split(","))
    return 0


def lifecycle(run: Any, rng: random.Random, line: str, kind: str, why: str) -> bool:
    """Run lifecycle magic ``line``; with a chance, press the stop button at a random
    moment of it and then check that the next magic works (:func:`settle`). Whether it ran
    to its end (not stopped, no error)."""
    if rng.random() < run.stop_chance:
        run.joined += started_by(line, len(workers(run)))
        at = stop_moment(run, kind, rng)
        cell = run.cell(line, run.limits[kind], stop_at=at)
        run.say(f"stop {at:.2f} s into {line!r}: {cell.describe()}")
        if cell.pressed:
            run.check_stop(cell, line)
            settle(run, rng, f"the stop button {at:.2f} s into {line!r}")
            return False
        if cell.errors:
            run.failure(f"{line!r} failed: {cell.errors[0][:300]}")
            run.fresh(f"{line!r} failed")
            return False
        run.sync()
        return True
    if not run.magic(line, kind, why):
        run.fresh(f"{line!r} failed")
        return False
    return True


# -- the operations -------------------------------------------------------------------------------


def op_calls(run: Any, rng: random.Random) -> None:
    """Calls of every size, each checked against the same computation here: rpc_sync,
    rpc_async, remote, and torch's own spelling."""
    lines = []
    for i in range(rng.randint(1, 4)):
        w = rng.choice(workers(run))
        size = rng.choice(SIZES)
        k = rng.randint(-3, 5)
        how = rng.choice(["nbrpc.rpc_sync", "nbrpc.rpc_async", "nbrpc.remote", "rpc.rpc_sync"])
        call = f"{how}({w!r}, scaled, args=(t{i}, {k}))"
        call += {"nbrpc.rpc_async": ".wait()", "nbrpc.remote": ".to_here()"}.get(how, "")
        lines += [
            tensor_code(f"t{i}", size, rng),
            f"r{i} = {call}",
            f"assert torch.equal(r{i}, t{i} * {k} + 1), ({w!r}, {size})",
        ]
    run.ok("\n".join([*lines, "print('SOAK-OK')"]), run.limits["call"], "calls")


def op_fanout(run: Any, rng: random.Random) -> None:
    """rpc_async fan-outs: many futures to every worker at once, then wait_all."""
    m = rng.randint(4, 32)
    size = rng.choice(SIZES[:5])
    cell = f"""
{tensor_code("t", size, rng)}
futs = [(w, i, nbrpc.rpc_async(w, scaled, args=(t, i)))
        for i in range({m}) for w in {workers(run)!r}]
torch.futures.wait_all([f for _, _, f in futs])
for w, i, f in futs:
    assert torch.equal(f.value(), t * i + 1), (w, i)
print('SOAK-OK', len(futs))
"""
    run.ok(cell, run.limits["call"], "an rpc_async fan-out")


def op_rrefs(run: Any, rng: random.Random) -> None:
    """RRefs passed among workers: one owned by a, read by b; one b owns that a made and
    the kernel holds; a proxy's method calls; then dropped (ownership figures follow)."""
    names = workers(run)
    a, b = rng.choice(names), rng.choice(names)
    n, v, u = rng.randint(1, 5000), rng.randint(-9, 9), rng.randint(1, 9)
    cell = f"""
r1 = nbrpc.remote({a!r}, fill, args=({n}, {v}))
assert nbrpc.rpc_sync({b!r}, total, args=(r1,)) == {n * v}
r2 = nbrpc.rpc_sync({a!r}, make_on, args=({b!r}, {n}, {u}))
assert r2.owner().name == {b!r}, r2.owner()
assert torch.equal(r2.to_here(), fill({n}, {u}))
r3 = nbrpc.remote({b!r}, total, args=(r1,))
assert r3.to_here() == {n * v}
c = nbrpc.remote({a!r}, Counter)
assert [c.rpc_sync().add(k) for k in (1, 2, 3)] == [1, 3, 6]
assert c.remote().add(4).to_here() == 10
del r1, r2, r3, c
print('SOAK-OK')
"""
    run.ok(cell, run.limits["call"], "RRefs passed among workers")


def op_autograd(run: Any, rng: random.Random) -> None:
    """Distributed autograd through two stages on two workers, with DistributedOptimizer
    steps, against the same model trained here."""
    names = workers(run)
    a, b = rng.choice(names), rng.choice(names)
    s1, s2, steps = rng.randint(0, 999), rng.randint(0, 999), rng.randint(1, 4)
    lr = rng.choice([0.01, 0.05, 0.1])
    cell = f"""
m1 = nbrpc.remote({a!r}, Stage, args=({s1}, 4, 6))
m2 = nbrpc.remote({b!r}, Stage, args=({s2}, 6, 2))
opt = DistributedOptimizer(torch.optim.SGD,
                           m1.rpc_sync().param_rrefs() + m2.rpc_sync().param_rrefs(), lr={lr})
l1, l2 = Stage({s1}, 4, 6), Stage({s2}, 6, 2)
lopt = torch.optim.SGD([*l1.parameters(), *l2.parameters()], lr={lr})
g = torch.Generator().manual_seed({s1 + s2})
for step in range({steps}):
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)
    with dist_autograd.context() as ctx:
        loss = m2.rpc_sync().forward(m1.rpc_sync().forward(x)).sum()
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)
    lopt.zero_grad()
    l2(l1(x)).sum().backward()
    lopt.step()
remote_w = m1.rpc_sync().weights() + m2.rpc_sync().weights()
local_w = [p.detach() for p in [*l1.parameters(), *l2.parameters()]]
assert all(torch.allclose(r, l) for r, l in zip(remote_w, local_w)), 'weights differ'
del m1, m2, opt
print('SOAK-OK')
"""
    run.ok(cell, run.limits["call"], "dist autograd and DistributedOptimizer steps")


def op_rpc_cell(run: Any, rng: random.Random) -> None:
    """``%%rpc`` cells: a value set in each worker's namespace, read back by a second cell."""
    names = workers(run)
    targets = names if rng.random() < 0.5 else sorted(set(pick(rng, names, 2)))
    line = "all" if targets == names and rng.random() < 0.5 else ",".join(targets)
    v = rng.randint(1, 10**6)
    first = run.cell(f"%%rpc {line}\nsoak_v = {v}\nimport os\nsoak_pid = os.getpid()", 60)
    if first.errors:
        run.failure(f"%%rpc {line}: {first.errors[0][:300]}")
        return
    second = run.cell(f"%%rpc {line}\nsoak_v * 3", run.limits["call"])
    missing = [w for w in targets if f"Out[{w}]: {v * 3}" not in second.out]
    if second.errors or missing:
        run.failure(f"%%rpc {line}: no Out for {missing}: {second.errors[:1]} {second.out[-300:]}")


def op_views(run: Any, rng: random.Random) -> None:
    """The views and the panel, refreshed: status rows, ownership rows of a held RRef,
    the widgets, %rpc_status, %rpc_panel."""
    names = workers(run)
    w = rng.choice(names)
    which = rng.choice(["status", "ownership", "widgets", "%rpc_status", "%rpc_panel"])
    if which == "status":
        cell = f"""
rows = nbrpc.status()
ready = [r['name'] for r in rows if r['state'] == 'ready']
assert ready[0] == 'worker0' and sorted(ready[1:]) == sorted({names!r}), ready
assert all(r['memory_rss'] for r in rows if r['state'] == 'ready'), rows
print('SOAK-OK')
"""
    elif which == "ownership":
        cell = f"""
held = nbrpc.remote({w!r}, fill, args=(3, 1))
held.to_here()
rows = nbrpc.ownership()
assert any(r['owner'] == {w!r} and 'worker0' in r['holders'] for r in rows), rows
del held
print('SOAK-OK')
"""
    elif which == "widgets":
        cell = """
import nbrpc.widgets as views
for view in (views.ClusterView(live=False), views.OwnershipView(live=False)):
    view.refresh()
    assert view.html and repr(view), type(view).__name__
    view.close()
print('SOAK-OK')
"""
    else:
        cell = which + "\nprint('SOAK-OK')"
    run.ok(cell, run.limits["view"], f"the views ({which})")


def op_record(run: Any, rng: random.Random) -> None:
    """``nbrpc.record()`` and ``%%rpc_timeline``: every call made inside is recorded."""
    w = rng.choice(workers(run))
    k = rng.randint(1, 12)
    if rng.random() < 0.5:
        cell = f"""
with nbrpc.record() as rec:
    for i in range({k}):
        nbrpc.rpc_sync({w!r}, scaled, args=(torch.ones(4), i))
got = [c for c in rec.calls if c['function'] == 'scaled' and c['callee'] == {w!r}]
assert len(got) == {k} and all(c['ok'] for c in got), rec.calls
print('SOAK-OK')
"""
        run.ok(cell, run.limits["view"], "a recording")
        return
    run.ok(
        f"%%rpc_timeline --name soak_tl\nfor i in range({k}):\n"
        f"    nbrpc.rpc_sync({w!r}, scaled, args=(torch.ones(4), i))\nprint('SOAK-OK')",
        run.limits["view"],
        "%%rpc_timeline",
    )
    run.ok(
        f"got = [c for c in soak_tl.calls if c['function'] == 'scaled']\n"
        f"assert len(got) == {k}, soak_tl.calls\nprint('SOAK-OK')",
        run.limits["view"],
        "%%rpc_timeline's recording",
    )


def op_stacks(run: Any, rng: random.Random) -> None:
    """``nbrpc.stacks()`` and ``%rpc_stacks``: every process answers."""
    names = workers(run)
    if rng.random() < 0.5:
        cell = f"""
rows = nbrpc.stacks()
assert {{r['name'] for r in rows}} >= {{'worker0', *{names!r}}}, [r['name'] for r in rows]
assert not [r for r in rows if r['error']], [(r['name'], r['error']) for r in rows]
print('SOAK-OK')
"""
        run.ok(cell, run.limits["view"], "nbrpc.stacks()")
        return
    target = rng.choice(["", rng.choice(names)])
    cell = run.cell(f"%rpc_stacks {target}".strip(), run.limits["view"])
    if cell.errors or not all(n in cell.out for n in ([target] if target else names)):
        run.failure(f"%rpc_stacks {target}: {cell.errors[:1]} {cell.out[:300]}")
    run.note("stacks_chars", len(cell.out))


def op_flood(run: Any, rng: random.Random) -> None:
    """An output flood: thousands of lines printed on a worker, each shown once, in order."""
    w = rng.choice(workers(run))
    n = rng.choice([100, 1000, 5000, 20000])
    tag = f"flood{rng.randint(0, 9999)}"
    cell = run.cell(
        f"assert nbrpc.rpc_sync({w!r}, shout, args=({n}, {tag!r})) == {n}\nprint('SOAK-OK')",
        run.limits["flood"],
    )
    seen = [int(m) for m in re.findall(rf"\[{w}\] {tag} (\d+)", cell.out)]
    if cell.errors or "SOAK-OK" not in cell.out or seen != list(range(n)):
        run.failure(
            f"a flood of {n} lines from {w}: {len(seen)} shown"
            f"{', out of order' if seen != sorted(seen) else ''} {cell.errors[:1]}"
        )


#: what a cell does while the stop button is pressed at a random moment of it
STOPPED_CELLS: dict[str, Callable[[list[str]], str]] = {
    "a sleeping call": lambda names: f"nbrpc.rpc_sync({names[0]!r}, sleepy, args=(30,))",
    "a spinning call": lambda names: f"nbrpc.rpc_sync({names[-1]!r}, spin, args=(30,))",
    "16 MB calls": lambda names: (
        "t = torch.arange(4 * 1024 * 1024, dtype=torch.float32)\n"
        "for i in range(400):\n"
        f"    w = {names!r}[i % {len(names)}]\n"
        "    assert torch.equal(nbrpc.rpc_sync(w, scaled, args=(t, i)), t * i + 1)"
    ),
    "a fan-out": lambda names: (
        f"futs = [nbrpc.rpc_async(w, spin, args=(0.2,)) for _ in range(40) for w in {names!r}]\n"
        "torch.futures.wait_all(futs)"
    ),
    "autograd steps": lambda names: (
        f"m = nbrpc.remote({names[0]!r}, Stage, args=(0, 4, 2))\n"
        "for i in range(2000):\n"
        "    with dist_autograd.context() as ctx:\n"
        "        x = torch.ones(2, 4, dtype=torch.float64)\n"
        "        dist_autograd.backward(ctx, [m.rpc_sync().forward(x).sum()])"
    ),
    "a %%rpc spin": lambda names: (
        "%%rpc all\nimport time\nend = time.time() + 30\nwhile time.time() < end: pass"
    ),
    "a flood": lambda names: f"nbrpc.rpc_sync({names[0]!r}, shout, args=(300000, STOPPED))",
}


def op_stop_call(run: Any, rng: random.Random) -> None:
    """The stop button at a random moment of a cell that calls the workers: the cell ends
    at once, and every worker answers the next call."""
    what = rng.choice(sorted(STOPPED_CELLS))
    names = workers(run)
    rng.shuffle(names)
    at = rng.uniform(0.05, 3.0)
    tag = f"stopped{run.step}-"
    code = STOPPED_CELLS[what](names).replace("STOPPED", repr(tag))
    cell = run.cell(code, run.limits["call"], stop_at=at)
    if what == "a flood":
        run.stopped_floods.append(tag)
    run.say(f"stop {at:.2f} s into {what}: {cell.describe()}")
    if cell.pressed:
        run.check_stop(cell, what)
    elif cell.errors:
        run.failure(f"{what} failed before the stop button: {cell.errors[0][:300]}")
    settle(run, rng, f"the stop button {at:.2f} s into {what}")


def op_bad_input(run: Any, rng: random.Random) -> None:
    """Bad input to a magic: a clear error at once (UsageError or nbrpc's own, naming what
    was wrong), and the cluster as it was (``%rpc_init``'s while none runs: see reinit)."""
    state = "running" if run.model["running"] else "none"
    line, _, says = rng.choice([b for b in BAD_INPUT if b[1] in ("any", state)])
    before = run.probe()
    cell = run.cell(line, run.limits["bad"])
    text = " ".join(cell.errors)
    kind = text.split(":", 1)[0].strip()
    if not cell.errors:
        run.failure(f"{line!r} raised nothing: {cell.out[:300]!r}")
    elif not any(k in kind for k in CLEAR_ERRORS):
        run.failure(f"{line!r} raised {kind}, not a UsageError or nbrpc's own: {text[:300]}")
    elif not re.search(says, text):
        run.failure(f"{line!r}: the error does not say what was wrong ({says}): {text[:300]}")
    if cell.seconds > 10:
        run.failure(f"{line!r} took {cell.seconds:.1f} s to refuse")
    after = run.probe()
    if before is not None and after is not None and before != after:
        run.failure(f"{line!r} changed the cluster: {before} -> {after}")
        settle(run, rng, f"bad input {line!r}")


def op_kill(run: Any, rng: random.Random) -> None:
    """SIGKILL a worker (during a call of it, or idle): its calls fail at once; then what a
    person does next (``%rpc_restart``, a re-init, or ``%rpc_scale``) must work."""
    names = workers(run)
    w = rng.choice(names)
    found = run.value(f"nbrpc.rpc_sync({w!r}, pid)", run.limits["check"])
    if found is None:
        return
    in_call = rng.random() < 0.5
    if in_call:
        run.ok(f"soak_fut = nbrpc.rpc_async({w!r}, sleepy, args=(30,))\nprint('SOAK-OK')", 30, "")
        time.sleep(rng.uniform(0.05, 1.0))
    run.kill(found, signal.SIGKILL)
    call = "soak_fut.wait()" if in_call else f"nbrpc.rpc_sync({w!r}, pid)"
    cell = run.cell(
        f"try:\n    {call}\nexcept nbrpc.WorkerDiedError as e:\n    print('SOAK-OK', e)",
        run.limits["check"],
    )
    if "SOAK-OK" not in cell.out or cell.seconds > 15:
        run.failure(
            f"a call to {w} after SIGKILL: {cell.errors[:1]} {cell.out[:200]!r} "
            f"in {cell.seconds:.1f} s"
        )
    then = rng.choice(["restart", "reinit", "scale"])
    run.say(f"killed {w} (pid {found}); then {then}")
    if then == "restart":
        why = f"%rpc_restart of {w} after its SIGKILL"
        if run.magic(f"%rpc_restart {w}", "restart", why, finding=True) and check_all(run, why):
            run.check_processes(why)
            return
        run.fresh(f"SIGKILL of {w}")
    elif then == "reinit":
        reinit(run, rng, stops=False)
    else:
        n = len(names) + (1 if len(names) < 3 else 0)
        # issue 66: a scale with a dead worker replaces it or refuses at once, naming it
        # and %rpc_restart
        run.joined += started_by(f"%rpc_scale {n}", len(names) - 1)
        cell = run.cell(f"%rpc_scale {n}", run.limits["scale_dead"])
        run.sync()
        text = " ".join(cell.errors)
        if cell.errors and not (w in text and "%rpc_restart" in text and cell.seconds < 10):
            run.finding(
                f"%rpc_scale {n} after SIGKILL of {w}: {cell.seconds:.1f} s, then "
                f"{text[:300]!r} (wanted: replaced, or refused at once naming {w} and "
                "%rpc_restart)"
            )
        settle(run, rng, f"%rpc_scale {n} after SIGKILL of {w}")


def op_restart(run: Any, rng: random.Random) -> None:
    """``%rpc_restart`` of one or two live workers (the stop button sometimes)."""
    names = workers(run)
    chosen = sorted(set(pick(rng, names, rng.randint(1, 2))))
    line = f"%rpc_restart {(',' if rng.random() < 0.5 else ' ').join(chosen)}"
    if lifecycle(run, rng, line, "restart", line) and check_all(run, line):
        run.check_processes(line)


def op_scale(run: Any, rng: random.Random) -> None:
    """``%rpc_scale`` to another size, 1..3, sometimes naming who leaves (stop button
    sometimes)."""
    names = workers(run)
    n = rng.choice([k for k in (1, 2, 3) if k != len(names)])
    line = f"%rpc_scale {n}"
    if n < len(names) and rng.random() < 0.5:
        line += " --remove " + ",".join(rng.sample(names, len(names) - n))
    if lifecycle(run, rng, line, "scale", line):
        if len(workers(run)) != n:
            run.failure(f"{line}: {len(workers(run))} workers, not {n}")
        if check_all(run, line):
            run.check_processes(line)


def reinit(run: Any, rng: random.Random, stops: bool = True) -> None:
    """``%rpc_shutdown`` (``--release`` sometimes), the figures back to their level, then
    ``%rpc_init`` at another size, 1..3, with or without shared memory and lanes."""
    release = rng.random() < 0.3
    line = "%rpc_shutdown --release" if release else "%rpc_shutdown"
    chance, run.stop_chance = run.stop_chance, run.stop_chance if stops else 0.0
    try:
        if run.model["running"] and lifecycle(run, rng, line, "shutdown", line):
            run.level("release" if release else "shutdown")
        if not run.model["running"] and rng.random() < 0.5:
            op_bad_input(run, rng)  # %rpc_init's bad input, between clusters
        if not run.model["running"]:
            init(run, rng)
    finally:
        run.stop_chance = chance


def init(run: Any, rng: random.Random) -> None:
    n = rng.randint(1, 3)
    line = f"%rpc_init -n {n}"
    if rng.random() < 0.15:
        line = "%rpc_init --names " + ",".join(["ps", "trainer1", "trainer2"][:n])
    if rng.random() < 0.3:
        line += " --no-shm"
    if rng.random() < 0.2:
        line += " --no-fast-calls"
    if rng.random() < 0.5:
        line += rng.choice(["  # a fresh cluster", " --quiet"])
    if lifecycle(run, rng, line, "init", line) and check_all(run, line):
        run.check_processes(line)


def op_reinit(run: Any, rng: random.Random) -> None:
    reinit(run, rng)


#: the mix: (weight, needs a running cluster, operation)
MIX: list[tuple[int, bool, Callable[[Any, random.Random], None]]] = [
    (14, True, op_calls),
    (8, True, op_fanout),
    (8, True, op_rrefs),
    (6, True, op_autograd),
    (5, True, op_rpc_cell),
    (5, True, op_views),
    (4, True, op_record),
    (3, True, op_stacks),
    (4, True, op_flood),
    (8, True, op_stop_call),
    (6, False, op_bad_input),
    (3, True, op_kill),
    (4, True, op_restart),
    (4, True, op_scale),
    (5, True, op_reinit),
]


def draw(rng: random.Random, running: bool) -> Callable[[Any, random.Random], None]:
    """The step's operation: from the whole mix while a cluster runs, else a bad input or
    an ``%rpc_init``."""
    if not running:
        return rng.choice([op_bad_input, init, init, init])
    ops = [(w, op) for w, _, op in MIX]
    return rng.choices([op for _, op in ops], weights=[w for w, _ in ops])[0]


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
