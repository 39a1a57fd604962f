"""tools/hang_watchdog.py: the session's per-test hang watchdog fires on every arm, also one
that arrives in the same read as the previous test's disarm."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "hang_watchdog.py"


def test_an_arm_that_comes_with_the_last_disarm_still_fires():
    """A test's ``disarm`` and the next one's ``arm`` often reach the pipe together; the
    watchdog once read only the first of them and stayed disarmed through a 20-minute
    deadlock (a fresh run on two workers)."""
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watchdog = subprocess.Popen(
        [sys.executable, str(TOOL), str(stuck.pid)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watchdog.stdin is not None
        watchdog.stdin.write("arm 60 earlier_test\ndisarm\narm 0.5 tests/x.py::stuck\n")
        watchdog.stdin.flush()
        t0 = time.monotonic()
        assert stuck.wait(timeout=60) != 0  # killed, not ended by itself
        assert time.monotonic() - t0 < 60
        _, said = watchdog.communicate(timeout=30)
        assert "HANG: tests/x.py::stuck outlived its deadline" in said
    finally:
        stuck.kill()
        watchdog.kill()
        stuck.wait()
        watchdog.wait()
