"""A new user's first hour, run the way users run nbrpc.

A real Jupyter kernel (started as a user's is, see ``conftest.user_environment``), cells
typed as a person types them (the README's example pasted as it stands, comments after
magics, a space after a comma, the stop button pressed), and a plain script. Each test
is one thing a new user tried that once failed or said too little: a path the suite
called differently from a user can no longer pass while the user's path fails.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import Kernel, first_error, run_script, running_kernel, wait_until

ROOT = Path(__file__).resolve().parents[1]

FUNCS = """
import threading, time
import torch
import torch.distributed.autograd as dist_autograd
import nbrpc

def sleepy(seconds):
    time.sleep(seconds)
    return seconds

def make_generator():
    return (i for i in range(3))

async def make_coroutine():
    return 1

def make_lock():
    return threading.Lock()

class MyError(Exception):
    pass

def fail(x):
    raise MyError(f"bad value {x}")

def recurse(n):
    return recurse(n + 1)

def double(t):
    return t * 2

def crash(message):
    import os
    os.write(2, message.encode())
    os.abort()
"""


def readme_example() -> str:
    """The README's first notebook example, exactly as it stands there."""
    text = (ROOT / "README.md").read_text()
    return text.split("In a notebook:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(closing="%rpc_shutdown  # done for now") as k:
        out = k.run(readme_example(), timeout=180)  # pasted as a user pastes it
        assert "[worker1] adding on the worker" in out
        assert "tensor(3)" in out
        k.run(FUNCS)
        yield k


def test_magics_take_a_trailing_comment_and_spaced_names(kernel):
    out = kernel.run("%%rpc worker1  # only the first\nwho = 'w1'\nwho")
    assert "Out[worker1]: 'w1'" in out
    assert "worker2" not in out
    out = kernel.run("%%rpc worker1, worker2\n1 + 1")
    assert "Out[worker1]: 2" in out
    assert "Out[worker2]: 2" in out
    kernel.run("%rpc_status  # who is there")


@pytest.mark.parametrize(
    "cell",
    [
        "torch.futures.wait_all([nbrpc.rpc_async('worker2', sleepy, args=(10,))])",
        "import torch.distributed.rpc as rpc\nrpc.rpc_sync('worker1', sleepy, args=(10,))",
        "import torch.distributed.rpc as rpc\nrpc.rpc_async('worker1', sleepy, args=(10,)).wait()",
    ],
    ids=["torch.futures.wait_all", "rpc.rpc_sync", "rpc.rpc_async().wait()"],
)
def test_the_stop_button_ends_torch_style_waits(kernel, cell):
    ran_on, errors = kernel.stop_after(cell, seconds=2)
    assert errors
    assert errors[0].startswith("KeyboardInterrupt")
    assert ran_on < 5, f"the cell ran {ran_on:.1f} s after the stop button (the call: 10 s)"
    text = kernel.shown_error()
    assert "Cell In[" in text, text  # the cell's own line, as IPython names it
    for hidden in ("calls.py", "prompts.py", "torch/futures", "ipykernel_"):
        assert hidden not in text, text


@pytest.mark.parametrize(
    ("func", "says"),
    [
        ("make_generator", "make_generator returned a generator"),
        ("make_coroutine", "make_coroutine returned a coroutine"),
        ("make_lock", "cannot send a lock back from worker1"),
    ],
)
def test_a_result_that_cannot_travel_is_a_serialization_error_that_says_why(kernel, func, says):
    out = kernel.run(
        "try:\n"
        f"    nbrpc.rpc_sync('worker1', {func})\n"
        "except nbrpc.SerializationError as e:\n"
        "    print('CAUGHT', e)"
    )
    assert "CAUGHT" in out
    assert says in out
    assert "Exception raised from" not in out  # no C++ frames
    assert "create them on the worker" not in out  # the advice for arguments, not results


def test_the_torch_api_a_notebook_calls_behaves_like_nbrpc(kernel):
    out = kernel.run(
        "import torch.distributed.rpc as rpc\n"
        "print(rpc.rpc_sync('worker1', torch.ones, args=(3,)))\n"
        "print(rpc.remote('worker2', torch.zeros, args=(10,)).to_here().shape)\n"
        "print(rpc.rpc_sync('worker1', dict, kwargs={'k': 1}))\n"
        "try:\n"
        "    rpc.rpc_sync('worker1', fail, args=(2,))\n"
        "except MyError as e:\n"
        "    print('MyError from', e.worker)\n"
        "try:\n"
        "    rpc.rpc_sync('worker9', min, args=(1, 2))\n"
        "except nbrpc.UnknownWorkerError as e:\n"
        "    print('unknown:', e)"
    )
    assert "tensor([1., 1., 1.])" in out
    assert "torch.Size([10])" in out
    assert "{'k': 1}" in out
    assert "MyError from worker1" in out
    assert "unknown: No worker named 'worker9'" in out


RREF_PATHS = """
import threading
import torch.distributed.rpc as rpc

def make(dst):                       # an RRef made on one worker, owned by another
    return rpc.remote(dst, torch.add, args=(torch.ones(2), 1))

def in_containers(dst):
    return {"rrefs": [make(dst)], "pair": (make(dst), 2)}

def forward(rref):                   # an RRef received in arguments, sent back
    return rref

def value_of(rref):
    return rref.to_here()

class Box:
    def get(self):
        return torch.full((2,), 7.0)

results = {}
results["returned"] = rpc.rpc_sync("worker1", make, args=("worker2",)).to_here()
found = rpc.rpc_sync("worker1", in_containers, args=("worker2",))
results["in a list"] = found["rrefs"][0].to_here()
results["in a tuple"] = found["pair"][0].to_here(timeout=30)
mine = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
results["forwarded"] = rpc.rpc_sync("worker1", forward, args=(mine,)).to_here()
results["nested"] = rpc.remote("worker1", make, args=("worker2",)).to_here().to_here()
local = rpc.RRef(torch.ones(2) * 2)
results["owned here"] = rpc.rpc_sync("worker1", forward, args=(local,)).to_here()
results["to self"] = rpc.remote("worker0", torch.add, args=(torch.ones(2), 1)).to_here()
received = rpc.rpc_sync("worker1", make, args=("worker2",))
results["by a worker"] = rpc.rpc_sync("worker2", value_of, args=(received,))
box = rpc.rpc_sync("worker1", forward, args=(rpc.remote("worker2", Box),))
results["proxy"] = box.rpc_sync().get()
results["proxy remote"] = box.remote().get().to_here()
on_thread = []
def elsewhere():
    on_thread.append(rpc.rpc_sync("worker1", make, args=("worker2",)).to_here())
thread = threading.Thread(target=elsewhere)
thread.start()
thread.join(60)
results["another thread"] = on_thread[0]
for path, value in results.items():
    print(path, value.tolist())
"""


def test_every_rref_path_works_on_the_kernels_main_thread(kernel):
    """to_here() on the main thread (every cell's thread) of RRefs this kernel did not make
    with remote() itself: one a call returned, one inside a container, a fork it sent and
    got back, one a worker's remote() returned, proxies on them. Each once killed the
    kernel (torch's creation future of such an RRef is null)."""
    out = kernel.run(RREF_PATHS)
    for path in ("returned", "in a list", "in a tuple", "forwarded", "nested", "to self"):
        assert f"{path} [2.0, 2.0]" in out, out
    assert "owned here [2.0, 2.0]" in out
    assert "by a worker [2.0, 2.0]" in out
    assert "proxy [7.0, 7.0]" in out
    assert "proxy remote [7.0, 7.0]" in out
    assert "another thread [2.0, 2.0]" in out
    assert kernel.value("nbrpc.rpc_sync(1, min, args=(1, 2))") == 1  # still alive


def test_a_rank_or_a_worker_info_names_a_destination_as_in_torch(kernel):
    out = kernel.run(
        "import torch.distributed.rpc as rpc\n"
        "print('by rank', rpc.rpc_sync(2, min, args=(3, 4)))\n"
        "print('by info', rpc.rpc_async(rpc.get_worker_info('worker1'), max, args=(3, 4)).wait())\n"
        "print('remote by rank', rpc.remote(1, torch.ones, args=(2,)).to_here().tolist())\n"
        "print('info by rank', nbrpc.get_worker_info(2).name)\n"
        "try:\n"
        "    rpc.rpc_sync(42, min, args=(1, 2))\n"
        "except RuntimeError as e:\n"
        "    print('unknown:', type(e).__name__, e)"
    )
    assert "by rank 3" in out
    assert "by info 4" in out
    assert "remote by rank [1.0, 1.0]" in out
    assert "info by rank worker2" in out
    assert "unknown: UnknownWorkerError No worker with torch id 42" in out  # as torch takes it


def test_tracebacks_show_the_users_lines_not_nbrpcs(kernel):
    _, errors = kernel.execute("nbrpc.rpc_sync('worker1', recurse, args=(0,))")
    assert errors[0].startswith("RecursionError")
    text = kernel.shown_error()
    assert "Previous line repeated" in text
    assert len(text.splitlines()) < 40, text[:3000]  # it was 2,000 lines
    _, errors = kernel.execute("%%rpc\nraise ValueError('on both')")
    text = kernel.shown_error()
    assert "%%rpc failed on worker1, worker2" in text
    assert "_cells.py" not in text
    assert "calls.py" not in text
    assert len(text.splitlines()) < 30, text
    _, errors = kernel.execute(
        "x = torch.ones(3, requires_grad=True)\n"
        "with dist_autograd.context() as context_id:\n"
        "    loss = nbrpc.rpc_sync('worker1', double, args=(x,)).sum()\n"
        "    loss.backward()"
    )
    assert errors[0].startswith("AutogradContextError")
    assert "nbrpc.autograd.backward(context_id, [loss])" in errors[0]


def test_an_nbrpc_error_names_the_cell_as_ipython_does(kernel):
    kernel.execute("def keeps():\n    return __import__('threading').Lock()")
    _, errors = kernel.execute("nbrpc.rpc_sync('worker1', keeps)")
    assert errors[0].startswith("SerializationError")
    text = kernel.shown_error()
    assert "Cell In[" in text, text
    assert "ipykernel_" not in text, text


def test_push_to_an_unknown_worker_names_push(kernel):
    _, errors = kernel.execute("nbrpc.push({'a': 1}, workers='worker9')")
    assert "nbrpc.push targets worker9" in errors[0]


def test_the_kernel_named_where_a_worker_is_wanted_is_called_the_kernel(kernel):
    """``%rpc_restart worker0`` said the kernel was "not workers of this cluster"."""
    for cell, says in (
        ("%rpc_restart worker0", "cannot restart worker0: worker0 is the kernel"),
        ("%%rpc worker0\n1", "%%rpc targets worker0: worker0 is the kernel"),
        ("%rpc_restart worker9", "cannot restart worker9: worker9 is not a worker of this"),
    ):
        _, errors = kernel.execute(cell)
        assert errors[0].startswith("ConfigError"), (cell, errors)
        assert says in errors[0], (cell, errors)
        assert "not workers" not in errors[0], (cell, errors)


def test_a_crashed_worker_s_last_words_reach_the_cell_and_it_stays_quiet_after(kernel):
    """The death is reported once, by nbrpc: torch's lines about the crashed worker's
    closed connections (the kernel's, and worker1's, which had one to worker2 too) are
    left out of every cell, the crash's and the ones after."""
    # worker1 calls worker2: it holds a connection to worker2 when worker2 crashes
    assert kernel.value("nbrpc.rpc_sync('worker1', nbrpc.rpc_sync, ('worker2', min, (1, 2)))") == 1
    message = "terminate called after throwing an instance of 'c10::Error'\n"
    _, errors = kernel.execute(f"nbrpc.rpc_sync('worker2', crash, args=({message!r},))")
    assert errors[0].startswith("WorkerDiedError: worker2 is gone")
    shown = kernel.stderr
    text = kernel.shown_error()
    assert "terminate called after throwing an instance of 'c10::Error'" in text
    assert "Fatal Python error: Aborted" in text, (text, _last_words_read_again(kernel))
    _, errors = kernel.execute("nbrpc.rpc_sync('worker2', min, args=(1, 2))")
    assert errors[0].startswith("WorkerDiedError: worker2 is gone")
    shown += kernel.stderr
    kernel.execute("import time; time.sleep(1.5)")  # a held line would be shown by now
    shown += kernel.stderr
    assert "tensorpipe_agent.cpp" not in shown, shown
    assert kernel.value("nbrpc.rpc_sync('worker1', min, args=(1, 2))") == 1
    assert wait_until(lambda: "worker2 dead" in kernel.run("print(nbrpc.current().summary())"))
    # the one-line state says so wherever it stands: "ready" only when every process is
    summary = kernel.run("print(nbrpc.current().summary())")
    assert "nbrpc RPC group: 3 processes: 2 ready, worker2 dead" in summary
    status = kernel.run("%rpc_status")
    assert "nbrpc cluster: 3 processes: 2 ready, worker2 dead" in status, status
    html = kernel.value("nbrpc.current()._repr_html_()")
    assert "cluster: 3 processes: 2 ready, worker2 dead</div>" in html
    assert "processes, ready" not in html + status + summary
    # the status above asked nothing of worker2's RRefs (a fork sent to a dead owner stays
    # pending for good: every later shutdown waited its whole bound and said so in red)
    out = kernel.run("%rpc_shutdown\n%rpc_init -n 2 --quiet")  # the next cluster for what follows
    assert "Timed out waiting for pending" not in out + kernel.stderr


def _last_words_read_again(kernel) -> str:
    """For a failure's message: worker2's last words read now, and where they come from
    (its log's descriptor, whether its process still exists)."""
    return kernel.run(
        "import os, time\n"
        "time.sleep(1)\n"
        "_c = nbrpc.current()\n"
        "_pid = _c.booted.roster.find('worker2').pid\n"
        "_ctl = _c.engines.source.controller\n"
        "_fd, _start = _ctl._logs.get(_pid, (-1, 0))\n"
        "print('pid', _pid, 'log', _fd, _start, os.fstat(_fd) if _fd >= 0 else None,"
        " 'alive', os.path.exists(f'/proc/{_pid}'))\n"
        "print('read again:', repr(_c.last_output('worker2')))\n"
    )


def test_a_crashed_worker_s_last_words_reach_a_script(tmp_path):
    out = run_script(
        tmp_path / "crash.py",
        "import nbrpc\n"
        "def crash(message):\n"
        "    import os\n"
        "    os.write(2, message.encode())\n"
        "    os.abort()\n"
        "nbrpc.init(n=1, progress=False)\n"
        "try:\n"
        "    nbrpc.rpc_sync('worker1', crash, args=(\"terminate called (a test)\\n\",))\n"
        "except nbrpc.WorkerDiedError as e:\n"
        "    print(e)\n"
        "nbrpc.shutdown(release=True)\n",
    )
    assert "The last output of worker1's process:" in out
    assert "terminate called (a test)" in out
    assert "Fatal Python error: Aborted" in out


def test_before_rpc_init_a_torch_call_says_to_run_it_and_bad_input_is_one_line():
    k = Kernel()
    try:
        k.run("%load_ext nbrpc")
        _, errors = k.execute(
            "import torch.distributed.rpc as rpc\nrpc.rpc_sync('worker1', min, args=(1, 2))"
        )
        assert errors[0].startswith("NotInitializedError")
        assert "%rpc_init -n 2" in errors[0]
        for magic in ("%rpc_restart worker1", "%rpc_stacks"):  # they said "nbrpc.current()"
            _, errors = k.execute(magic)
            said = first_error(errors)
            assert said.startswith("NotInitializedError"), errors
            assert f"so nbrpc.{magic[5:].split()[0]}() ({magic.split()[0]}) has" in said, said
            assert "%rpc_init -n 2" in said, said
        _, errors = k.execute("%rpc_init -n 0   # none")
        assert k.tracebacks == [["ConfigError: -n must be at least 1, got 0"]]
    finally:
        k.close()


def test_a_killed_kernel_leaves_no_directory_behind():
    """The kernel's group store and its controller's directory (a kernel killed by the OS
    or the notebook's "shut down" left both, one pair per kernel)."""
    k = Kernel()
    try:
        k.run("%load_ext nbrpc\n%rpc_init -n 1 --quiet")
        k.run(
            "import glob, os, tempfile\n"
            "from nbrpc._engines import local\n"
            "ours = glob.glob(f'{tempfile.gettempdir()}/nbrpc-{os.getpid()}-*')\n"
            "ours.append(os.path.dirname(local.kept().pidfile))"
        )
        dirs = k.value("ours")
        assert len(dirs) == 2
        assert all(Path(d).is_dir() for d in dirs)
    finally:
        k.km.shutdown_kernel(now=True)  # SIGKILL: no atexit runs
        k.kc.stop_channels()
    assert wait_until(lambda: not any(Path(d).exists() for d in dirs), timeout=20), dirs


def test_a_store_left_by_a_kernel_killed_after_shutdown_goes_at_the_next_init():
    """After ``nbrpc.shutdown()`` no watchdog runs, and the kernel keeps its group store
    for its lifetime: killed then, it left the store. The next kernel's first
    ``%rpc_init`` removes it, and leaves a live process's alone."""
    k = Kernel()
    try:
        k.run("%load_ext nbrpc\n%rpc_init -n 1 --quiet")
        k.run("import nbrpc\nnbrpc.shutdown(release=True)")
        store = k.value(
            "__import__('os').path.dirname(nbrpc._group.current_kernel_membership().spec.path)"
        )
        assert Path(store).is_dir()
    finally:
        k.km.shutdown_kernel(now=True)  # SIGKILL: no atexit runs
        k.kc.stop_channels()
    assert Path(store).is_dir(), "the case this test is about did not happen"
    tmp = Path(tempfile.gettempdir())
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()  # a pid no one has
    kept = [
        tmp / f"nbrpc-{os.getpid()}-a-live-kernels",  # a live pid
        tmp / f"nbrpc-{gone}-held",  # a pid this namespace lacks, held (another container)
        tmp / "nbrpc-\u00b2-not-a-pid",  # digits int() refuses
    ]
    for path in kept:
        path.mkdir()
    held = os.open(kept[1], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    k = Kernel()
    try:
        k.run("%load_ext nbrpc\n%rpc_init -n 1 --quiet")
        assert not Path(store).exists()
        assert all(path.is_dir() for path in kept)
    finally:
        os.close(held)
        for path in kept:
            path.rmdir()
        k.close()


def test_the_stop_button_landing_in_torchs_rpc_code_shows_the_cells_lines():
    """Between nbrpc's waits a loop of small calls runs torch's Python RPC code (an
    RRef's ``rpc_sync()`` proxy, seen in a run of the RL tutorial): a KeyboardInterrupt
    raised there shows the cell's lines, as one raised in a wait does. Raised here from
    a frame of torch.distributed's own file, so where it lands is certain."""
    k = Kernel()
    try:
        k.run("%load_ext nbrpc\nimport os, torch")
        _, errors = k.execute(
            "where = os.path.join(os.path.dirname(torch.__file__), 'distributed', 'rpc', "
            "'rref_proxy.py')\n"
            "exec(compile('raise KeyboardInterrupt', where, 'exec'))"
        )
        assert errors == ["KeyboardInterrupt: "], errors
        text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(k.tracebacks[-1]))
        assert "Cell In[" in text, text
        assert "torch/distributed" not in text, text
        # one raised in the user's own code is IPython's, whole, as before
        k.execute("def mine():\n    raise KeyboardInterrupt\nmine()")
        text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(k.tracebacks[-1]))
        assert "in mine()" in text, text
        assert "raise KeyboardInterrupt" in text, text
    finally:
        k.close()


def test_the_status_table_keeps_its_columns_apart_at_a_hundred_workers():
    from nbrpc import _views

    rows = [
        {"name": f"worker{i}", "rank": i, "pid": 10000 + i, "host": "h", "role": f"engine {i}"}
        | {"state": "ready" if i != 7 else "dead"}
        for i in range(101)
    ]
    text = _views.records_text(rows, "ready", 14.0, [])
    assert "engine 100  ready" in text
    assert text.splitlines()[0].endswith("100 ready, worker7 dead (booted in 14.0 s)")
