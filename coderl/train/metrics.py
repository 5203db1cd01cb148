"""Metrics logging: one JSON line per step (``metrics.jsonl``), evaluation lines
(``eval.jsonl``) and the same scalars in TensorBoard (``tb/``); the progress bar with ETA is
:mod:`coderl.progress`.

On resume the JSONL files (with the pipeline's ``audit.jsonl``) are cut back to the checkpoint's step, so a resumed run's files equal
an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

AUDIT_FILE = "audit.jsonl"
"""The audit log of a run directory (written by :mod:`coderl.eval.observers`); the logger cuts
it on resume like the metrics."""


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    path.write_text("".join(line + "\n" for line in keep))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file ([] when it does not exist)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes step metrics and evaluations of one run.

    Args:
        run_dir: the run directory.
        resume_step: the checkpoint step a resumed run starts from (0 for a new run); later
            records are dropped from the files.
        tensorboard: also write TensorBoard scalars.
    """

    def __init__(self, run_dir: str | Path, *, resume_step: int = 0, tensorboard: bool = True):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        audit = self.dir / AUDIT_FILE  # written by the pipeline, cut on resume like the rest
        if resume_step == 0:
            for p in (self.metrics_path, self.eval_path, audit):
                p.unlink(missing_ok=True)
        for p in (self.metrics_path, self.eval_path, audit):
            _truncate_jsonl(p, resume_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics (NaN and inf are written as null)."""
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def log_eval(self, step: int, result: dict[str, Any]) -> None:
        """Append one evaluation (an :class:`coderl.eval.EvalResult` as a dict)."""
        with self.eval_path.open("a") as f:
            f.write(json.dumps({"step": step, **result}) + "\n")
        if self.tb is not None:
            for k, est in result["pass_at"].items():
                self.tb.add_scalar(f"eval/pass@{k}", est["mean"], step)
            self.tb.add_scalar("eval/best_of_n", result["best_of_n"]["mean"], step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
