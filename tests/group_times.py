"""Where the suite's time goes: the seconds of each xdist group (a module, or the fake
hosts' modules together), setup, call and teardown summed, printed at the session's end.

On two workers a group's seconds are also the time it holds its worker, so the longest
groups bound the run (``conftest._LONG_FIRST`` starts them first). tests/README.md keeps
the table of a fresh clone's run; a test added later comes with its cost. Every test's
seconds by phase go to ``build/test-seconds.jsonl`` too, a line per pytest run (``make
test`` starts it anew), to find where a group's time goes without a second run."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest


class GroupTimes:
    """Summed seconds by group, from every test report (on xdist, the controller's)."""

    def __init__(self, group_of: Callable[[str], str], out: Path, shown: int = 15) -> None:
        self.group_of = group_of
        self.out = out
        self.shown = shown
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, dict[str, float]] = defaultdict(dict)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[self.group_of(report.nodeid)] += report.duration
        self.tests[report.nodeid][report.when] = round(report.duration, 2)

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
        if not self.seconds:
            return
        total = sum(self.seconds.values())
        by_test = {
            test: {"group": self.group_of(test), "seconds": round(sum(ph.values()), 2), **ph}
            for test, ph in sorted(self.tests.items(), key=lambda kv: -sum(kv[1].values()))
        }
        run = {"python": sys.executable, "args": list(config.invocation_params.args)}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("a") as out:
            out.write(json.dumps({**run, "seconds": round(total, 1), "tests": by_test}) + "\n")
        terminalreporter.section(f"seconds by group ({total:.0f} s in all)", sep="=")
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        for group, seconds in ranked[: self.shown]:
            terminalreporter.write_line(f"{seconds:8.1f}  {group}")
        rest = ranked[self.shown :]
        if rest:
            rest_s = sum(s for _, s in rest)
            terminalreporter.write_line(f"{rest_s:8.1f}  ({len(rest)} other groups)")
