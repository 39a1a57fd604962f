"""The architecture's rules, as tests (no workers needed).

The layers are declared once, in docs/architecture.md (the block after ``<!-- layers``);
these tests read that declaration and the code's imports, and name the modules and the
rule that a change breaks: an import that goes up a layer, a module no layer places, a
cycle, a module reaching into another's underscore names, a stale ``__all__``, a module
grown past 500 lines, an engine source that strays from the protocol.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest
from conftest import signature_strays

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "nbrpc"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 500


def declared_layers() -> list[tuple[str, list[str]]]:
    """``[(layer, [module or folder/, ...]), ...]`` from the top layer down."""
    text = DOC.read_text()
    block = text.split("<!-- layers:", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    layers = []
    for line in block.splitlines():
        if not line.strip() or line.startswith(" "):
            continue
        name, modules = re.split(r"\s{2,}", line.strip())[:2]
        layers.append((name, modules.split()))
    return layers


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name below ``nbrpc`` (``"_wire.shm"``); a
    folder's ``__init__`` is the folder's name. The package's own ``__init__`` is left out:
    it is the public facade, above every layer."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts == ("__init__",):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_module(dotted: str) -> bool:
    base = PKG.joinpath(*dotted.split(".")) if dotted else PKG
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    head = module.split(".")[0]
    for index, (name, members) in enumerate(layers):
        for member in members:
            if member == module or (member.endswith("/") and member[:-1] == head):
                return index, name
    return None


def _package_of(module: str, path: pathlib.Path) -> list[str]:
    parts = module.split(".") if module else []
    return parts if path.name == "__init__.py" else parts[:-1]


def imports_of(module: str, path: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """``(imported module, line, names taken from it)`` for every import of an nbrpc
    module, at module level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path)
                base = base[: len(base) - (node.level - 1)]
            elif node.module and (node.module == "nbrpc" or node.module.startswith("nbrpc.")):
                base = []
                node_module = node.module.split(".", 1)[1] if "." in node.module else ""
                target = ".".join([*base, *([node_module] if node_module else [])])
                found.extend(_from(target, node))
                continue
            else:
                continue
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.extend(_from(target, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbrpc."):
                    found.append((alias.name.split(".", 1)[1], node.lineno, []))
    return found


def _from(target: str, node: ast.ImportFrom) -> list[tuple[str, int, list[str]]]:
    """``from target import a, b``: each a submodule, or names of ``target``."""
    out, names = [], []
    for alias in node.names:
        sub = f"{target}.{alias.name}" if target else alias.name
        if _is_module(sub):
            out.append((sub, node.lineno, []))
        else:
            names.append(alias.name)
    if names and target:
        out.append((target, node.lineno, names))
    return out


LAYERS = declared_layers()
MODULES = package_modules()


def test_the_declaration_places_every_module_and_names_only_modules_that_exist():
    unplaced = [m for m in MODULES if layer_of(m, LAYERS) is None]
    assert not unplaced, (
        f"no layer of docs/architecture.md places {unplaced}: add each to the layer whose "
        "modules it imports from, above them"
    )
    for name, members in LAYERS:
        for member in members:
            assert _is_module(member.rstrip("/").replace("/", ".")), (
                f"layer {name!r} of docs/architecture.md names {member}, which does not exist"
            )


def test_magics_are_the_top_layer_and_the_torch_seam_the_bottom():
    assert LAYERS[0][1] == ["_magics"], "the magics are the top layer: nothing imports them"
    assert LAYERS[-1][1] == ["_torch/"], "the torch seam (_torch/) is the bottom layer"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_goes_up_a_layer(module):
    here = layer_of(module, LAYERS)
    assert here is not None
    for target, line, _ in imports_of(module, MODULES[module]):
        there = layer_of(target, LAYERS) if target else (-1, "the package facade")
        assert there is not None, f"nbrpc/{module} imports {target}, which no layer places"
        assert there[0] >= here[0], (
            f"nbrpc.{module} (layer {here[1]!r}) imports nbrpc.{target or '(facade)'} (layer "
            f"{there[1]!r}) at line {line}: a module imports only from its own layer and "
            "the layers below it (docs/architecture.md). Move the code down, or pass what it "
            "needs in from above."
        )


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (a -> b: a imports b), as the path that closes it, else None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_modules_import_each_other_without_cycles():
    graph = {
        m: {t for t, _, _ in imports_of(m, p) if t in MODULES and t != m}
        for m, p in MODULES.items()
    }
    cycle = _first_cycle(graph)
    assert cycle is None, f"an import cycle: {' -> '.join(cycle or [])}"


def _private_uses(path: pathlib.Path, module: str | None) -> list[str]:
    """Uses in ``path`` of an underscore name of another nbrpc module: ``mod._name``,
    ``from mod import _name``, ``setattr(mod, "_name", ...)``."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # a local name -> the nbrpc module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and module is not None:
                base = _package_of(module, path)
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "nbrpc" or node.module.startswith("nbrpc.")):
                target = node.module.split(".", 1)[1] if "." in node.module else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if _is_module(sub):
                    aliases[alias.asname or alias.name] = sub
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from nbrpc.{target} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "nbrpc" or alias.name.startswith("nbrpc."):
                    aliases[alias.asname or "nbrpc"] = (
                        alias.name.split(".", 1)[1] if alias.asname and "." in alias.name else ""
                    )
    for node in ast.walk(tree):
        chain: list[str] = []
        if isinstance(node, ast.Attribute):
            base: ast.AST = node
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if not isinstance(base, ast.Name) or base.id not in aliases:
                continue
            owner = aliases[base.id]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in aliases
            and isinstance(node.args[1], ast.Constant)
        ):
            owner, chain = aliases[node.args[0].id], [str(node.args[1].value)]
        else:
            continue
        for attr in chain:
            sub = f"{owner}.{attr}" if owner else attr
            if _is_module(sub):
                owner = sub
                continue
            if attr.startswith("_") and not attr.startswith("__") and owner != module:
                found.append(f"line {node.lineno}: nbrpc.{owner or '(facade)'}.{attr}")
            break
    return sorted(set(found))


@pytest.mark.parametrize(
    "path",
    sorted([*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_module_reaches_another_modules_underscore_names(path):
    module = None
    if PKG in path.parents:
        parts = path.relative_to(PKG).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    uses = _private_uses(path, module)
    assert not uses, (
        f"{path.relative_to(ROOT)} uses underscore names of other nbrpc modules: {uses}. An "
        "underscore name is its module's own: give the module a function that says what "
        "callers (or tests) need."
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_private_modules_have_no_all_and_none_grows_past_the_limit(module):
    path = MODULES[module]
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"nbrpc/{module}: {lines} lines; split it by what it holds"
    if any(part.startswith("_") for part in module.split(".")):
        assert "__all__" not in text, (
            f"nbrpc.{module} is private: its interface is its names without an underscore; "
            "an __all__ there only goes stale"
        )


@pytest.mark.parametrize("name", ["nbrpc", "nbrpc.autograd", "nbrpc.optim", "nbrpc.widgets"])
def test_public_modules_all_names_what_they_hold(name):
    import importlib

    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not have"


def test_every_engine_source_implements_the_protocol_with_its_signatures():
    from nbrpc._engines import SOURCES, EngineSource
    from nbrpc._options import Settings

    methods = [
        n
        for n, v in vars(EngineSource).items()
        if (not n.startswith("_") or n == "__init__") and callable(getattr(EngineSource, n))
    ]
    attributes = [n for n in EngineSource.__annotations__ if not n.startswith("_")]
    assert methods
    assert attributes
    writes = ("wants", "start", "launch", "client", "take", "stop")  # no default
    for source in SOURCES:
        strays = signature_strays(EngineSource, source, {n: n in writes for n in methods})
        assert not strays, "the EngineSource protocol: " + "; ".join(strays)
        for name in methods:
            kind = type(inspect.getattr_static(source, name))
            assert kind is type(inspect.getattr_static(EngineSource, name)), (
                f"{source.__name__}.{name} must be a {kind.__name__} as in the protocol"
            )
        made = source(Settings.make())
        for name in attributes:
            assert hasattr(made, name), f"{source.__name__} has no {name!r} (EngineSource)"


def test_the_folders_and_modules_import_each_other_without_cycles():
    """A cycle between two folders (``_lifecycle/`` importing ``_gather/``, which imported
    ``_lifecycle/`` back) is a cycle too, though no two modules close it."""
    unit = {m: m.split(".")[0] for m in MODULES}
    graph: dict[str, set[str]] = {u: set() for u in unit.values()}
    for m, p in MODULES.items():
        for t, _, _ in imports_of(m, p):
            if t in unit and unit[t] != unit[m]:
                graph[unit[m]].add(unit[t])
    cycle = _first_cycle(graph)
    assert cycle is None, f"folders or modules in a cycle: {' -> '.join(cycle or [])}"


#: kinds of thread nbrpc starts, at most: one per place in the code that starts one
MAX_THREAD_KINDS = 16


def _thread_starts() -> list[tuple[str, int, ast.Call]]:
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(getattr(func, "value", None), "id", "")
            ours = name == "Timer" and owner != "threading"  # nbrpc._timers.Timer, an entry
            if name in ("Thread", "Timer", "ThreadPoolExecutor", "start_new_thread") and not ours:
                found.append((module, node.lineno, node))
    return found


def test_threads_have_few_kinds_one_timer_service_and_names_that_say_nbrpc():
    """Every thread nbrpc starts is a ``threading.Thread`` named ``nbrpc-...`` (so
    ``%rpc_stacks`` and a debugger tell them from the user's and torch's), started in at
    most MAX_THREAD_KINDS places; what runs later is an entry of the timer service
    (``_timers``), never a ``threading.Timer`` or a pool of its own."""
    starts = _thread_starts()
    where = [f"nbrpc/{m}:{line}" for m, line, _ in starts]
    assert len(starts) <= MAX_THREAD_KINDS, f"{len(starts)} places start threads: {where}"
    for module, line, call in starts:
        func = call.func
        kind = func.attr if isinstance(func, ast.Attribute) else func.id
        assert kind == "Thread", f"nbrpc/{module}:{line}: a {kind}; use nbrpc._timers"
        named = {k.arg: k.value for k in call.keywords}.get("name")
        assert named is not None, f"nbrpc/{module}:{line}: a thread with no name"
        if isinstance(named, ast.Constant):
            text = named.value
        elif isinstance(named, ast.JoinedStr):
            text = next((v.value for v in named.values if isinstance(v, ast.Constant)), "")
        else:  # a parameter: the callers' names are checked where they pass them
            continue
        assert text.startswith("nbrpc-"), f"nbrpc/{module}:{line}: thread named {text!r}"
