"""The ports of the Jupyter kernels the suite starts, chosen where no other process of this
machine picks one.

jupyter_client chooses a kernel's five ports by binding port 0 and closing the socket, and
the kernel binds them a second or two later, once it has imported ipykernel. In between,
any process may be given the same port, and this suite's processes take many: each
outgoing TCP connection and each TensorPipe listener gets one from the kernel's ephemeral
range. On two test workers a kernel died once as it started: "ZMQError: Address already
in use (addr='tcp://127.0.0.1:41321')" (a fresh-clone run, 2026-11-29).

Here the ports come from below the ephemeral range (``net.ipv4.ip_local_port_range``,
32768-60999 by default), which the system never hands out by itself, in a block of its
own per test worker (``PYTEST_XDIST_WORKER``), from a random start within it. The kernels
stay on TCP, as a user's are. :func:`install` patches jupyter_client's ``LocalPortCache``,
through which every locally started kernel gets its ports (nbval's too)."""

from __future__ import annotations

import os
import random
import socket

#: the blocks: one per xdist worker (up to three), and the last for a process outside xdist
FIRST_PORT, BLOCK, BLOCKS = 20000, 3000, 4


def block() -> range:
    """This process's ports: ``gwN``'s block N, any other process the last block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else BLOCKS - 1
    start = FIRST_PORT + (index % BLOCKS) * BLOCK
    return range(start, start + BLOCK)


def free_port(ip: str, taken: set[int]) -> int:
    """A port of this process's block that binds on ``ip`` now and is not in ``taken``."""
    ports = block()
    offset = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(offset + i) % len(ports)]
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((ip, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free port in {ports} for a kernel")


def install() -> None:
    """Have every kernel this process starts take its ports from :func:`block`."""
    from jupyter_client.connect import LocalPortCache

    def find_available_port(self: LocalPortCache, ip: str) -> int:
        return free_port(ip, self.currently_used_ports)

    LocalPortCache.find_available_port = find_available_port  # type: ignore[method-assign]
