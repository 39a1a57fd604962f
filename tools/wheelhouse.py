"""Wheels for a GPU host that reaches no package index, so that ``tools/gpu_check.py`` runs there.

    python tools/wheelhouse.py DIR [--python 3.12] [--skip torch,numpy,matplotlib]

A lent GPU machine often holds a CUDA build of torch, numpy and pytest, but none of what
nbrpc itself needs (ipyparallel, ipykernel, cloudpickle, ipywidgets, ...), and cannot fetch
it. This downloads, here, the wheels of everything ``tools/gpu_check.py`` imports there:
nbrpc's own dependencies (pyproject.toml) and the test dependencies its steps use,
resolved by pip for the target's Python and platform (x86-64 Linux), so that the target
installs them with no index and no resolver of its own. What a CUDA image carries
(``--skip``: torch, and numpy and matplotlib, which torch's builds are made against) is left
out, even where a dependency asks for it.

It ends by printing the line that installs them on the target and puts them and this
checkout on its path::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
    export PYTHONPATH=/tmp/site:$PWD

``python tools/gpu_check.py --rehearse`` runs the steps without CUDA: with the wheels
installed the same way here (``--python`` this interpreter's version), it shows what an
import or a launch would lack before any time on the GPU host is spent.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the test dependencies (pyproject's "test" extra) that gpu_check's steps import
GPU_CHECK_TEST_NEEDS = (
    "expecttest",  # torch's RPC test classes (the --compat step)
    "pytest",
    "pytest-timeout",
    "nbval",
    "nbclient",
    "nbformat",
    "psutil",
)
#: left out by default: what a CUDA PyTorch host has, built together
DEFAULT_SKIP = ("torch", "numpy", "matplotlib")
#: x86-64 Linux wheels, newest glibc first; pip matches each tag exactly
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {dir}/*.whl"
    " && export PYTHONPATH=/tmp/site:$PWD"
)


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


def requirements(skip: tuple[str, ...] = DEFAULT_SKIP) -> list[str]:
    """What the target needs, as pyproject.toml asks for it, less what it has."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    skipped = {canonical(name) for name in skip}
    wanted = {canonical(name) for name in GPU_CHECK_TEST_NEEDS}
    chosen = [r for r in project["dependencies"] if requirement_name(r) not in skipped]
    chosen += [r for r in project["optional-dependencies"]["test"] if requirement_name(r) in wanted]
    return chosen


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (its name's first part)."""
    return canonical(path.name.split("-", 1)[0])


def download(out: Path, python: str, reqs: list[str]) -> None:
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
         python, "--implementation", "cp", *platforms, "-d", str(out), *reqs],
        check=True,
    )  # fmt: skip


def prune(out: Path, skip: tuple[str, ...]) -> list[Path]:
    """Remove the skipped distributions' wheels (dependencies may have pulled them in)."""
    skipped = {canonical(name) for name in skip}
    removed = [path for path in out.glob("*.whl") if wheel_name(path) in skipped]
    for path in removed:
        path.unlink()
    return removed


def twice(out: Path) -> list[str]:
    """Distributions with two wheels in ``out``: a --no-deps install of both fails."""
    names = [wheel_name(path) for path in out.glob("*.whl")]
    return sorted({name for name in names if names.count(name) > 1})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="where the wheels go (e.g. .whl, ignored by git)")
    parser.add_argument("--python", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument(
        "--skip",
        default=",".join(DEFAULT_SKIP),
        help="distributions the target has (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    skip = tuple(name for name in args.skip.split(",") if name)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    download(out, args.python, requirements(skip))
    removed = prune(out, skip)
    doubled = twice(out)
    wheels = sorted(out.glob("*.whl"))
    size = sum(path.stat().st_size for path in wheels) / 2**20
    print(f"{len(wheels)} wheels for Python {args.python}, {size:.1f} MiB, in {out}")
    if removed:
        print("left out (the target has them): " + ", ".join(p.name for p in removed))
    if doubled:
        print("two versions of " + ", ".join(doubled) + ": keep one of each, then install")
        return 1
    print("on the target, from this checkout's root:\n  " + INSTALL.format(dir=args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
