"""A function's code object as it travels: marshalled once, kept by the receiver.

cloudpickle pickles a function sent by value with its code object. :func:`reduce_code`
(in every nbrpc pickle's dispatch table, :mod:`.pickling`) marshals a code object once in
a process, cached while the code object lives, and sends the bytes under a key; the
receiver loads them once a key and keeps the code (the :data:`_CODE_KEEP` least recently
used), so a notebook function called again is neither marshalled nor loaded again. A
function's globals, defaults and closure are not kept: they are pickled on every call, so
a changed global is seen by the next call.
"""

from __future__ import annotations

import collections
import itertools
import marshal
import threading
import weakref
from types import CodeType
from typing import Any

from nbrpc import _fork, _process

# A code object travels once per process pair in practice: marshalled once here (cached
# while the code object lives), under a key the receiver keeps it by.
_code_sent: weakref.WeakKeyDictionary[CodeType, tuple[str, bytes]] = weakref.WeakKeyDictionary()
_code_keys = itertools.count(1)
# A forked process (every worker is forked from the zygote) sends code under keys of its
# own (its process token): with the parent's keys, two workers would send different code
# under one key. What the parent marshalled is forgotten with them.
_fork.in_child(_code_sent.clear)
_code_loaded: collections.OrderedDict[str, CodeType] = collections.OrderedDict()
_code_lock = threading.Lock()
_CODE_KEEP = 4096  # code objects kept by a receiver (least recently used go first)


def reduce_code(code: CodeType) -> Any:
    """Send a code object as ``marshal`` bytes under a key (all processes run one Python
    minor version: preflight checks it for other hosts)."""
    sent = _code_sent.get(code)
    if sent is None:
        key = f"{_process.token()}.{next(_code_keys)}"
        sent = _code_sent[code] = (key, marshal.dumps(code))
    return _load_code, sent


def code_key(code: CodeType) -> str | None:
    """The key ``code`` is sent under from this process, once it was sent (else None)."""
    sent = _code_sent.get(code)
    return sent[0] if sent is not None else None


def _load_code(key: str, data: bytes) -> CodeType:
    with _code_lock:
        code = _code_loaded.get(key)
        if code is not None:
            _code_loaded.move_to_end(key)
            return code
    code = marshal.loads(data)
    with _code_lock:
        _code_loaded[key] = code
        while len(_code_loaded) > _CODE_KEEP:
            _code_loaded.popitem(last=False)
    return code
