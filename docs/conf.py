"""Sphinx configuration of nbrpc's documentation site (``make docs``; docs/site.md says why).

``tools/docs_site.py`` lays out the site's sources in ``build/docs-src`` (the guides of
``docs/``, the generated API and magic pages, the tutorials with their outputs) and runs
``sphinx-build -c docs -W --keep-going -n build/docs-src build/docs``: this file is the
configuration, the sources are not beside it.
"""

from __future__ import annotations

import builtins
import importlib
from typing import Any

import nbrpc

project = "nbrpc"
author = "the nbrpc developers"
copyright = "the nbrpc developers"
release = version = nbrpc.__version__

extensions = [
    "myst_nb",  # Markdown (MyST) pages and notebooks; it brings myst_parser
    "sphinx.ext.autodoc",
]

root_doc = "index"
exclude_patterns: list[str] = []
html_theme = "furo"
html_title = f"nbrpc {release}"
html_static_path: list[str] = []
# no external fonts, scripts or analytics: the site works offline, as clusters often are
html_theme_options: dict[str, Any] = {}
html_show_sourcelink = False
html_copy_source = False

# -- MyST: the guides are GitHub Markdown; their anchors are GitHub's -----------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 6
myst_heading_slug_func = "github"

# -- MyST-NB: the tutorials are rendered with the outputs of their nbval run ----------------
# tools/docs_site.py hands over the notebooks nbval executed (build/executed-notebooks):
# never executed again here.
nb_execution_mode = "off"
# A widget's view needs its state and ipywidgets' JavaScript from a CDN: neither is in a
# static page, so a widget output shows its HTML or text (every nbrpc view has both).
nb_mime_priority_overrides = [
    ("html", "application/vnd.jupyter.widget-view+json", None),
    ("html", "application/vnd.jupyter.widget-state+json", None),
]
nb_ipywidgets_js: dict[str, dict[str, str]] = {}
nb_merge_streams = True

# -- autodoc: the API reference from the docstrings ----------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# torch's classes that nbrpc exports (RRef, WorkerInfo) carry torch's docstrings, from
# their base classes; nbrpc's own names have their own (tests/unit/test_docstrings.py)
autodoc_inherit_docstrings = True
autodoc_default_options: dict[str, Any] = {}

# -- warnings are errors (-W), and every reference must resolve (-n) ------------------------
nitpicky = True


def _resolve(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """What Sphinx could not resolve by itself (``missing-reference``); None leaves it
    missing, which nitpicky mode makes a warning, so an error.

    * A name of another project (``torch.Tensor``, ``typing.Any``, a builtin): shown as
      text. The build is offline (no intersphinx), so those cannot link anywhere.
    * A name in a private module of nbrpc (``nbrpc._rows.CallRow``, as type hints say
      it): the public name that is the same object (``nbrpc.CallRow``); a private name no
      public one is (``nbrpc._options.Options``) has no page, and shows as text.
    * Anything else, an unknown ``nbrpc.`` name or a bare name that is not a builtin,
      stays missing: a typo in a docstring or a guide fails the build.
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~.")
    top = target.split(".")[0]
    if "." not in target:
        return contnode if hasattr(builtins, target) else None
    if top != "nbrpc":
        return contnode
    if not any(p.startswith("_") and not p.startswith("__") for p in target.split(".")):
        return None
    obj = _lookup(target)
    for module_name in ("nbrpc", "nbrpc.autograd", "nbrpc.optim", "nbrpc.widgets"):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            if obj is not None and getattr(module, name, None) is obj:
                domain = env.get_domain("py")
                return domain.resolve_xref(
                    env, node["refdoc"], app.builder, node["reftype"],
                    f"{module_name}.{name}", node, contnode,
                )  # fmt: skip
    return contnode


def _lookup(dotted: str) -> Any:
    """The object a dotted name names (module, then attributes), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def setup(app: Any) -> None:
    app.connect("missing-reference", _resolve)
