"""One comparison of two runs' ``metrics.jsonl`` rows for the resume and equivalence tests."""

from __future__ import annotations

from typing import Any

import pytest

VOLATILE = ("time/", "tokens_per_s/", "cpu_s/")
"""Metric prefixes that measure the machine, not the run (left out of comparisons): wall and
CPU seconds, rates."""


def stable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the volatile metrics."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def assert_same_metrics(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """The same steps with the same metric keys and values (rel 1e-4, abs 1e-6); a NaN metric
    (e.g. a summary rate with no episode in its bucket) is written as null and must be null in
    both."""
    a, b = stable(ref), stable(got)
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            if ra[k] is None:
                assert rb[k] is None, (ra["step"], k)
                continue
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6, nan_ok=True), (ra["step"], k)
