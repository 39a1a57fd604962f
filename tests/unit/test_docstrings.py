"""Every public name has a docstring that says what it does, its parameters and its errors.

The public names are those of ``nbrpc.__all__`` and of the public sub-packages'
``__all__`` (``nbrpc.autograd``, ``nbrpc.optim``, ``nbrpc.widgets``), and the public
methods and properties of the classes among them that nbrpc defines. The documentation
site's API reference is these docstrings (tools/docs_site.py), so a name without one is a
page without text. Each test lists every offender at once, with what it lacks.

* a docstring of its own (not one inherited from a base class or a builtin), for every
  name and every public method; a property may instead be named in its class's docstring;
* every parameter of a public function or of a public class's constructor named in it,
  as code (````name````), exceptions, enums and ``TypedDict`` rows apart (nbrpc raises,
  enumerates or returns those; nobody calls them);
* for a public function, what it raises: an error's name, or a sentence with "raise" (a
  function that raises nothing of its own says so).

Names nbrpc re-exports from torch (``RRef``, ``WorkerInfo``, ``nbrpc.autograd.context``)
carry torch's docstrings: they must have one, and torch's text is theirs.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import typing
from collections.abc import Iterator
from typing import Any

import pytest

MODULES = ("nbrpc", "nbrpc.autograd", "nbrpc.optim", "nbrpc.widgets")
RAISES = re.compile(r"\b[Rr]ais(e|es|ed|ing)\b|\b[A-Z]\w*(Error|Interrupt|Warning)\b")


def _public() -> Iterator[tuple[str, Any]]:
    """(qualified name, object) for each public name, each object once (its first name)."""
    seen: set[int] = set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if name == "__version__" or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{module_name}.{name}", obj


def _from_torch(obj: Any) -> bool:
    return (getattr(obj, "__module__", "") or "").split(".")[0] == "torch"


def _own_doc(obj: Any) -> str:
    if isinstance(obj, type):
        return vars(obj).get("__doc__") or ""
    return getattr(obj, "__doc__", None) or ""


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """A class's public methods and properties, those it defines itself."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, staticmethod | classmethod):
            yield name, value.__func__
        elif inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def _documented_objects() -> Iterator[tuple[str, Any, str]]:
    """(qualified name, object, its kind) for every name and member the rules apply to."""
    for qualified, obj in _public():
        if inspect.ismodule(obj) or _from_torch(obj):
            continue
        if isinstance(obj, type):
            yield qualified, obj, "class"
            for name, member in _members(obj):
                kind = "property" if isinstance(member, property) else "method"
                yield f"{qualified}.{name}", member, kind
        elif callable(obj):
            yield qualified, obj, "function"


def _called(cls: type) -> bool:
    """Whether users call the class (its constructor's parameters must be documented)."""
    return not (issubclass(cls, BaseException | enum.Enum | dict) or typing.is_typeddict(cls))


def _parameters(obj: Any) -> list[str]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def _named(doc: str, parameter: str) -> bool:
    return re.search(r"``\**" + re.escape(parameter) + r"\b", doc) is not None


def _undocumented() -> list[str]:
    missing = []
    for qualified, obj in _public():
        from_elsewhere = inspect.ismodule(obj) or _from_torch(obj)
        if from_elsewhere and not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{qualified}: no docstring")
    for qualified, obj, kind in _documented_objects():
        if _own_doc(obj).strip():
            continue
        if kind == "property":
            owner, name = qualified.rsplit(".", 1)
            cls = _lookup(owner)
            if _named(_own_doc(cls), name):
                continue
            missing.append(f"{qualified}: no docstring, and its class's does not name it")
            continue
        missing.append(f"{qualified}: no docstring")
    return missing


def _lookup(qualified: str) -> Any:
    module_name, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), name)


def test_every_public_name_has_a_docstring():
    missing = _undocumented()
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_every_parameter_is_named_in_its_docstring():
    missing = []
    for qualified, obj, kind in _documented_objects():
        if kind in ("property", "method") or (kind == "class" and not _called(obj)):
            continue
        doc = _own_doc(obj)
        unnamed = [p for p in _parameters(obj) if not _named(doc, p)]
        if unnamed:
            missing.append(f"{qualified}: {', '.join(unnamed)}")
    assert not missing, "parameters not named (as ``name``) in the docstring:\n" + "\n".join(
        missing
    )


def test_every_function_says_what_it_raises():
    silent = [
        qualified
        for qualified, obj, kind in _documented_objects()
        if kind == "function" and not RAISES.search(_own_doc(obj))
    ]
    assert not silent, (
        "functions whose docstring does not say what they raise (an error's name, or "
        "'raises nothing'):\n" + "\n".join(silent)
    )


@pytest.mark.parametrize(
    ("doc", "fails"),
    [
        ("", True),
        ("Start ``n`` workers. Raises ConfigError.", False),
    ],
)
def test_the_rules_can_fail(doc, fails, monkeypatch):
    """The checks see a missing docstring, parameter and error (not a vacuous pass)."""
    import nbrpc

    def probe(n):
        pass

    probe.__doc__ = doc
    monkeypatch.setattr(nbrpc, "probe", probe, raising=False)
    monkeypatch.setattr(nbrpc, "__all__", [*nbrpc.__all__, "probe"])
    found = [q for q, obj, kind in _documented_objects() if q == "nbrpc.probe"]
    assert found == ["nbrpc.probe"]
    assert any(m.startswith("nbrpc.probe:") for m in _undocumented()) is fails
    assert (not _named(doc, "n")) is fails
    assert (not RAISES.search(doc)) is fails
