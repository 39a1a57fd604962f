"""The options as text: ``%rpc_init``'s flags and the options' documentation.

Both follow from the one declaration, :class:`nbrpc._options.Options`: each option's
:class:`~nbrpc._options.Opt` gives its flag, help line, metavar and parser, so the magic's
arguments and ``--help`` (:func:`magic_arguments`), the options its parsed flags give
(:func:`from_flags`), and the options' list in the docstrings of :func:`nbrpc.init` and
:class:`nbrpc.Cluster` and in ``docs/options.md`` (:func:`options_doc`, checked by
``tests/unit/test_options.py``) are written nowhere else. Kept apart from the declaration
and the checked :class:`~nbrpc._options.Settings`: this is how a person reads the options
and types them, not what they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ._options import Options, declared


def annotation(name: str) -> str:
    """The type an option is given as, as source text (``"int | None"``)."""
    raw = Options.__annotations__[name]
    text = getattr(raw, "__forward_arg__", raw)  # TypedDict keeps them as ForwardRefs
    return re.sub(r"^Annotated\[\s*(.*?),\s*Opt\(.*$", r"\1", str(text), flags=re.S)


def options_doc() -> str:
    """The options as a reStructuredText-ish list, for docstrings and docs/options.md."""
    lines = []
    for name, opt in declared().items():
        flag = f" (``%rpc_init {opt.flag}``)" if opt.flag else " (Python only)"
        default = "" if opt.default is None else f" Default: ``{opt.default!r}``."
        text = opt.doc or (opt.help[0].upper() + opt.help[1:] + ".")
        lines.append(f"- ``{name}: {annotation(name)}``{flag}: {text}{default}")
    return "\n".join(lines)


def from_flags(args: Any) -> dict[str, Any]:
    """The options ``%rpc_init``'s parsed arguments give (argparse's namespace)."""
    given: dict[str, Any] = {}
    for name, opt in declared().items():
        if opt.flag is None:
            continue
        value = getattr(args, name)
        if opt.switch is not None:
            given[name] = opt.switch[1] if value else opt.switch[0]
        elif opt.repeat and value:
            given[name] = opt.parse(value) if opt.parse else value
        elif not opt.repeat and value is not None:
            given[name] = value  # argparse ran opt.parse
    return given


def magic_arguments(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give an IPython magic one ``@argument`` per option that has a flag."""
    from IPython.core.magic_arguments import argument

    for name, opt in reversed(declared().items()):
        if opt.flag is None:
            continue
        kwargs: dict[str, Any] = {"dest": name, "help": opt.help}
        if opt.switch is not None:
            kwargs["action"] = "store_true"
        else:
            kwargs["default"] = [] if opt.repeat else None
            if opt.repeat:
                kwargs["action"] = "append"
            elif opt.parse is not None:
                kwargs["type"] = opt.parse  # a bad value is a UsageError, before anything
            if opt.metavar:
                kwargs["metavar"] = opt.metavar
        func = argument(opt.flag, **kwargs)(func)
    return func
