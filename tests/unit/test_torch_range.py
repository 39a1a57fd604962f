"""The torch releases nbrpc supports: stated once in the seam, and the same in the Makefile
and pyproject.toml; a torch outside them gets one line at import, never a refusal."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from nbrpc._torch import versions

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _makefile(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"the Makefile sets no {name}"
    return match.group(1)


def test_the_makefile_pyproject_and_the_seam_state_one_range():
    oldest, newest = (
        versions.spelled(versions.OLDEST_TESTED),
        versions.spelled(versions.NEWEST_TESTED),
    )
    assert _makefile("TORCH_OLDEST") == oldest
    assert _makefile("TORCH_NEWEST") == newest
    own = versions.release(_makefile("VENV_TORCH"))
    assert versions.in_tested_range(own), ".venv's own torch is outside the supported range"
    pyproject = (ROOT / "pyproject.toml").read_text()
    (requirement,) = re.findall(r'"torch([<>=!~,.\d]*)"', pyproject)
    low = ".".join(oldest.split(".")[:2]) if oldest.endswith(".0") else oldest
    assert requirement == f">={low},<={newest}", (
        f"pyproject.toml asks for torch{requirement}: it must admit exactly the tested "
        f"releases, torch>={low},<={newest}"
    )


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("2.14.1", (2, 14, 1)),
        ("2.14.1+cu130", (2, 14, 1)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.11", (2, 11, 0)),
        ("2.15.0a0+git1a2b3c", (2, 15, 0)),
        ("nonsense", (0, 0, 0)),
    ],
)
def test_a_torch_version_reads_as_its_release(text, release):
    assert versions.release(text) == release


@pytest.mark.parametrize(
    ("text", "inside"),
    [("2.10.0", False), ("2.11.0", True), ("2.13.0+cpu", True), ("2.14.1+cu130", True),
     ("2.14.2", False), ("2.15.0", False)],
)  # fmt: skip
def test_the_range_holds_the_tested_releases(text, inside):
    assert versions.in_tested_range(versions.release(text)) is inside


def _stderr_of_import(torch_version: str | None) -> str:
    """What ``import nbrpc`` prints on stderr, torch's version faked where given."""
    fake = f"import torch; torch.__version__ = {torch_version!r}; " if torch_version else ""
    code = fake + "import nbrpc; import sys; sys.stderr.write('imported\\n')"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def test_a_torch_outside_the_range_gets_one_line_at_import_and_still_imports():
    lines = [line for line in _stderr_of_import("2.15.0").splitlines() if "nbrpc" in line]
    assert len(lines) == 1, lines
    (line,) = lines
    assert "TorchVersionWarning" in line
    assert "torch 2.15.0" in line
    oldest, newest = versions.OLDEST_TESTED, versions.NEWEST_TESTED
    assert f"tested with torch {versions.spelled(oldest)} to {versions.spelled(newest)}" in line


def test_a_torch_inside_the_range_imports_without_a_word():
    assert _stderr_of_import(None).strip() == "imported"
