"""Who may connect: a socket filter that lets the cluster's members in, and no one else.

torch RPC has no authentication, and TensorPipe aborts its process on a malformed first
message: one ``GET / HTTP/1.0`` line sent to a kernel's port ended it with
``std::bad_alloc`` (measured), and torch's own client, pointed at a worker, runs any code
there. A cluster that listens beyond loopback (``--hosts``, ``--listen``, ``--init-method
tcp://``) therefore puts a classic BPF socket filter (``SO_ATTACH_FILTER``: no privilege
needed) on every socket its processes listen on, one that passes packets from the
cluster's member addresses and drops the others. A connection attempt from another
address gets no answer (its SYN never reaches the listener), so TensorPipe, the store and
ipyparallel never read a byte of it. A connection a listener accepts inherits its filter.

* Sockets nbrpc makes itself (the membership store's, the preflight's probe) are filtered
  before they listen (:func:`fence_socket`).
* Sockets torch and ipyparallel make (TensorPipe's listeners, the controller's and its
  heart monitor's) are found in the process once they exist, from ``/proc/net/tcp*`` and
  the process's descriptors, and filtered there (:func:`fence_process`). A process of
  ours that is not this one lends the socket through ``pidfd_getfd``; the filter belongs
  to the socket, so it holds in the process that owns it.

What it cannot tell apart: users of a member host (this one included) share its address.
On a shared host, docs/security.md says what another user can do. Which addresses are
members is set once per process (:func:`admit`), before any member connects, and widened
when one joins.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from nbrpc._errors import ConfigError

SO_ATTACH_FILTER = 26  # also SO_GET_FILTER, for getsockopt
_SKF_NET_OFF = -0x100000  # loads relative to the network header (the IP header)
_SYS_PIDFD_GETFD = 438  # Linux 5.6+, every architecture's number
_LD_W, _LD_B, _RSH, _JEQ, _RET = 0x20, 0x30, 0x74, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0
_MAX_JUMP = 255  # classic BPF jumps are 8-bit: at most 28 IPv4 or 32 IPv6 members


@dataclass
class _Fence:
    """The member addresses this process admits (None: no fence, a loopback cluster)."""

    members: frozenset[str] | None = None


_fence = _Fence()


def program(members: Iterable[str]) -> bytes:
    """A classic BPF program that accepts IPv4 and IPv6 packets whose source is one of
    ``members`` (IPv4 members also as IPv4-mapped IPv6) and drops every other packet."""
    v4: list[int] = []
    v6: list[tuple[int, ...]] = []
    for member in sorted(set(members)):
        ip = ipaddress.ip_address(member)
        if ip.version == 4:
            v4.append(int(ip))
            ip = ipaddress.IPv6Address(f"::ffff:{ip}")
        v6.append(struct.unpack("!4I", ip.packed))
    # (opcode, k, label if true, label if false); a str alone is a label; None: next
    asm: list[tuple[int, int, str | None, str | None] | str] = [
        (_LD_B, _SKF_NET_OFF, None, None),  # the IP header's first byte: its version
        (_RSH, 4, None, None),
        (_JEQ, 4, None, "v6"),
        (_LD_W, _SKF_NET_OFF + 12, None, None),  # IPv4: the source address
        *[(_JEQ, word, "accept", None) for word in v4],
        (_RET, _DROP, None, None),
        "v6",
    ]
    for i, words in enumerate(v6):  # IPv6: the source address, four words
        for j, word in enumerate(words):
            asm.append((_LD_W, _SKF_NET_OFF + 8 + 4 * j, None, None))
            asm.append((_JEQ, word, "accept" if j == 3 else None, f"member{i + 1}"))
        asm.append(f"member{i + 1}")
    asm += [(_RET, _DROP, None, None), "accept", (_RET, _ACCEPT, None, None)]
    at: dict[str, int] = {}
    count = 0
    for item in asm:
        if isinstance(item, str):
            at[item] = count
        else:
            count += 1
    out = []
    for pos, item in enumerate(x for x in asm if not isinstance(x, str)):
        op, k, yes, no = item
        jt = at[yes] - pos - 1 if yes else 0
        jf = at[no] - pos - 1 if no else 0
        if not (0 <= jt <= _MAX_JUMP and 0 <= jf <= _MAX_JUMP):
            raise ConfigError(
                f"{len(v6)} member addresses are too many for the socket filter that admits a "
                "cluster's members (classic BPF jumps are 8-bit: at most 28 IPv4 or 32 IPv6 "
                "addresses). Start the cluster on fewer hosts (docs/security.md)."
            )
        out.append(struct.pack("HBBI", op, jt, jf, k & 0xFFFFFFFF))
    return b"".join(out)


def _attach(fd: int, members: frozenset[str]) -> None:
    code = program(members)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buf))
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    finally:
        sock.close()  # the duplicate only: the socket stays its owner's


def admit(members: Iterable[str] | None) -> None:
    """This process admits ``members`` (None: no fence); sockets already fenced here get
    the new list at once (a member that joins is admitted before it connects)."""
    _fence.members = None if members is None else frozenset(members)
    if _fence.members is not None:
        fence_process(os.getpid())


def members() -> frozenset[str] | None:
    return _fence.members


def fence_socket(sock: socket.socket) -> None:
    """Filter a socket nbrpc made, before it listens (nothing when there is no fence)."""
    if _fence.members is not None:
        _attach(sock.fileno(), _fence.members)


def _hex_address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def listening(pid: int) -> list[tuple[int, str, int]]:
    """``(descriptor, address, port)`` of every TCP socket process ``pid`` listens on."""
    inodes: dict[str, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    addr, port = fields[1].split(":")
                    inodes[fields[9]] = (_hex_address(addr), int(port, 16))
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{name}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    found.append((int(name), *inodes[link[8:-1]]))
    return sorted(found)


def _is_loopback(address: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).is_loopback
    return False


@contextlib.contextmanager
def _borrowed(pid: int, fd: int) -> Iterator[int]:
    """Descriptor ``fd`` of process ``pid``, as a descriptor of this one (``pidfd_getfd``)."""
    if pid == os.getpid():
        yield fd
        return
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mine = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd of process {pid}")
        try:
            yield mine
        finally:
            os.close(mine)
    finally:
        os.close(pidfd)


def fence_process(pid: int) -> list[tuple[str, int]]:
    """Filter every socket process ``pid`` (this one, or a child of ours) listens on
    beyond loopback; returns ``(address, port)`` of each. Nothing without a fence."""
    if _fence.members is None:
        return []
    done = []
    for fd, address, port in listening(pid):
        if _is_loopback(address):
            continue  # other hosts cannot reach it
        with _borrowed(pid, fd) as mine:
            _attach(mine, _fence.members)
        done.append((address, port))
    return done


def fenced(pid: int) -> dict[tuple[str, int], bool]:
    """Whether each socket process ``pid`` listens on beyond loopback has a filter."""
    out = {}
    for fd, address, port in listening(pid):
        if _is_loopback(address):
            continue
        with _borrowed(pid, fd) as mine:
            out[(address, port)] = _filter_blocks(mine) > 0
    return out


def _filter_blocks(fd: int) -> int:
    """How many instructions the socket's filter has (0: none). ``SO_GET_FILTER`` asked
    with a length of 0 answers that in the length; Python cannot ask with 0 (it turns that
    into an int query, and the kernel takes any other length as a count of blocks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    length = ctypes.c_uint(0)
    if libc.getsockopt(fd, socket.SOL_SOCKET, SO_ATTACH_FILTER, None, ctypes.byref(length)):
        raise OSError(ctypes.get_errno(), "getsockopt SO_GET_FILTER")
    return length.value
