"""Notebook functions a lane sends call after call: pickled once, kept by the callee.

A notebook function travels by value: every call pickles its code, name, globals and
the rest with cloudpickle (about 20 µs for a one-line function here), and the callee
rebuilds it (about 10 µs). That was most of a small call's cost on a lane
(:mod:`nbrpc._wire.lanes`). Most functions called in a loop do not change between
calls, and neither do the globals they read, so a lane sends such a function as the
pickle made at its first call, with a key; the callee keeps the function it made under
that key and rebuilds nothing on later calls.

What keeps the behaviour of a fresh pickle:

* The pickle is made again when anything it holds changed: the function's code, name,
  defaults, or the value of a global it reads (its *fingerprint*). Only functions whose
  fingerprint can be told exactly are kept: no closure, no attributes of their own, and
  globals, defaults and keyword defaults that are numbers, strings, bytes, None, tuples
  of these, modules, or classes and functions importable by reference. Anything else
  (a list, a tensor, another notebook function or class, a lock) is pickled fresh on
  every call, as before.
* The globals it reads still arrive with every call
  (:func:`nbrpc._wire.namespace.arrive`): a worker's namespace gets the caller's values
  as with a fresh pickle, also where two callers send the same name.
* Registering a module by value (``nbrpc.register_by_value``) makes every pickle again.

The callee keeps :data:`_KEEP` functions (least recently used go first); a caller sends
the pickle with every call, so a callee that lost one (or a new process after a restart)
makes it again from the pickle.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import threading
import weakref
from collections.abc import Callable
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

import cloudpickle

from nbrpc import _process

from . import namespace

_ATOMS = frozenset({type(None), bool, int, str, bytes, type(Ellipsis)})
#: numbers told apart by their repr: 0.0 == -0.0, and a NaN equals nothing
_BY_REPR = frozenset({float, complex})
_MISSING = object()
_KEEP = 1024


class _Unstable(Exception):
    """A value whose change the fingerprint could not tell: pickle afresh."""


class _Entry:
    __slots__ = ("blob", "fingerprint", "head", "kept", "key", "ref", "seen")

    def __init__(self, fingerprint: tuple, key: str, blob: bytes, kept: tuple) -> None:
        self.fingerprint, self.key, self.blob, self.kept = fingerprint, key, blob, kept
        self.ref: weakref.ref | None = None  # the function's (its entry goes with it)
        self.head: bytes | None = None  # the whole reduction pickled, globals included
        #: what the function held when its fingerprint was last found unchanged, as the
        #: objects themselves (:meth:`same`); None: not yet
        self.seen: tuple | None = None

    def remember(self, func: FunctionType, generation: int) -> None:
        names = cloudpickle.cloudpickle._extract_code_globals(func.__code__)
        space = func.__globals__
        self.seen = (
            generation,
            func.__code__,
            func.__name__,
            func.__qualname__,
            func.__defaults__,
            tuple((name, space.get(name, _MISSING)) for name in names),
        )

    def same(self, func: FunctionType, generation: int) -> bool:
        """Whether ``func`` holds the very objects it held when :meth:`remember` ran: then
        its fingerprint is unchanged too (every value a fingerprint takes is immutable),
        told without making it (a fingerprint is ~3 µs, this well under 1)."""
        seen = self.seen
        if (
            seen is None
            or seen[0] != generation
            or func.__code__ is not seen[1]
            or func.__name__ is not seen[2]
            or func.__qualname__ is not seen[3]
            or func.__defaults__ is not seen[4]
            or func.__kwdefaults__ is not None
            or func.__closure__ is not None
            or func.__dict__
        ):
            return False
        space = func.__globals__
        for name, value in seen[5]:  # noqa: SIM110 (all(<generator>) costs a frame)
            if space.get(name, _MISSING) is not value:
                return False
        return True


#: id(function) -> its entry (a plain dict: a weak-keyed one makes a weakref per lookup)
_entries: dict[int, _Entry] = {}
_keys = itertools.count(1)
_loaded: collections.OrderedDict[str, FunctionType] = collections.OrderedDict()
_lock = threading.Lock()


def _key(value: Any, by_reference: Callable[[Any], bool]) -> Any:
    """What tells ``value`` apart from any other value (raises :class:`_Unstable`)."""
    kind = type(value)
    if kind in _ATOMS:
        return kind, value
    if kind in _BY_REPR:
        return kind, repr(value)
    if kind is tuple:
        return kind, tuple(_key(item, by_reference) for item in value)
    if kind is ModuleType or kind is BuiltinFunctionType or by_reference(value):
        return kind, id(value)  # alive while kept: the entry holds it (``kept``)
    raise _Unstable


def _fingerprint(
    func: FunctionType, by_reference: Callable[[Any], bool], generation: int
) -> tuple[tuple, tuple, dict] | None:
    """``(fingerprint, values it holds, the globals to arrive)``, or None: not kept."""
    if func.__closure__ is not None or func.__dict__:
        return None
    code, space = func.__code__, func.__globals__
    names = cloudpickle.cloudpickle._extract_code_globals(code)
    arriving = {name: space[name] for name in names if name in space}
    values = (*arriving.values(), *(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values())
    try:
        keys = tuple(_key(value, by_reference) for value in values)
        kwdefaults = tuple(func.__kwdefaults__ or ())
    except _Unstable:
        return None
    names_missing = tuple(name for name in names if name not in space)
    fingerprint = (
        generation,
        id(code),
        func.__name__,
        func.__qualname__,
        tuple(arriving),
        names_missing,
        len(func.__defaults__ or ()),
        kwdefaults,
        keys,
    )
    return fingerprint, (code, *values), arriving


def reduce(
    func: FunctionType,
    by_reference: Callable[[Any], bool],
    pickle_alone: Callable[[FunctionType], bytes],
    generation: int,
) -> tuple | None:
    """The reduction of notebook function ``func`` as a kept pickle, or None (pickle it
    afresh). ``by_reference``: whether an object pickles as its importable name;
    ``pickle_alone``: the function's own pickle; ``generation`` changes when what
    pickles by reference does."""
    found = _fingerprint(func, by_reference, generation)
    if found is None:
        return None
    fingerprint, kept, arriving = found
    entry = _entry_of(func)
    if entry is None or entry.fingerprint != fingerprint:
        blob = pickle_alone(func)
        entry = _Entry(fingerprint, f"{_process.token()}.f{next(_keys)}", blob, kept)
        _keep(func, entry)
    return _made, (entry.key, entry.blob, arriving)


def _entry_of(func: FunctionType) -> _Entry | None:
    entry = _entries.get(id(func))
    return entry if entry is not None and entry.ref is not None and entry.ref() is func else None


def _keep(func: FunctionType, entry: _Entry) -> None:
    key = id(func)

    def gone(ref: weakref.ref) -> None:  # the function died: its entry goes (if still its)
        kept = _entries.get(key)
        if kept is not None and kept.ref is ref:
            del _entries[key]

    entry.ref = weakref.ref(func, gone)
    _entries[key] = entry


def head(
    func: FunctionType,
    by_reference: Callable[[Any], bool],
    pickle_head: Callable[[FunctionType], bytes],
    generation: int,
) -> bytes | None:
    """The pickle of ``func``'s whole reduction (:func:`reduce`'s, with the globals it
    reads), made once while its fingerprint holds: a lane call whose arguments are plain
    values starts with it (:func:`nbrpc._wire.lanes.messages.lane_call`). None where the
    function is not kept, or was not yet kept with this fingerprint: its call is pickled
    whole then (which keeps it). Equal fingerprints mean equal globals, so the pickled
    globals are the ones a fresh pickle would carry."""
    entry = _entry_of(func)
    if entry is None:
        return None
    if entry.head is not None and entry.same(func, generation):
        return entry.head
    found = _fingerprint(func, by_reference, generation)
    if found is None or entry.fingerprint != found[0]:
        return None
    entry.remember(func, generation)
    if entry.head is None:
        entry.head = pickle_head(func)
    return entry.head


def _made(key: str, blob: bytes, arriving: dict[str, Any]) -> FunctionType:
    """Unpickling side: the function kept under ``key`` (made from ``blob`` once), with
    the globals it reads arrived as a fresh pickle's would."""
    with _lock:
        func = _loaded.get(key)
        if func is not None:
            _loaded.move_to_end(key)
    if func is None:
        func = pickle.loads(blob)
        with _lock:
            _loaded[key] = func
            while len(_loaded) > _KEEP:
                _loaded.popitem(last=False)
    _put_in_place(func, arriving)
    _arrived.globals = arriving
    return func


def _put_in_place(func: FunctionType, arriving: dict[str, Any]) -> None:
    """The globals a kept function brought, where it runs, as a fresh pickle puts them."""
    if arriving:
        func.__globals__.update(namespace.arrive(arriving))


class _Arrived(threading.local):
    globals: dict[str, Any] | None = None  # what the last _made on this thread put in place


_arrived = _Arrived()
#: the callee's: a lane call's function pickle (:func:`head`'s) -> the function, and the
#: globals it brings (each call puts them in place again, as a fresh pickle would)
_by_head: dict[bytes, tuple[FunctionType, dict[str, Any]]] = {}


def from_head(head: Any) -> Any:
    """The function a lane call's ``head`` pickles (:func:`head`'s, or an importable
    function's name): a kept function is looked up by the pickle's bytes, its globals put
    in place (the same values: equal pickles), instead of unpickled again (the pickle
    carries the function's own, a few hundred bytes)."""
    key = bytes(head)
    hit = _by_head.get(key)
    if hit is not None:
        func, arriving = hit
        _put_in_place(func, arriving)
        return func
    _arrived.globals = None
    func = pickle.loads(key)
    came = _arrived.globals
    if came is not None:  # a kept function's (an importable one is looked up anew)
        if len(_by_head) >= _KEEP:
            _by_head.clear()
        _by_head[key] = func, came
    return func


def kept() -> int:
    """How many functions this process keeps, made from a caller's pickle."""
    with _lock:
        return len(_loaded)
