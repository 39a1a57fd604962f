"""The torch releases nbrpc is tested with, and what differs between them.

nbrpc runs beside the torch a user already has: ``pyproject.toml`` admits exactly the
releases below, the project's ``.venv`` pins one of them and ``make test`` runs a second
virtualenv with the newest (``make test-torch TORCH=...`` any other; docs/compatibility.md
has the table). A torch outside the range is not refused: :func:`warn_if_untested` says in
one line which releases were tested and where a change would show first.

Where releases differ in something nbrpc relies on, the difference is named here, once,
as a flag the rest of the seam reads; ``tests/test_torch_seam.py`` pins each flag against
the torch it runs on. The differences found between 2.11 and 2.14.1, reading
``torch/distributed/{rpc,autograd,optim,nn}`` of each wheel and running the seam's pins:

* :data:`OPTIMIZER_SCRIPTED`: up to 2.13, ``DistributedOptimizer`` compiles the functional
  optimizers with TorchScript on each owner (``_ScriptLocalOptimizer``), which prints
  TorchScript's deprecation notices there; 2.14 runs them as Python objects
  (``_FunctionalLocalOptimizer``) and prints none.

Everything else nbrpc uses is the same in these releases: ``torch.distributed.rpc`` changed
only in asserts and type hints, and the private names of the seam are pinned on each.
"""

from __future__ import annotations

import re
import warnings

import torch

#: The oldest and the newest torch release nbrpc is tested with (``make test`` runs the
#: newest beside ``.venv``'s own; the Makefile's TORCH_OLDEST and TORCH_NEWEST are these,
#: and ``pyproject.toml`` admits exactly this range: ``tests/unit`` checks all three agree).
OLDEST_TESTED = (2, 11, 0)
NEWEST_TESTED = (2, 14, 1)


class TorchVersionWarning(UserWarning):
    """The torch in this environment is outside the releases nbrpc was tested with."""


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string: ``"2.14.1+cu130"`` -> 2, 14, 1;
    a pre-release or a source build (``"2.15.0a0+git1234"``) counts as its release."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return (0, 0, 0)
    major, minor, patch = match.groups()
    return (int(major), int(minor), int(patch or 0))


def spelled(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


#: The release of the torch this process imported.
RUNNING = release(torch.__version__)

#: torch < 2.14 compiles ``DistributedOptimizer``'s functional optimizers with TorchScript
#: on each owner, printing TorchScript's deprecation notices there (see the module's doc).
OPTIMIZER_SCRIPTED = RUNNING < (2, 14)


def in_tested_range(version: tuple[int, int, int]) -> bool:
    return OLDEST_TESTED <= version <= NEWEST_TESTED


def untested_notice(version: str) -> str:
    """The one line a torch outside the tested range gets."""
    return (
        f"nbrpc was tested with torch {spelled(OLDEST_TESTED)} to {spelled(NEWEST_TESTED)}, "
        f"and this is torch {version}: it runs, but an error raised from nbrpc/_torch/ means "
        "torch changed a private name nbrpc relies on (please report it with this version)."
    )


def warn_if_untested() -> None:
    """One line on stderr, at import, where torch is outside the tested range (a
    :class:`TorchVersionWarning`, so ``warnings.filterwarnings`` can silence it)."""
    if in_tested_range(RUNNING):
        return
    warnings.warn_explicit(
        untested_notice(str(torch.__version__)),
        TorchVersionWarning,
        filename="nbrpc",  # no source line to show under it: one line
        lineno=0,
        module="nbrpc",
    )
