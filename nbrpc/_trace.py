"""The backward pass that crossed the workers, as plain data.

torch's distributed autograd keeps, per context and per worker, the functions that sent
and received gradient-carrying tensors (``_send_functions()`` / ``_recv_functions()``,
keyed by the *sender's* autograd message id ``worker_id << 48 | n``). From those, plus the
caller's roots, each worker's local backward graph is reached through ``next_functions``.
A backward hop goes from a ``RecvRpcBackward`` on the worker that received message ``m``
to the ``SendRpcBackward`` with the same ``m`` on worker ``m >> 48``.

``trace_backward(context_id)`` asks every worker that took part (found breadth-first from
the caller through each context's ``_known_worker_ids()``) for its local graph and joins
them::

    {"context_id": 3,
     "workers": [{"name": "worker1", "id": 1, "host": "...", "timing": {...} | None}, ...],
     "nodes": [{"id": "worker1/0", "worker": "worker1", "name": "TanhBackward0",
                "kind": "send" | "recv" | "root" | "function" | "accumulate",
                "message_id": int | None, "is_root": bool, "start_s", "duration_s"}, ...],
     "edges": [{"src": "worker1/0", "dst": "worker1/1", "kind": "local" | "rpc",
                "message_id": int | None}, ...]}

Edges point the way gradients flow. Timing is present where it was measured: when the
backward ran through ``nbrpc.autograd.backward(..., timed=True)``, hooks on every node of
every worker recorded when each ran (``time.monotonic``, comparable across processes of
one host).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed.rpc as rpc

from . import _torch
from ._rows import Trace, TraceEdge, TraceNode, TraceWorker

_SEND = "torch::distributed::autograd::SendRpcBackward"
_RECV = "torch::distributed::autograd::RecvRpcBackward"
_ACCUMULATE = "torch::autograd::AccumulateGrad"

_lock = threading.Lock()
_roots: dict[int, list] = {}  # context id -> grad_fns of the roots given to backward here
_timings: dict[int, dict[int, list[float]]] = {}  # context id -> id(node) -> [start, end]
#: context id -> what this process sent by RPC inside it (:func:`note_call`)
_sent: dict[int, list[tuple]] = {}
_SCALARS = (type(None), bool, int, float, str)
_KEEP_CONTEXTS = 64


def _short(name: str) -> str:
    return name.rsplit("::", 1)[-1]


def _bounded(store: dict, key: int, value: Any) -> None:
    store[key] = value
    while len(store) > _KEEP_CONTEXTS:
        store.pop(next(iter(store)))


def remember_roots(context_id: int, roots: list) -> None:
    """Called by ``nbrpc.autograd.backward``: the caller's roots, for the trace."""
    fns = [r.grad_fn for r in roots if getattr(r, "grad_fn", None) is not None]
    with _lock:
        _bounded(_roots, context_id, fns)


def note_call(dest: int, func: Any, args: tuple, kwargs: dict | None) -> None:
    """A call to worker ``dest`` leaves this process (the facade tells): inside a
    distributed autograd context, what it was, for :func:`local_shape`. The function is
    kept by identity (a notebook cell run again makes another), RRefs too, numbers and
    strings by value; tensors by their place only (their graph is the shape's)."""
    if not _torch.in_autograd_context():
        return
    context_id = _torch.current_autograd_context_id()
    call = (dest, _Same(func), _fingerprint(args, 0), _fingerprint(kwargs or {}, 0))
    with _lock:
        sent = _sent.get(context_id)
        if sent is None:
            _bounded(_sent, context_id, [call])
        else:
            sent.append(call)


def _fingerprint(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return "tensor"
    if kind in (tuple, list) and depth < 2 and len(value) <= 16:
        return tuple(_fingerprint(v, depth + 1) for v in value)
    if kind is dict and depth < 2 and len(value) <= 16:
        return tuple((k, _fingerprint(v, depth + 1)) for k, v in value.items())
    if isinstance(value, rpc.RRef):
        return _Same(value)
    return kind.__qualname__


class _Same:
    """An object in a shape, equal to the same object only; kept alive with the shape,
    so that its id is not another's (a cell run again frees the old function)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _walk(context_id: int) -> tuple[list, dict[int, int], list[tuple[int, int]], dict]:
    """This worker's backward graph for the context: nodes in a stable order, edges."""
    sends, recvs = _torch.autograd_messages(context_id)
    message_of = {id(fn): ("send", mid) for mid, fn in sends.items()}
    message_of.update({id(fn): ("recv", mid) for mid, fn in recvs.items()})
    with _lock:
        roots = list(_roots.get(context_id, []))
    starts = roots + [sends[m] for m in sorted(sends)] + [recvs[m] for m in sorted(recvs)]
    nodes: list = []
    index: dict[int, int] = {}
    edges: list[tuple[int, int]] = []
    queue: deque[Any] = deque()
    for fn in starts:
        if id(fn) not in index:
            index[id(fn)] = len(nodes)
            nodes.append(fn)
            queue.append(fn)
    while queue:
        fn = queue.popleft()
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            if id(nxt) not in index:
                index[id(nxt)] = len(nodes)
                nodes.append(nxt)
                queue.append(nxt)
            edges.append((index[id(fn)], index[id(nxt)]))
    root_ids = {id(fn) for fn in roots}
    kinds: dict[int, tuple[str, int | None]] = {}
    for fn in nodes:
        if id(fn) in message_of:
            kinds[id(fn)] = message_of[id(fn)]
        elif id(fn) in root_ids:
            kinds[id(fn)] = ("root", None)
        elif fn.name() == _ACCUMULATE:
            kinds[id(fn)] = ("accumulate", None)
        else:
            kinds[id(fn)] = ("function", None)
    return nodes, index, edges, kinds


def local_graph(context_id: int) -> dict[str, Any]:
    """Runs on each worker (by RPC): its part of the trace, ids local to it."""
    me = rpc.get_worker_info()
    nodes, _index, edges, kinds = _walk(context_id)
    with _lock:
        times = _timings.get(context_id, {})
        roots = {id(fn) for fn in _roots.get(context_id, [])}
    out_nodes = []
    for i, fn in enumerate(nodes):
        kind, mid = kinds[id(fn)]
        node: dict[str, Any] = {
            "id": f"{me.name}/{i}",
            "worker": me.name,
            "name": _short(fn.name()),
            "kind": kind,
            "message_id": mid,
            "is_root": id(fn) in roots,
        }
        span = times.get(id(fn))
        if span and len(span) == 2:
            node["start_s"], node["duration_s"] = span[0], span[1] - span[0]
        out_nodes.append(node)
    spans = [n["start_s"] for n in out_nodes if "start_s" in n]
    ends = [n["start_s"] + n["duration_s"] for n in out_nodes if "start_s" in n]
    timing = None
    if spans:
        timing = {
            "first_start_s": min(spans),
            "last_end_s": max(ends),
            "busy_s": sum(n["duration_s"] for n in out_nodes if "duration_s" in n),
        }
    return {
        "worker": {"name": me.name, "id": me.id, "host": socket.gethostname(), "timing": timing},
        "nodes": out_nodes,
        "edges": [
            {"src": f"{me.name}/{a}", "dst": f"{me.name}/{b}", "kind": "local", "message_id": None}
            for a, b in edges
        ],
        "known": _torch.autograd_known_workers(context_id),
    }


def local_shape(context_id: int) -> tuple:
    """This process's part of the backward graph as a hashable shape, found without any
    RPC: each node's function, kind and (for a message) the worker that sent it, the
    edges, the workers the context reached, and the calls it sent (:func:`note_call`:
    to whom, which function, its arguments but tensors). Two passes of one training loop
    have the same shape; message ids and tensor values do not enter it."""
    nodes, _index, edges, kinds = _walk(context_id)
    described = []
    for fn in nodes:
        kind, mid = kinds[id(fn)]
        described.append((fn.name(), kind, None if mid is None else mid >> 48))
    known = tuple(sorted(_torch.autograd_known_workers(context_id)))
    with _lock:
        sent = tuple(_sent.get(context_id, ()))
    return tuple(described), tuple(edges), known, sent


def instrument(context_id: int) -> list[int]:
    """Runs on each worker before backward: hooks that time every node. Returns peers."""
    nodes, _index, _edges, _kinds = _walk(context_id)
    spans: dict[int, list[float]] = {}
    with _lock:
        _bounded(_timings, context_id, spans)
    for fn in nodes:
        key = id(fn)

        def pre(grad_outputs, key=key):
            spans[key] = [time.monotonic()]

        def post(grad_inputs, grad_outputs, key=key):
            spans.setdefault(key, [time.monotonic()]).append(time.monotonic())

        fn.register_prehook(pre)
        fn.register_hook(post)
    return _torch.autograd_known_workers(context_id)


def never_reached(trace: Trace) -> list[TraceNode]:
    """Send functions that would never get a gradient from a backward from the roots.

    torch's FAST-mode engine waits for a gradient at every ``SendRpcBackward`` of the
    context, so if one is never reached the backward pass waits forever. Gradients start
    at the roots, flow along local edges, and a ``RecvRpcBackward`` that is reached
    passes them to its partner ``SendRpcBackward`` on the sending worker.
    """
    local: dict[str, list[str]] = {}
    hop: dict[str, str] = {}
    for e in trace["edges"]:
        if e["kind"] == "local":
            local.setdefault(e["src"], []).append(e["dst"])
        else:
            hop[e["src"]] = e["dst"]
    reached = {n["id"] for n in trace["nodes"] if n["is_root"]}
    stack = list(reached)
    while stack:
        node = stack.pop()
        for nxt in local.get(node, []) + ([hop[node]] if node in hop else []):
            if nxt not in reached:
                reached.add(nxt)
                stack.append(nxt)
    return [n for n in trace["nodes"] if n["kind"] == "send" and n["id"] not in reached]


def _names_by_id() -> dict[int, str]:
    return {w.id: w.name for w in _torch.agent().get_worker_infos()}


def _on_each_worker(context_id: int, func: Any) -> dict[int, Any]:
    """Run ``func(context_id)`` on every worker that took part, breadth-first from here."""
    me = rpc.get_worker_info()
    names = _names_by_id()
    results: dict[int, Any] = {}
    frontier = [me.id]
    while frontier:
        futures = {}
        for wid in frontier:
            if wid == me.id:
                results[wid] = func(context_id)
            else:
                futures[wid] = _torch.rpc_async(names[wid], func, args=(context_id,))
        for wid, fut in futures.items():
            results[wid] = fut.wait()
        peers: set[int] = set()
        for wid in frontier:
            known = results[wid]["known"] if isinstance(results[wid], dict) else results[wid]
            peers.update(k for k in known if k not in results and k in names)
        frontier = sorted(peers)
    return results


def instrument_all(context_id: int) -> None:
    _on_each_worker(context_id, instrument)


def trace_backward(context_id: int) -> Trace:
    """The cross-worker backward graph of ``context_id`` (call it inside the context)."""
    parts = _on_each_worker(context_id, local_graph)
    nodes: list[TraceNode] = []
    edges: list[TraceEdge] = []
    workers: list[TraceWorker] = []
    send_node: dict[int, str] = {}
    for wid in sorted(parts):
        part = parts[wid]
        workers.append(part["worker"])
        nodes.extend(part["nodes"])
        edges.extend(part["edges"])
        for node in part["nodes"]:
            if node["kind"] == "send":
                send_node[node["message_id"]] = node["id"]
    for node in nodes:
        if node["kind"] == "recv" and node["message_id"] in send_node:
            edges.append(
                {
                    "src": node["id"],
                    "dst": send_node[node["message_id"]],
                    "kind": "rpc",
                    "message_id": node["message_id"],
                }
            )
    return {"context_id": context_id, "workers": workers, "nodes": nodes, "edges": edges}
