"""`make test-torch`: a second virtualenv beside ``.venv``, with another torch of the range.

nbrpc supports a range of torch releases (``nbrpc._torch.versions``); the project's own
``.venv`` pins one of them. This tool builds a virtualenv with another release of the range,
as a user who already has that torch would have it, and reuses it while its pin is unchanged:

* every distribution of this interpreter's environment (the project's ``.venv``) but torch
  and nbrpc is hard-linked into the new one (pip sees them installed, so only what the other
  torch needs is installed: about 2 s instead of installing the test extra again);
* ``pip install torch==VERSION`` from the package index (on Linux x86_64 its CUDA build, with
  its CUDA libraries: several GB, which run on a CPU-only machine too);
* ``pip install -e .[test]``, as a user installs nbrpc beside the torch they have, and a
  check that pip left that torch in place (never a silent downgrade).

Usage::

    python tools/torch_venv.py VENV VERSION     # prints VENV's python on its last line
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

#: the distributions never linked from the project's environment: the one being replaced,
#: and this checkout (installed editable in the new environment)
NOT_LINKED = {"torch", "nbrpc"}


def python_of(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def stamp_of(venv: str) -> str:
    return os.path.join(venv, ".nbrpc-torch")


def link_files(dist: importlib.metadata.Distribution, venv: str) -> None:
    """Hard-link the files of ``dist`` (a distribution of this interpreter's environment,
    its metadata included) into ``venv``'s site-packages: pip then sees it installed.
    Also what ``make package-check`` puts torch into its fresh virtualenv with."""
    source = str(dist.locate_file(""))
    target = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
    for path in dist.files or []:
        src, dst = os.path.join(source, path), os.path.join(target, path)
        if ".." in path.parts or not os.path.isfile(src) or os.path.exists(dst):
            continue  # scripts live outside purelib; a file two packages share
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)


def link_distributions(venv: str) -> int:
    """Hard-link this environment's distributions, but :data:`NOT_LINKED`, into ``venv``."""
    linked = 0
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in NOT_LINKED or not dist.files:
            continue
        link_files(dist, venv)
        linked += 1
    return linked


def installed_torch(python: str) -> str:
    """The torch version ``python``'s environment holds (from its metadata: no import)."""
    code = "import importlib.metadata as m; print(m.version('torch'))"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    except OSError:  # no such interpreter (a half-made virtualenv): build it again
        return ""
    return done.stdout.strip()


def pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", *args], check=True)


def build(venv: str, version: str, checkout: str) -> None:
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    linked = link_distributions(venv)  # pip itself among them
    python = python_of(venv)
    pip(python, "--no-compile", f"torch=={version}")
    pip(python, "-e", f"{checkout}[test]")
    found = installed_torch(python)
    if found.split("+")[0] != version:
        raise SystemExit(
            f"pip replaced torch {version} with {found} while installing nbrpc: "
            "pyproject.toml's torch range must admit every release nbrpc supports"
        )
    with open(stamp_of(venv), "w") as f:
        f.write(version + "\n")
    print(
        f"{venv}: torch {found} installed, {linked} distributions linked from "
        f"{sys.prefix}, nbrpc installed beside it with torch left in place, "
        f"in {time.monotonic() - started:.0f} s"
    )


def main() -> int:
    venv, version = sys.argv[1], sys.argv[2]
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stamp = stamp_of(venv)
    current = pathlib.Path(stamp).read_text().strip() if os.path.exists(stamp) else ""
    if current != version or installed_torch(python_of(venv)).split("+")[0] != version:
        build(venv, version, checkout)
    else:
        print(f"{venv}: torch {version}, reused")
    print(python_of(venv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
