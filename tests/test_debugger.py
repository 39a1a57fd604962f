"""A worker's ``breakpoint()`` and ``%rpc_debug``, typed into the calling cell.

The notebook is a real Jupyter kernel driven through jupyter_client: each input request it
sends (the worker's pdb prompt) is answered as a person would type it. Scripts run under a
pseudo-terminal, and with a stdin that is not one. The clock of call timeouts is tested on
its own too.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import running_kernel, wait_until

from nbrpc._debugger import deadlines, prompts

FUNCS = """
import nbrpc, os, time
def f(x):
    y = x * 2
    print("before", y)
    breakpoint()
    z = y + 1
    return z

def inner(b):
    c = b - b
    return b / c

def outer(a):
    b = a + 1
    return inner(b)
"""


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("%load_ext nbrpc\n%rpc_init -n 2", FUNCS) as k:
        yield k


def test_post_mortem_with_nothing_to_debug_says_so(kernel):
    assert "No remote exception to debug" in kernel.run("%rpc_debug")


def test_breakpoint_opens_pdb_in_the_calling_cell_and_c_returns_the_result(kernel):
    def slow_c(prompt, k):
        time.sleep(3)  # longer than the call's 2 s timeout: the clock stands still
        return "c"

    out = kernel.run(
        "nbrpc.rpc_sync('worker1', f, args=(20,), timeout=2)", answers=["p y", "l", slow_c]
    )
    assert kernel.prompts == ["(Pdb worker1) "] * 3
    assert out.index("[worker1] before 40") < out.index("--- pdb: worker1 (pid")
    assert "-> z = y + 1" in out  # the cell's source, fetched from the kernel's linecache
    assert "\n40\n" in out  # p y
    assert "  5  \t    breakpoint()" in out  # l lists the cell's lines
    assert out.rstrip().endswith("41")


def test_q_ends_the_call_with_a_clear_error(kernel):
    _out, errors = kernel.execute("nbrpc.rpc_sync('worker2', f, args=(1,))", answers=["q"])
    assert kernel.prompts == ["(Pdb worker2) "]
    assert errors
    assert errors[0].startswith("DebuggerQuitError: the call of f on worker2")
    assert kernel.value("nbrpc.rpc_sync('worker2', len, args=([1, 2],))") == 2


def test_two_breakpoints_are_served_one_session_at_a_time(kernel):
    code = (
        "futs = [nbrpc.rpc_async(w, f, args=(i,)) for i, w in enumerate(['worker1', 'worker2'])]\n"
        "print('RESULTS', [fut.wait() for fut in futs])"
    )
    out = kernel.run(code, answers=["p y", "c", "p y", "c"])
    first, second = kernel.prompts[0], kernel.prompts[2]
    assert {first, second} == {"(Pdb worker1) ", "(Pdb worker2) "}
    assert kernel.prompts == [first, first, second, second]  # never interleaved
    assert out.count("--- pdb: worker") == 2
    assert "RESULTS [1, 3]" in out


def test_remote_and_to_here_and_an_rpc_cell_open_pdb_too(kernel):
    out = kernel.run("nbrpc.remote('worker1', f, args=(5,)).to_here()", answers=["p x", "c"])
    assert kernel.prompts == ["(Pdb worker1) "] * 2
    assert "\n5\n" in out
    assert out.rstrip().endswith("11")
    cell = "%%rpc worker2\nv = 7\nbreakpoint()\nv * 6"
    out = kernel.run(cell, answers=["p v", "c"])
    assert kernel.prompts == ["(Pdb worker2) "] * 2
    assert "\n7\n" in out
    assert "42" in out


def test_a_breakpoint_in_a_call_between_workers_reaches_the_kernel(kernel):
    kernel.run("def via(x):\n    return nbrpc.rpc_sync('worker2', f, args=(x,), timeout=0)")
    out = kernel.run("nbrpc.rpc_sync('worker1', via, args=(4,))", answers=["p x", "c"])
    assert kernel.prompts == ["(Pdb worker2) "] * 2  # the worker that stopped
    assert "\n4\n" in out
    assert out.rstrip().endswith("9")


def test_rpc_debug_walks_the_frames_of_the_last_remote_exception(kernel):
    _, errors = kernel.execute("nbrpc.rpc_sync('worker1', outer, args=(3,))")
    assert errors
    assert errors[0].startswith("ZeroDivisionError")
    out = kernel.run("%rpc_debug", answers=["p b, c", "up", "p a", "down", "p c", "c"])
    assert kernel.prompts == ["(Pdb worker1) "] * 6
    assert "post-mortem on worker1: ZeroDivisionError" in out
    assert "-> return b / c" in out
    # the worker's locals in the frame that raised; one frame up, outer's; down again
    assert "\n(4, 0)\n" in out
    assert "\n3\n" in out
    assert "\n0\n" in out
    assert out.index("(4, 0)") < out.index("return inner(b)") < out.rindex("-> return b / c")


def test_stop_button_leaves_the_debugger_and_interrupts_the_call(kernel):
    def stop(prompt, k):
        k.km.interrupt_kernel()  # what the stop button does; nothing is typed

    _out, errors = kernel.execute("nbrpc.rpc_sync('worker1', f, args=(2,))", answers=[stop])
    assert kernel.prompts == ["(Pdb worker1) "]
    assert errors
    assert errors[0].startswith("KeyboardInterrupt")
    # the worker left pdb: its call ended, and it serves the next one at once
    start = time.monotonic()
    assert kernel.value("nbrpc.rpc_sync('worker1', len, args=([1],))") == 1
    assert time.monotonic() - start < 10
    # the stopped call unwinds on its own thread, which the next call does not wait for:
    # once it has, nothing is in flight (a busy machine ran the check before it had)
    counts = "nbrpc.rpc_sync('worker1', nbrpc._wire.callee.call_counts)['in_flight']"
    assert wait_until(lambda: kernel.value(counts) == 0, timeout=10.0), kernel.value(counts)


def test_without_an_input_box_the_breakpoint_is_skipped_with_a_warning(kernel):
    """As under nbval and in make demo's runner: no input request, no hang."""
    out = kernel.run("nbrpc.rpc_sync('worker1', f, args=(1,))", allow_stdin=False)
    assert kernel.prompts == []
    assert "[worker1] nbrpc: breakpoint() at f" in out
    assert "without an input box" in out
    assert out.rstrip().endswith("3")


def test_a_kernel_not_waiting_on_a_call_lets_the_worker_run_on(kernel):
    code = "fut = nbrpc.rpc_async('worker2', f, args=(1,))\ntime.sleep(prompts.GRACE_S + 2)"
    out = kernel.run("from nbrpc._debugger import prompts\n" + code)
    assert kernel.prompts == []
    assert "not waiting on an nbrpc call" in out
    assert kernel.value("fut.wait()") == 3


def test_pythonbreakpoint_0_is_honoured_in_the_kernel_and_on_workers(kernel):
    out = kernel.run(
        "os.environ['PYTHONBREAKPOINT'] = '0'\n"
        "print(nbrpc.rpc_sync('worker1', f, args=(1,)))\n"
        "del os.environ['PYTHONBREAKPOINT']"
    )
    assert kernel.prompts == []
    assert "skipped" not in out
    assert "3" in out
    out = kernel.run(
        "def off():\n    os.environ['PYTHONBREAKPOINT'] = '0'\n"
        "nbrpc.rpc_sync('worker2', off)\n"
        "print(nbrpc.rpc_sync('worker2', f, args=(2,)))"
    )
    assert kernel.prompts == []
    assert "skipped" not in out
    assert "5" in out
    kernel.run("def on():\n    del os.environ['PYTHONBREAKPOINT']\nnbrpc.rpc_sync('worker2', on)")


# -- scripts ---------------------------------------------------------------------------------

SCRIPT = (
    FUNCS
    + """
if __name__ == "__main__":
    nbrpc.init(n=1)
    try:
        print("RESULT", nbrpc.rpc_sync("worker1", f, args=(20,)))
        nbrpc.rpc_sync("worker1", outer, args=(1,))
    except ZeroDivisionError:
        nbrpc.post_mortem()
    finally:
        nbrpc.shutdown()
"""
)


def _pty_run(path: str, answers: list[tuple[str, str]], timeout: float = 120) -> str:
    """Run a script under a pseudo-terminal, typing each answer after its prompt."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the script, with the terminal as stdin and stdout
        os.execv(sys.executable, [sys.executable, path])
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        for prompt, line in [*answers, ("\x00end", "")]:
            start = len(seen)
            while prompt.encode() not in seen[start:] and time.monotonic() < deadline:
                ready, _, _ = select.select([fd], [], [], 0.5)
                if ready:
                    try:
                        chunk = os.read(fd, 4096)
                    except OSError:  # the script ended
                        chunk = b""
                    if not chunk:
                        return seen.decode(errors="replace")
                    seen += chunk
            if prompt.encode() not in seen[start:]:
                raise AssertionError(f"no {prompt!r} in:\n{seen.decode(errors='replace')}")
            os.write(fd, line.encode() + b"\n")
        return seen.decode(errors="replace")
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, seen.decode(errors="replace")[-3000:]


def test_a_script_with_a_terminal_debugs_its_workers(tmp_path):
    path = tmp_path / "debug_me.py"
    path.write_text(SCRIPT)
    out = _pty_run(
        str(path),
        [
            ("(Pdb worker1) ", "p y"),
            ("(Pdb worker1) ", "c"),
            ("(Pdb worker1) ", "p b"),
            ("(Pdb worker1) ", "c"),
        ],
    ).replace("\r\n", "\n")
    assert "p y\n40\n" in out
    assert "RESULT 41" in out
    assert "post-mortem on worker1: ZeroDivisionError" in out
    assert "p b\n2\n" in out


def test_a_script_without_a_terminal_skips_the_breakpoint_with_a_warning(tmp_path):
    path = tmp_path / "no_tty.py"
    path.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT 41" in done.stdout
    both = done.stdout + done.stderr
    assert "[worker1] nbrpc: breakpoint() at f" in both
    assert "stdin is not a terminal" in both
    assert "%rpc_debug cannot open pdb on worker1" in both


# -- the clock ----------------------------------------------------------------------------------


def test_the_clock_stands_still_while_paused():
    clock = deadlines.Clock()
    clock.pause()
    still = clock.now()
    time.sleep(0.2)
    assert clock.now() == still  # exactly: nothing of the pause counts
    clock.pause()  # nested: one session's pause inside another's
    clock.resume()
    time.sleep(0.1)
    assert clock.now() == still
    before = time.monotonic()
    clock.resume()
    after = time.monotonic()
    time.sleep(0.1)
    ran = time.monotonic() - after
    assert ran <= clock.now() - still <= time.monotonic() - before  # runs again


def test_deadlines_fail_late_futures_and_wait_out_a_pause():
    late, early = torch.futures.Future(), torch.futures.Future()
    deadlines.expire_after(0.2, late, lambda: TimeoutError("late"))
    deadlines.expire_after(0.2, early, lambda: TimeoutError("early"))
    early.set_result(1)
    time.sleep(0.5)
    with pytest.raises(TimeoutError, match="late"):
        late.wait()
    assert early.wait() == 1  # finished first: its deadline did nothing

    paused = torch.futures.Future()
    deadlines.clock.pause()
    try:
        deadlines.expire_after(0.2, paused, lambda: TimeoutError("paused"))
        time.sleep(0.5)
        assert not paused.done()  # the clock stands still: no deadline passes
    finally:
        deadlines.clock.resume()
    assert wait_until(paused.done, timeout=10)


def test_the_deadline_heap_drops_finished_entries():
    futures = [torch.futures.Future() for _ in range(deadlines.COMPACT_AT + 10)]
    for fut in futures:
        deadlines.expire_after(300, fut, lambda: TimeoutError("never"))
        fut.set_result(None)
    deadlines.expire_after(300, torch.futures.Future(), lambda: TimeoutError("never"))
    assert deadlines.pending() < deadlines.COMPACT_AT


def test_no_input_reason_names_the_missing_terminal(monkeypatch):
    # pytest's stdin is not a terminal: a breakpoint here could not be answered (and no
    # IPython shell counts: other tests create one in this process)
    if sys.stdin is not None and sys.stdin.isatty():
        pytest.skip("stdin is a terminal here: the no-terminal case cannot be shown")
    monkeypatch.setattr(prompts, "ipython_shell", lambda: None)
    assert "not a terminal" in prompts.no_input_reason()
    os.environ["PYTHONBREAKPOINT"] = "0"
    try:
        assert prompts.no_input_reason() == ""
    finally:
        del os.environ["PYTHONBREAKPOINT"]


def test_a_prompt_from_a_worker_is_served_by_the_waiting_main_thread(monkeypatch):
    """The kernel side alone: a prompt on another thread, input() on the main thread."""
    monkeypatch.setattr(prompts, "no_input_reason", lambda: None)
    typed = iter(["p 1", "c"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    answers = []

    def worker():
        for _ in range(2):
            answers.append(prompts.kernel_prompt("w9", "w9/1", "text\n", "(Pdb w9) ", "w9"))
        prompts.kernel_end("w9", "w9/1", "")

    done = torch.futures.Future()
    thread = threading.Thread(target=lambda: (worker(), done.set_result(None)))
    thread.start()
    assert prompts.wait_on_main_thread(done, limit=30)
    thread.join()
    assert answers == [("line", "p 1"), ("line", "c")]
    assert not deadlines.clock.paused
