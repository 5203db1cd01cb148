"""Environment building as a measured pipeline: many repositories, a bounded number at a time,
one JSONL ledger row per finished repository, resumable after a kill.

``build_many(specs, build, ledger)`` runs ``build(spec)`` for every spec that has no finished row
in the ledger yet, at most ``jobs`` at a time (threads: the builds themselves run in sandbox
processes). Each finished build appends one row (``status`` ``built`` or ``failed``; see
:func:`row_of` for the fields), flushed and fsynced under a lock, so a kill loses at most the
builds in flight: a restart builds those again and no finished one twice. A row cut short by the
kill (a torn last line) is ignored when the ledger is read. A ``started`` row is written when a
build begins, so the ledger also shows what a killed run was doing.

Not handled: two processes sharing one ledger (each would build the same pending specs), and
builds that hang (the sandbox's own limits bound each command, not a whole build).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coderl.envbuild.build import BuildError
from coderl.tasks.env import EnvRecord

FINAL = ("built", "failed")


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """Every complete row of the ledger, in order (a torn or blank line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a killed run
        if isinstance(row, dict) and "spec" in row:
            rows.append(row)
    return rows


def finished(path: str | Path) -> dict[str, dict[str, Any]]:
    """Spec -> its last finished row (``built`` or ``failed``)."""
    return {r["spec"]: r for r in read_ledger(path) if r.get("status") in FINAL}


def builder_of(record: EnvRecord) -> str:
    """Which builder produced the plan that worked: ``model`` or ``rules``."""
    return "model" if record.install_plan.startswith("model[") else "rules"


def row_of(spec: str, outcome: EnvRecord | BuildError, seconds: float) -> dict[str, Any]:
    """The ledger row of one finished build: spec, status, builder, time (s), attempts (count
    and every plan tried with the step it reached), tests collected / passing / failing / flaky
    dropped, and for a failure the step and the last line of its error."""
    attempts = outcome.attempts
    row: dict[str, Any] = {
        "spec": spec,
        "time_s": round(seconds, 3),
        "attempts": len(attempts),
        "plans": [{"plan": a.get("plan"), "step": a.get("step")} for a in attempts],
        "finished_at": time.time(),
    }
    if isinstance(outcome, BuildError):
        lines = outcome.error.strip().splitlines() or ["?"]
        model = any(str(a.get("plan", "")).startswith("model[") for a in attempts)
        row |= {"status": "failed", "builder": "model" if model else "rules"}
        return row | {"step": outcome.step, "error": lines[-1][:300]}
    rec = outcome
    collected = len(rec.passing) + len(rec.failing) + len(rec.flaky)
    return row | {
        "status": "built",
        "builder": builder_of(rec),
        "env_id": rec.env_id,
        "plan": rec.install_plan,
        "tests_collected": collected,
        "passing": len(rec.passing),
        "failing": len(rec.failing),
        "flaky_dropped": len(rec.flaky),
    }


class Ledger:
    """Append-only JSONL file; each row flushed and fsynced before ``append`` returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, row: dict[str, Any]) -> None:
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def build_many(
    specs: Iterable[str],
    build: Callable[[str], EnvRecord],
    ledger: str | Path,
    *,
    jobs: int = 1,
    retry_failed: bool = False,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Build every spec without a finished ledger row; returns the rows written by this call.

    Args:
        specs: ``NAME==VERSION`` or paths; duplicates are built once.
        build: builds one spec (``build_env`` with a builder bound), raising ``BuildError``.
        ledger: the JSONL ledger; rows are appended.
        jobs: builds at a time (>= 1).
        retry_failed: build specs whose last finished row is ``failed`` again.
        log: called with each finished row (progress output).

    Raises:
        ValueError: ``jobs`` < 1.
        Whatever ``build`` raises other than ``BuildError`` (an infrastructure fault); rows of
        builds that finished before it are kept.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    done = finished(ledger)
    todo = [
        s
        for s in dict.fromkeys(specs)
        if s not in done or (retry_failed and done[s]["status"] == "failed")
    ]
    book = Ledger(ledger)
    written: list[dict[str, Any]] = []

    def one(spec: str) -> dict[str, Any]:
        book.append({"spec": spec, "status": "started", "started_at": time.time()})
        start = time.monotonic()
        outcome: EnvRecord | BuildError
        try:
            outcome = build(spec)
        except BuildError as e:
            outcome = e
        row = row_of(spec, outcome, time.monotonic() - start)
        book.append(row)
        written.append(row)
        if log is not None:
            log(row)
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(one, s) for s in todo]:
            fut.result()
    return written


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over finished rows: built, failed, built by rules / with the model, build time (s)
    summed and the rate in repositories built per hour of build time (``time_s`` summed, so
    parallel builds are not credited with the overlap); the rate is absent without build
    time (nothing finished), not 0."""
    final = [r for r in rows if r.get("status") in FINAL]
    built = [r for r in final if r["status"] == "built"]
    seconds = sum(r.get("time_s", 0.0) for r in final)
    out = {
        "repositories": len(final),
        "built": len(built),
        "failed": len(final) - len(built),
        "built_by_rules": sum(r.get("builder") == "rules" for r in built),
        "built_with_model": sum(r.get("builder") == "model" for r in built),
        "build_seconds": round(seconds, 1),
    }
    if seconds:
        out["built_per_hour"] = round(len(built) / seconds * 3600, 2)
    return out
