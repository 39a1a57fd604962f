"""Membership of one process in nbrpc's torch RPC group.

Why a *dynamic* group (``init_rpc(world_size=None)``): notebook users shut a cluster down
and start another in the same kernel, and torch cannot run ``init_rpc`` twice in one
process. Measured on torch 2.13: after a first ``shutdown`` the C++ ``RRefContext``
singleton stays marked destroyed and bound to the first agent, so RRef deletions from the
second agent are silently dropped and the next graceful shutdown waits on owners forever.

So the kernel joins once, as rank 0, and its agent lives as long as the kernel. Each
``%rpc_init`` brings fresh worker processes that join the group with fresh ranks (names
such as ``worker1`` are reused; a rank never is, because an agent caches its pipes by
rank) and each ``%rpc_shutdown`` makes them leave. torch handles joins and leaves,
RRef reference counting and distributed autograd as usual.

The store that torch uses for membership is created here and handed to ``init_rpc``
through a rendezvous handler for the ``nbrpc://`` scheme: a ``FileStore`` in a private
directory for a cluster on this host (no socket at all), or a ``TCPStore`` for groups
that span hosts, which the user asks for explicitly. Where the group's sockets listen and
what TensorPipe carries bytes with (its transports and channels) are :mod:`nbrpc._network`'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import _devices, _fence, _ledger, _network, _process, _torch
from ._errors import BootError, ConfigError, NotInitializedError
from ._wire import lanes

SCHEME = "nbrpc"


@dataclass
class _Membership:
    """This process's place in the group: the name it joined as (torch allows one join),
    the kernel's membership (kept for the kernel's lifetime), whether a cluster is up for
    calls, and the store handed to torch's next rendezvous."""

    joined: str | None = None
    cuda: tuple[str, ...] = ()  # the CUDA devices it uses (local_cuda_devices, lent)
    replies: dict[str, dict[str, str]] = field(default_factory=dict)  # hold_devices's
    kernel: KernelMembership | None = None
    active: bool = False
    handed: list[dist.Store] = field(default_factory=list)
    handed_lock: threading.Lock = field(default_factory=threading.Lock)


_membership = _Membership()


def _rendezvous(url: str, **kwargs) -> Iterator[tuple[dist.Store, int, int]]:
    yield (_membership.handed.pop(), 0, 0)


def set_active(active: bool) -> None:
    """A cluster is up (calls may go out) or not: set as its state changes."""
    _membership.active = active


def require_active(what: str) -> None:
    """Raise :class:`~nbrpc.NotInitializedError` naming ``what`` unless a cluster is up."""
    if not _membership.active:
        raise NotInitializedError(what)


with contextlib.suppress(RuntimeError):  # already registered by an earlier import
    dist.register_rendezvous_handler(SCHEME, _rendezvous)


@dataclass(frozen=True)
class StoreSpec:
    """Where the group's membership store lives; plain data so it ships to workers."""

    kind: str  # "file" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0
    listen: str = ""  # --listen ADDR: the kernel's address that other hosts reach

    def open(self, *, is_master: bool, timeout_s: float) -> dist.Store:
        if self.kind == "file":
            return dist.FileStore(self.path, -1)
        fd = _bound_socket(self.host, self.port) if is_master else None
        return dist.TCPStore(
            self.host,
            self.port,
            is_master=is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )

    @property
    def loopback_only(self) -> bool:
        if self.listen:
            return self.listen in _network.LOOPBACK
        return self.kind == "file" or self.host in _network.LOOPBACK

    def interface(self) -> str | None:
        """The interface this process's group sockets listen on (TensorPipe's, gloo's):
        loopback for a local cluster, else the one routed towards the kernel's listen
        address (None: the library's own choice)."""
        if self.loopback_only:
            return _network.loopback_ifname()
        return _network.interface_toward(self.listen) if self.listen else None

    def to_dict(self) -> dict:
        return asdict(self)


def _bound_socket(host: str, port: int) -> int:
    """A listening socket on ``host`` alone, for torch's TCPStore (``master_listen_fd``).

    Given a host name, torch's store listens on every interface of the machine; bound
    here first, it listens on that one address (``--listen``) and nowhere else.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        _fence.fence_socket(sock)  # members only, from its first SYN (see nbrpc._fence)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise BootError(f"the RPC store cannot listen on {host}:{port}: {exc}") from exc
    return sock.detach()  # the store owns it now


def listen_of_init_method(init_method: str) -> str | None:
    """The address the kernel listens on for ``tcp://HOST:PORT`` (None: loopback only).

    The kernel runs the store, so HOST is one of this host's addresses; TensorPipe and the
    controller listen there too. Without this, TensorPipe would listen wherever the host's
    name resolves, which a stock Debian ``/etc/hosts`` makes 127.0.1.1: workers on other
    hosts then joined the store and failed to reach the kernel (``ECONNREFUSED``).
    """
    spec = spec_from_init_method(init_method)
    if spec.kind != "tcp" or _network.is_loopback(spec.host):
        return None
    if spec.host in ("0.0.0.0", "::"):
        raise ConfigError(
            f"--init-method {init_method}: a wildcard address cannot be told to workers. "
            "Give the address of this host that the workers reach (or use --listen ADDR)."
        )
    try:
        address = str(socket.getaddrinfo(spec.host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError as exc:
        raise ConfigError(
            f"--init-method {init_method}: cannot resolve {spec.host}: {exc}"
        ) from exc
    if _network.is_loopback(address):
        return None
    _network.interface_for(address)  # the kernel runs the store: the address must be this host's
    return address


def local_cuda_devices(device_maps: dict | None, devices: list | None) -> tuple[str, ...]:
    """This process's CUDA devices in its RPC options: those it names, and the sources of
    its maps (where its CUDA tensors leave from and replies land)."""
    named = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in devices or ()}
    named.update(str(src) for mapping in (device_maps or {}).values() for src in mapping)
    return tuple(sorted(d for d in named if d.startswith("cuda")))


def cuda_devices() -> tuple[str, ...]:
    """The CUDA devices this process joined the group with (none: CPU tensors only)."""
    return _membership.cuda


def uses_cuda(device_maps: dict | None, devices: list | None) -> bool:
    """Whether this process's RPC options move CUDA tensors (maps, or a CUDA device)."""
    return bool(local_cuda_devices(device_maps, devices))


def join(
    name: str,
    rank: int,
    spec: StoreSpec,
    *,
    rpc_timeout: float,
    num_worker_threads: int,
    device_maps: dict | None = None,
    devices: list | None = None,
    store: dist.Store | None = None,
    transport_names: list[str] | None = None,
    withhold: bool = False,
) -> None:
    """``init_rpc`` this process into the group described by ``spec``.

    ``store``: one already opened (the kernel opens a TCP store first to learn its port).
    ``transport_names``: TensorPipe's transports (:func:`nbrpc._network.transports_for`;
    None: :func:`nbrpc._network.transports`); this process's own
    ``NBRPC_TENSORPIPE_TRANSPORTS`` wins.
    ``withhold``: join with ``device_maps`` (and CUDA's channels) but no device in use and
    CUDA not brought up, until :func:`lend_devices` (the kernel's first join on a GPU host
    for a CPU cluster: :mod:`nbrpc._kernel_devices`).
    """
    if _membership.joined is not None:
        raise BootError(
            f"this process already joined an RPC group as {_membership.joined!r}; torch RPC "
            "cannot join twice from one process. Restart it (for attached ipyparallel "
            "engines: restart the engines) and attach again."
        )
    if uses_cuda(device_maps, devices) and not withhold:
        # A dynamic group (world_size=None) skips the step of a static init_rpc that brings
        # CUDA up, and the first CUDA tensor TensorPipe hands a process that has not used
        # CUDA yet aborts it in C++ (measured on an H100 with torch 2.11: "Allocator not
        # initialized for device", the worker gone, no Python error). Bring it up first.
        torch.cuda.init()
    options = _torch.tensorpipe_options(
        _network.transports(transport_names),
        _network.channels(uses_cuda(device_maps, devices), not spec.loopback_only),
        init_method=f"{SCHEME}://group",
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps or {},
        devices=devices or None,
    )
    with _membership.handed_lock:
        if store is None:
            store = spec.open(is_master=(rank == 0), timeout_s=rpc_timeout)
        _membership.handed.append(store)
        withheld = _torch.devices_withheld() if withhold else contextlib.nullcontext()
        with _network.tensorpipe_interface(spec.interface()), withheld:
            rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)
    _membership.joined = name
    lend_devices(() if withhold else local_cuda_devices(device_maps, devices), device_maps)


def lend_devices(devices: tuple[str, ...], maps: dict | None, agent: bool = False) -> None:
    """The CUDA devices this process uses now, and its maps (small CUDA tensors to these
    peers are staged on lanes). ``agent``: its agent keeps exactly these devices and drops
    every reply map (:func:`nbrpc._torch.hold_devices`; the kernel, before a cluster's
    workers join: :mod:`nbrpc._kernel_devices`), CUDA brought up first if they need it."""
    if agent and devices and not torch.cuda.is_initialized():
        torch.cuda.init()  # before the agent takes CUDA streams for a message it reads
    _membership.cuda = tuple(devices)
    if agent:
        _hold({})
    lanes.place_by(maps if devices else {})


def hold_devices(replies: dict[str, dict[str, str]]) -> None:
    """This process's CUDA devices (those it joined with) and reply maps, back in its agent
    where torch's dynamic group dropped them (:func:`nbrpc._torch.hold_devices`); run in
    each process by :func:`nbrpc._setup.device_replies`."""
    if _membership.cuda or replies:
        _hold(replies)


def _hold(replies: dict[str, dict[str, str]]) -> None:
    """The agent keeps exactly this process's devices and the reply maps ``replies``,
    remembered for :func:`forget_peer`."""
    _torch.hold_devices(list(_membership.cuda), replies)
    _membership.replies = dict(replies)


def forget_peer(info: Any) -> None:
    """``info`` left the group, in this process, which keeps its devices and its reply
    maps to the others: torch's leave message drops them all, and a CUDA tensor a peer
    then sends here finds no stream where TensorPipe reads it, which ends the process."""
    _torch.forget_locally(info, *_kept_through_leave(info))


def _kept_through_leave(info: Any) -> tuple[list[str], dict[str, dict[str, str]]]:
    """What this process keeps when ``info`` leaves: its devices, its other reply maps
    (torch's own leave message too: :func:`nbrpc._torch.keep_through_leaves`)."""
    replies = {peer: m for peer, m in _membership.replies.items() if peer != info.name}
    return list(_membership.cuda), replies


_torch.keep_through_leaves(_kept_through_leave)


def release_user_rrefs(timeout_s: float) -> None:
    """Delete this process's user RRefs (telling their owners) before peers leave, then
    wait up to ``timeout_s`` for the forks of the RRefs it owns to be deleted.

    torch's static-group shutdown does this in every process at once; its dynamic leave
    does not. nbrpc's graceful shutdown runs it in the kernel and every live worker at
    once (``_lifecycle.leave``): an owner waits for its users' deletions, so run
    in one process alone it waited its whole bound for an RRef a worker still held
    (measured: 5 s). Without it the kernel's RRefs to departed workers would log C++
    errors when garbage-collected. The handles the ledger holds until their creation
    settles are let go here, on this thread (``nbrpc._ledger`` says why): the settled ones
    first, the rest once torch has waited for their owners.
    """
    _ledger.let_go_settled()
    try:
        _torch.delete_user_rrefs(timeout_s)
    finally:
        _ledger.let_go_settled(everything=True)


def joined_name() -> str | None:
    """The name this process joined the group as (None: it has not joined)."""
    return _membership.joined


def leave(timeout: float = 0) -> None:
    """Leave the group gracefully (torch's own dynamic-group shutdown)."""
    _torch.leave_group(timeout)


def member_names() -> list[str]:
    """Names of every process now in the group, this one included (rank order)."""
    infos = _torch.agent().get_worker_infos()
    return [w.name for w in sorted(infos, key=lambda w: w.id)]


class KernelMembership:
    """The kernel's one membership, kept for the kernel's lifetime (see module doc)."""

    def __init__(
        self, name: str, spec: StoreSpec, owned_dir: str | None, device_maps: dict | None = None
    ) -> None:
        self.name = name
        self.spec = spec
        self.device_maps = device_maps or {}  # fixed with the kernel's agent
        self._owned_dir = owned_dir
        self._next_rank = 1
        self._lock = threading.Lock()

    def allocate_ranks(self, n: int) -> list[int]:
        with self._lock:
            ranks = list(range(self._next_rank, self._next_rank + n))
            self._next_rank += n
            return ranks

    def close(self) -> None:
        """At interpreter exit: leave (alone by then, so at once) and remove the store."""
        with contextlib.suppress(Exception):
            if _torch.agent_is_set():
                _torch.leave_group()
        if self._owned_dir:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def check_kernel_name(name: str) -> None:
    """Refuse a new name for a kernel that joined already: torch fixes it for the process."""
    member = _membership.kernel
    if member is not None and name != member.name:
        raise ConfigError(
            f"this kernel joined torch RPC as {member.name!r} and torch fixes a "
            f"process's name for its lifetime, so --self {name} needs a kernel restart. "
            f"Without --self, %rpc_init keeps {member.name!r}."
        )


def kernel_membership(
    name: str,
    *,
    init_method: str | None,
    rpc_timeout: float,
    num_worker_threads: int,
    listen: str | None = None,
    device_maps: dict | None = None,
    devices: list[str] | None = None,
    files: str = "nbrpc",
    transport_names: list[str] | None = None,
    withhold: bool = False,
) -> KernelMembership:
    """Join the kernel to the group on first use; later calls return the same membership.

    ``files``: the name prefix of the store's directory (the watchdog removes the
    kernel's, by its prefix, if the kernel dies).

    What cannot change after the first join (torch fixes it for the process) is checked,
    and a change is refused with a message that says so: a later cluster's
    ``device_maps`` must each be one the first join fixed. ``withhold``: see :func:`join`.
    """
    if _membership.kernel is not None:
        member = _membership.kernel
        check_kernel_name(name)
        asked = device_maps or {}
        if unfixed := _devices.unfixed(member.device_maps, asked):
            raise ConfigError(
                f"this kernel's device maps to {', '.join(unfixed)} are "
                f"{ {d: member.device_maps.get(d) for d in unfixed} }; torch fixes a "
                "process's device maps when it joins, so other maps "
                f"({ {d: asked[d] for d in unfixed} }) need a kernel restart. Start GPU "
                "clusters with maps it has (--gpus auto with the default names, on this "
                "host), or restart the kernel."
            )
        if (listen or "") != member.spec.listen:
            now = f"--listen {member.spec.listen}" if member.spec.listen else "loopback only"
            raise ConfigError(
                f"this kernel's RPC endpoint already listens {now}; torch fixes where a "
                "process listens for its lifetime, so a different --listen needs a kernel "
                "restart."
            )
        if init_method and not _same_rendezvous(spec_from_init_method(init_method), member.spec):
            raise ConfigError(
                f"this kernel's RPC group already uses {describe(member.spec)}; torch "
                "fixes the rendezvous for the process's lifetime, so a different "
                "--init-method needs a kernel restart."
            )
        _torch.set_rpc_timeout(rpc_timeout)
        return member
    _process.raise_open_file_limit()
    owned_dir = None
    store = None
    if listen:
        _network.interface_for(listen)  # refuse an address this host does not have, before binding
        init_method = init_method or f"tcp://{listen}:0"  # other hosts cannot see a file
    if init_method:
        spec = spec_from_init_method(init_method)
        if spec.kind == "tcp":  # the store binds first; port 0 lets it pick a free port
            store = spec.open(is_master=True, timeout_s=rpc_timeout)
            spec = StoreSpec(kind="tcp", host=spec.host, port=store.port)  # type: ignore[attr-defined]
        if listen:
            spec = replace(spec, listen=listen)
    else:
        owned_dir = tempfile.mkdtemp(prefix=f"{files}-")  # mode 0700: this user only
        spec = StoreSpec(kind="file", path=os.path.join(owned_dir, "store"))
    join(
        name,
        0,
        spec,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps,
        devices=devices,
        store=store,
        transport_names=transport_names,
        withhold=withhold,
    )
    member = KernelMembership(name, spec, owned_dir, device_maps)
    _membership.kernel = member
    return member


def current_kernel_membership() -> KernelMembership | None:
    return _membership.kernel


def spec_from_init_method(init_method: str) -> StoreSpec:
    url = urlparse(init_method)
    if url.scheme == "tcp" and url.hostname and url.port is not None:
        return StoreSpec(kind="tcp", host=url.hostname, port=url.port)
    if url.scheme == "file" and url.path:
        return StoreSpec(kind="file", path=url.path)
    raise ConfigError(
        f"unsupported --init-method {init_method!r}: use tcp://HOST:PORT (workers on other "
        "hosts connect there) or file:///shared/path (a file every worker can open)."
    )


def _same_rendezvous(asked: StoreSpec, actual: StoreSpec) -> bool:
    actual = replace(actual, listen="")
    if asked.kind == "tcp" and asked.port == 0:  # "any port" matches the one picked
        return actual.kind == "tcp" and asked.host == actual.host
    return asked == actual


def describe(spec: StoreSpec) -> str:
    if spec.kind == "file":
        return f"a file store ({spec.path})"
    return f"a TCP store at {spec.host}:{spec.port}"
