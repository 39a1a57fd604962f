"""The one summary every benchmark reports: median, p90 and count of its samples."""

from __future__ import annotations

import statistics


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "n": len(ordered),
    }
