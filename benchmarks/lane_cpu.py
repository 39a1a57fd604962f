"""The CPU a small call costs on each side, not only its wall time (``make bench``).

A lane's small call is mostly nbrpc's Python work, while torch's is mostly C++, so the
ratio of their wall times moves with the machine's CPU. Two figures hold that work:

* **per call, per side**: the CPU time, over ``n`` calls of a notebook-defined echo of a
  1-element tensor to worker1, of the kernel's main thread (``time.thread_time``), the
  kernel's whole process, the worker's lane thread (the connection's thread that runs a
  main-thread call) and the worker's whole process (per-thread ``schedstat`` from
  ``/proc``, which counts every thread's time on a CPU in ns). torch RPC's call, in the
  same processes, is measured the same way (its RPC threads in place of the lane's).
* **by step**: each step of the same call timed alone, many times over, on the side that
  runs it: the caller's route checks, pickling of the call (of which its tensor and
  header), the send, the reply's unpickling; the callee's unpickling of the call, the
  run (``run_function``: output, stack labels, failures, counts) and the reply's pickling.
  The steps do not add up to the per-side figure exactly: that one also holds the
  wake-ups, the socket calls' kernel time and the GIL's hand-overs.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import timeit
from typing import Any

import torch

import nbrpc
from nbrpc import _torch
from nbrpc._wire import lanes, recording
from nbrpc._wire.callee import run_function
from nbrpc._wire.lanes import caller, messages

#: torch's own rpc_sync (nbrpc routes torch's spelling to its own calls in its processes)
TORCH_SYNC = _torch.rpc_sync


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns of every thread of this process, by name (threads of one name summed; a
    thread Python does not know, such as torch's C++ pool, under ``"native"``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        name = names.get(int(tid), "native")
        if name.startswith("nbrpc-lane") and name != "nbrpc-lanes":
            name = "nbrpc-lane"  # a connection's thread, whatever it serves
        out[name] = out.get(name, 0) + ns
    return out


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def per_side(call: Any, n: int, worker: str = "worker1") -> dict[str, float]:
    """µs of CPU per call of ``call()``: the kernel's main thread and process, the
    worker's lane thread and process (asked through torch before and after)."""
    for _ in range(50):
        call()
    worker_before = TORCH_SYNC(worker, thread_cpu_ns)
    kernel_before = thread_cpu_ns()
    main_before = time.thread_time_ns()
    for _ in range(n):
        call()
    main_after = time.thread_time_ns()
    kernel = _spent(kernel_before, thread_cpu_ns())
    worker_spent = _spent(worker_before, TORCH_SYNC(worker, thread_cpu_ns))
    # the asking itself runs on torch's threads there: "native" holds it, a few calls' worth
    return {
        "kernel main thread": (main_after - main_before) / n / 1e3,
        "kernel process": sum(kernel.values()) / n / 1e3,
        "worker lane thread": worker_spent.get("nbrpc-lane", 0) / n / 1e3,
        "worker process": sum(worker_spent.values()) / n / 1e3,
    }


def _us(stmt: Any, number: int) -> float:
    """Median µs of one ``stmt()`` over 5 rounds of ``number``."""
    rounds = sorted(timeit.repeat(stmt, number=number, repeat=5))
    return rounds[2] / number * 1e6


def callee_steps(payload: bytes, number: int) -> dict[str, float]:
    """On the callee (sent there through torch): µs of each of its steps of one call
    whose lane ``payload`` the caller made, as :func:`nbrpc._wire.lanes.callee.run` does them."""
    func, args, kwargs, header, _ = messages.lane_call_of(payload)

    def run() -> Any:
        udf = _torch.PythonUDF(func, args, kwargs)
        if header is not None:
            udf = recording.arrived(header, udf)
        result = run_function(udf)
        recording.reply_row(result)
        return result

    result = run()
    return {
        "callee: unpickle the call": _us(lambda: messages.lane_call_of(payload), number),
        "callee: run it (run_function)": _us(run, number),
        "callee: pickle the reply": _us(lambda: messages.lane_dumps(result), number),
    }


def by_step(
    func: Any, args: tuple, number: int = 2000, worker: str = "worker1"
) -> dict[str, float]:
    """µs of each step of one lane call of ``func(*args)`` to ``worker``, each on the
    side that runs it."""
    dest = nbrpc.get_worker_info(worker)
    payload = caller.call_bytes(func, args, {})
    tensor = args[0]
    reply = messages.lane_dumps(tensor)
    reducer = messages.lane_reducers(False)[torch.Tensor]

    def reduce_tensor(t: torch.Tensor) -> Any:
        messages.lane_message()  # a new message: the tensor is not counted twice
        return reducer(t)

    left, right = socket.socketpair()
    try:
        frame = b"x" * (len(payload) + 13)

        def send() -> None:
            left.sendall(frame)
            right.recv(1 << 16)

        steps = {
            "caller: route checks": _us(lambda: caller.why_not(dest, func), number),
            "caller: pickle the call": _us(lambda: caller.call_bytes(func, args, {}), number),
            "caller:   of which the tensor": _us(lambda: reduce_tensor(tensor), number),
            "caller:   of which the header": _us(
                lambda: recording.header_for("kernel", False, True), number
            ),
            "caller: send and read a frame (socketpair)": _us(send, number),
            "caller: unpickle the reply": _us(lambda: pickle.loads(reply), number),
        }
    finally:
        left.close()
        right.close()
    steps.update(TORCH_SYNC(worker, callee_steps, args=(payload, number)))
    return steps


def measure(n: int, nb_echo: Any, tiny: torch.Tensor) -> dict[str, Any]:
    """Both figures for a notebook echo of ``tiny`` on its lane, and torch's call of the
    importable echo in the same processes."""
    from benchmarks.peers import echo

    lanes.pause(False)
    return {
        "nbrpc, lane": per_side(lambda: nbrpc.rpc_sync("worker1", nb_echo, args=(tiny,)), n),
        "torch rpc": per_side(lambda: TORCH_SYNC("worker1", echo, args=(tiny,)), n),
        "steps": by_step(nb_echo, (tiny,)),
    }


def report(cpu: dict[str, Any]) -> None:
    sides = list(cpu["nbrpc, lane"])
    print("CPU per small call, µs        " + "".join(f"{s:>20}" for s in sides))
    for peer in ("nbrpc, lane", "torch rpc"):
        print(f"  {peer:<28}" + "".join(f"{cpu[peer][s]:20.1f}" for s in sides))
    print("  a lane call's steps, each alone (µs; wake-ups and kernel time not included):")
    for step, us in cpu["steps"].items():
        print(f"    {step:<44}{us:7.1f}")
