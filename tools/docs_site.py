"""`make docs`: the documentation site, built into build/docs (docs/site.md says how and why).

python tools/docs_site.py            # lay out the sources, then build the site
python tools/docs_site.py --stage    # only lay out build/docs-src (no notebook runs, no Sphinx)

The site's sources are laid out in build/docs-src, then Sphinx (docs/conf.py) builds them
with warnings as errors and every reference checked (``-W --keep-going -n``):

* the guides, docs/*.md (and their images), at the site's root: their links to the
  tutorials (``../notebooks/``) lose the ``../``; links to other files of the repository,
  which the site does not hold, become their path as code;
* ``api/``: a page per public name of ``nbrpc.__all__`` and one per public sub-package
  (``nbrpc.autograd``, ``nbrpc.optim``, ``nbrpc.widgets``), each an autodoc directive, so
  the text is the docstring's;
* ``magics/``: a page per magic of ``RpcMagics``, written from its argparse parser (the
  one ``@magic_arguments`` builds and ``%rpc_init?`` prints), ``%rpc_init``'s options with
  their documentation from ``nbrpc/_options.py``;
* ``notebooks/``: the tutorials with the outputs of their nbval run, which
  tests/notebook_outputs.py writes to build/executed-notebooks during ``make test``. A
  tutorial whose executed copy is missing or whose cells differ from notebooks/ (a
  developer running ``make docs`` alone, or after editing it) is run first, the same way:
  ``pytest --nbval-lax`` on it, with tests/conftest.py as a plugin (the fake hosts of
  tutorials 09 and 10, the hang watchdog). A tutorial that did not run (09 and 10 need
  root) is shown without outputs, under a note that says why.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "build" / "executed-notebooks"
STAGE = ROOT / "build" / "docs-src"
SITE = ROOT / "build" / "docs"

#: the public sub-packages with a page of their own in the API reference
SUBPACKAGES = ("nbrpc.autograd", "nbrpc.optim", "nbrpc.widgets")
#: metadata key where tests/notebook_outputs.py says how a tutorial's run went
RUN_KEY = "nbrpc_run"


# -- the guides -------------------------------------------------------------------------------

_LINKED_TEXT = re.compile(r"\[([^\]]*)\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")


def guide_text(text: str) -> str:
    """A guide as the site holds it, one folder up from docs/: ``](../notebooks/x.ipynb)``
    becomes ``](notebooks/x.ipynb)``; a link to any other file of the repository becomes
    its path as code (the site does not serve the repository)."""

    def link(match: re.Match[str]) -> str:
        label, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if target.startswith("notebooks/") and target.endswith(".ipynb"):
            return f"[{label}]({target}{anchor})"
        return f"`{target}`" if label.strip("`") == target else f"{label} (`{target}`)"

    return _LINKED_TEXT.sub(link, text)


def stage_guides() -> None:
    for path in sorted(DOCS.iterdir()):
        if path.suffix == ".md":
            (STAGE / path.name).write_text(guide_text(path.read_text()))
        elif path.suffix in (".png", ".svg", ".jpg"):
            shutil.copy2(path, STAGE / path.name)


# -- the API reference ------------------------------------------------------------------------


def _kind(obj: Any) -> str:
    """The autodoc directive that documents ``obj``."""
    if inspect.ismodule(obj):
        return "automodule"
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return "autoexception"
    if isinstance(obj, type):
        return "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


def _summary(obj: Any) -> str:
    """The first sentence of ``obj``'s docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return first


def _title(name: str) -> str:
    return f"{name}\n{'=' * len(name)}\n"


def _members(obj: Any) -> str:
    """autodoc options for a class: its own public members (and an enum's values)."""
    if not isinstance(obj, type):
        return ""
    return "   :members:\n"


def public_names(module_name: str) -> list[str]:
    """The names a module exports, as its ``__all__`` lists them (modules and the version
    string apart: each sub-package has its own page, the version is said on the index)."""
    module = importlib.import_module(module_name)
    return [
        name
        for name in module.__all__
        if name != "__version__" and not inspect.ismodule(getattr(module, name))
    ]


def _owner_page(obj: Any) -> str | None:
    """The top-level public name that is ``obj`` (documented on its own page), if any."""
    import nbrpc

    for name in public_names("nbrpc"):
        if getattr(nbrpc, name) is obj:
            return f"nbrpc.{name}"
    return None


def _torch_name(obj: Any) -> str | None:
    """Where torch documents ``obj``, if it is one of torch's names that nbrpc re-exports."""
    module = getattr(obj, "__module__", "") or ""
    if module.split(".")[0] != "torch":
        return None
    public = {"torch._C._distributed_rpc": "torch.distributed.rpc"}.get(module, module)
    public = "torch.distributed.rpc" if public == "torch.distributed.rpc.api" else public
    return f"{public}.{obj.__qualname__}"


_KEY_LINE = re.compile(r"^\s+(\w+): (.+?)(?:\s+#:?\s*(.*))?$")


def typeddict_keys(cls: type) -> str:
    """A ``TypedDict`` row's keys as an RST table: each key, its type and what it holds,
    read from the class's source (the comment beside a key, or the ``#:`` lines above it):
    autodoc documents a class's attributes, and a ``TypedDict``'s keys are not attributes."""
    said: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            above.append(stripped[2:].strip())
            continue
        match = _KEY_LINE.match(line)
        if match and match.group(1) in cls.__annotations__:
            said[match.group(1)] = " ".join([*above, match.group(3) or ""]).strip()
        above = []
    rows = ["   * - key", "     - type", "     - what it holds"]
    for key, annotation in cls.__annotations__.items():
        kind = getattr(annotation, "__forward_arg__", annotation)  # the source's text
        kind = kind if isinstance(kind, str) else inspect.formatannotation(kind)
        text = said.get(key, "").replace("*", "\\*") or "—"
        rows += [f"   * - ``{key}``", f"     - ``{kind}``", f"     - {text}"]
    head = "\n.. list-table::\n   :header-rows: 1\n   :widths: 20 30 50\n\n"
    return head + "\n".join(rows) + "\n"


def _directive(qualified: str, obj: Any) -> str:
    """The autodoc directive for ``obj`` under the name ``qualified``; torch's classes
    with their methods and torch's docstrings, under a line that says whose they are."""
    torch_name = _torch_name(obj)
    if torch_name is None:
        if typing.is_typeddict(obj):  # its keys in a table, not as attributes
            return f"\n.. {_kind(obj)}:: {qualified}\n" + typeddict_keys(obj)
        return f"\n.. {_kind(obj)}:: {qualified}\n" + _members(obj)
    return (
        f"\ntorch's ``{torch_name}``, which nbrpc exports unchanged: the text below is "
        "torch's docstring.\n"
        f"\n.. {_kind(obj)}:: {qualified}\n   :members:\n   :inherited-members:\n"
    )


def api_page(qualified: str) -> str:
    module_name, name = qualified.rsplit(".", 1)
    obj = getattr(importlib.import_module(module_name), name)
    return _title(qualified) + _directive(qualified, obj)


def subpackage_page(module_name: str) -> str:
    """A sub-package: its docstring, then each name it exports, documented here unless it
    is a top-level name (then a link to that page)."""
    module = importlib.import_module(module_name)
    parts = [
        _title(module_name),
        f"\n.. automodule:: {module_name}\n   :no-members:\n",
    ]
    for name in module.__all__:
        obj = getattr(module, name)
        same = _owner_page(obj)
        if same is not None:
            role = "exc" if _kind(obj) == "autoexception" else "func" if callable(obj) else "obj"
            role = "class" if _kind(obj) == "autoclass" else role
            parts.append(
                f"\n.. py:data:: {module_name}.{name}\n   :no-index:\n\n"
                f"   The same object as :{role}:`{same}`.\n"
            )
            continue
        parts.append(_directive(f"{module_name}.{name}", obj))
    return "".join(parts)


def api_index() -> str:
    import nbrpc

    rows = []
    for name in public_names("nbrpc"):
        obj = getattr(nbrpc, name)
        rows.append(f"* - [`nbrpc.{name}`](nbrpc.{name}.rst)\n  - {_md_cell(_summary(obj))}")
    for module_name in SUBPACKAGES:
        module = importlib.import_module(module_name)
        rows.append(f"* - [`{module_name}`]({module_name}.rst)\n  - {_md_cell(_summary(module))}")
    pages = [f"nbrpc.{n}" for n in public_names("nbrpc")] + list(SUBPACKAGES)
    toctree = "\n".join(pages)
    table = "\n".join(rows)
    intro = f"""# API reference

Every name of `nbrpc.__all__`, and the sub-packages `nbrpc.autograd`, `nbrpc.optim` and
`nbrpc.widgets`, with its signature and docstring (generated by `tools/docs_site.py`; the
text is the code's). `nbrpc.__version__` is the package's version, `{nbrpc.__version__}`.
The magics have [their own pages](../magics/index.md).
"""
    return _index_page(intro, ("name", "what it is"), table, toctree)


def _index_page(intro: str, header: tuple[str, str], table: str, toctree: str) -> str:
    """An index page: ``intro``, a table of its pages (two columns, ``header``'s names;
    ``table``: its rows) and their hidden table of contents."""
    return f"""{intro}
```{{list-table}}
:header-rows: 1
:widths: 30 70

* - {header[0]}
  - {header[1]}
{table}
```

```{{toctree}}
:hidden:

{toctree}
```
"""


def _md_cell(text: str) -> str:
    """A docstring's first sentence as Markdown: RST's double backticks become code, and
    its roles (``:func:`x``` ) their target."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def stage_api() -> None:
    api = STAGE / "api"
    api.mkdir()
    (api / "index.md").write_text(api_index())
    for name in public_names("nbrpc"):
        (api / f"nbrpc.{name}.rst").write_text(api_page(f"nbrpc.{name}"))
    for module_name in SUBPACKAGES:
        (api / f"{module_name}.rst").write_text(subpackage_page(module_name))


# -- the magics -------------------------------------------------------------------------------


def magics() -> list[tuple[str, str, Any]]:
    """Every magic: (its name, "line" or "cell", the method) in RpcMagics' order."""
    from nbrpc._magics import RpcMagics

    found = []
    for kind in ("line", "cell"):
        for name, method in RpcMagics.magics[kind].items():
            found.append((name, kind, getattr(RpcMagics, method)))
    return found


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        metavar = action.metavar or action.dest
        return f"`{metavar}`" + (" ..." if action.nargs in ("*", "+") else "")
    takes = action.nargs != 0
    metavar = action.metavar or action.dest.upper()
    return ", ".join(
        f"`{flag} {metavar}`" if takes else f"`{flag}`" for flag in action.option_strings
    )


def magic_page(name: str, kind: str, method: Any) -> str:
    """A magic's page from its parser: usage, description and one row per argument."""
    from nbrpc import _options

    prefix = "%" if kind == "line" else "%%"
    parser = getattr(method, "parser", None)
    description = inspect.cleandoc(
        parser.description if parser is not None else inspect.getdoc(method) or ""
    )
    usage = (
        parser.format_usage().replace("::", "").strip() if parser is not None else f"{prefix}{name}"
    )
    usage = " ".join(usage.split())
    lines = [
        f"# `{prefix}{name}`",
        "",
        f"A {kind} magic (`%load_ext nbrpc` registers it).",
        "",
        "```text",
        usage if kind == "line" else f"{usage}\n<the cell's code>",
        "```",
        "",
        _md_cell(description),
        "",
    ]
    declared = _options.declared() if name == "rpc_init" else {}
    actions = [a for a in (parser._actions if parser is not None else []) if a.dest != "help"]
    if not actions:
        lines.append("It takes no arguments.")
    else:
        formatter = parser._get_formatter()
        lines += [
            "## Arguments",
            "",
            "```{list-table}",
            ":header-rows: 1",
            ":widths: 30 70",
            "",
            "* - argument",
            "  - what it does",
        ]
        for action in actions:
            text = formatter._expand_help(action) if action.help else ""
            option = declared.get(action.dest)
            if option is not None:
                text = option.doc or text[0].upper() + text[1:] + "."
                if option.default is not None:
                    text += f" Default: ``{option.default!r}``."
                text += f" In Python: ``nbrpc.init({action.dest}=...)``."
            lines += [f"* - {_flags(action)}", f"  - {_md_cell(text) or '-'}"]
        lines += ["```", ""]
    if name == "rpc_init":
        lines += [
            "Every option is a keyword argument of {func}`nbrpc.init` too; "
            "[the options page](../options.md) lists them all, those without a flag "
            "included.",
            "",
        ]
    return "\n".join(lines) + "\n"


def magics_index() -> str:
    rows, pages = [], []
    for name, kind, method in magics():
        prefix = "%" if kind == "line" else "%%"
        parser = getattr(method, "parser", None)
        description = parser.description if parser is not None else inspect.getdoc(method)
        summary = _md_cell(inspect.cleandoc(description or "").split("\n\n")[0])
        rows.append(f"* - [`{prefix}{name}`]({name}.md)\n  - {' '.join(summary.split())}")
        pages.append(name)
    table = "\n".join(rows)
    toctree = "\n".join(pages)
    intro = """# Magics

`%load_ext nbrpc` registers them (and nothing else does). Each page is written from the
magic's argument parser, the one `%rpc_init?` prints, so the options are declared once, in
the code. A magic takes a trailing `# comment` as a Python line does.
"""
    return _index_page(intro, ("magic", "what it does"), table, toctree)


def stage_magics() -> None:
    folder = STAGE / "magics"
    folder.mkdir()
    (folder / "index.md").write_text(magics_index())
    for name, kind, method in magics():
        (folder / f"{name}.md").write_text(magic_page(name, kind, method))


# -- the tutorials ----------------------------------------------------------------------------


def _code(nb: Any) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def stale_notebooks() -> list[Path]:
    """The tutorials whose executed copy is missing or holds other code than notebooks/."""
    stale = []
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        executed = EXECUTED / source.name
        if not executed.exists() or _code(nbformat.read(executed, 4)) != _code(
            nbformat.read(source, 4)
        ):
            stale.append(source)
    return stale


def run_notebooks(paths: list[Path]) -> None:
    """Run tutorials as ``make test`` does (nbval, tests/conftest.py's set-up); the run
    writes their executed copies. A failing cell does not stop the site: its error shows."""
    print(f"docs: running {len(paths)} tutorials for their outputs: {[p.name for p in paths]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path])}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "--nbval-lax", "-q", "-rs"]
        + [str(p.relative_to(ROOT)) for p in paths],
        cwd=ROOT,
        env=env,
        check=False,
    )


def note_for(run: dict[str, Any]) -> str | None:
    """The note above a tutorial whose nbval run did not go through (None: it did)."""
    if run.get("skipped"):
        return (
            "This tutorial did not run when this site was built, so it is shown without "
            f"its outputs: {run['skipped']}"
        )
    if run.get("failed"):
        return (
            f"When this site was built, cell {run['failed']} of this tutorial failed; the "
            "outputs below are that run's, the error included."
        )
    return None


def site_notebook(source: Path) -> Any:
    """The tutorial as the site shows it: the executed copy, with a note when it did not
    run through; the source notebook without outputs if no copy exists."""
    executed = EXECUTED / source.name
    if executed.exists():
        nb = nbformat.read(executed, 4)
        run = nb.metadata.get(RUN_KEY, {})
    else:
        nb = nbformat.read(source, 4)
        run = {"skipped": "it has not been run here (`make test` or `make docs` runs it)."}
    # IPython's lexer: a tutorial's cells hold magics (``%rpc_init --hosts $HOSTS``)
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    note = note_for(run)
    if note is not None:
        cell = nbformat.v4.new_markdown_cell(f":::{{note}}\n{note}\n:::")
        cell.id = "nbrpc-run-note"
        first_heading = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1)
        nb.cells.insert(first_heading + 1, cell)
    return nb


def stage_notebooks() -> None:
    folder = STAGE / "notebooks"
    folder.mkdir()
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        nbformat.write(site_notebook(source), folder / source.name)


# -- the site ---------------------------------------------------------------------------------


def stage() -> None:
    if STAGE.exists():
        shutil.rmtree(STAGE)
    STAGE.mkdir(parents=True)
    stage_guides()
    stage_api()
    stage_magics()
    stage_notebooks()


def build() -> int:
    if SITE.exists():
        shutil.rmtree(SITE)
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(DOCS)]
    command += ["-W", "--keep-going", "-n", "-q", "-d", str(STAGE.parent / "docs-doctrees")]
    return subprocess.run([*command, str(STAGE), str(SITE)], cwd=ROOT, check=False).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", action="store_true", help="only lay out build/docs-src")
    args = parser.parse_args(argv)
    if not args.stage:
        stale = stale_notebooks()
        if stale:
            run_notebooks(stale)
    stage()
    if args.stage:
        return 0
    code = build()
    if code == 0:
        print(f"docs: the site is in {SITE.relative_to(ROOT)}/index.html")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
