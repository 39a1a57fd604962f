"""The one summary every benchmark reports (median, p90 and count of its samples), and
the one way a single peer is timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "n": len(ordered),
    }


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls (the
    first calls also set up connections, channels and kernels)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples
