"""Metrics logging: one JSON line per step (``metrics.jsonl``), evaluation lines
(``eval.jsonl``; those of ``eval.extra_splits`` in ``eval_extra.jsonl``), the same scalars in
TensorBoard (``tb/``) and, with ``logging.wandb.enabled``, in Weights & Biases (every step's
metrics under the JSONL's keys, NaN kept as NaN; evaluations as ``eval/pass@k`` and
``eval/best_of_n``, as in TensorBoard); the progress bar with ETA is :mod:`coderl.progress`.

On resume the JSONL files (with the pipeline's ``audit.jsonl``) are cut back to the checkpoint's
step, so a resumed run's files equal an uninterrupted run's; the TensorBoard event files lose the
later steps too (:func:`_truncate_tb`). A W&B run cannot be cut back: a resumed run logs to a new W&B run named
``NAME-resume-STEP`` in the group ``NAME``, starting after the checkpoint's step, and the first
W&B run keeps whatever the interrupted process logged after that checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coderl.stats import NothingMeasured

if TYPE_CHECKING:
    from coderl.config import Config
    from coderl.config.tracking import WandbConfig

log = logging.getLogger("coderl.train")  # the step alarms' warnings, as before the move

SFT_LOG = "sft/metrics.jsonl"
"""Where ``coderl sft`` logs each batch (``step``: the batch, from 1; ``epoch``; ``nll``: the
mean negative log-likelihood per assistant token; ``trained_tokens``: the assistant tokens;
``forward_tokens``, ``forward_attended``: the work of its forwards, as in the RL step's metrics),
under the run directory."""
EXTRA_EVAL_FILE = "eval_extra.jsonl"
"""The evaluations of ``eval.extra_splits`` (each record an ``eval.jsonl`` record plus its
``split``), apart from the held-out ones so that nothing reading ``eval.jsonl`` (the summary, the
collapse check, the learning curve) mixes the splits."""
AUDIT_FILE = "audit.jsonl"
"""The audit log of a run directory (written by :mod:`coderl.eval.observers`); the logger cuts
it on resume like the metrics."""


def cpu_clock() -> tuple[float, float, float]:
    """``(wall, self, children)`` seconds for timing a span by difference: ``time.perf_counter``,
    this process's CPU time over all its threads (``time.process_time``), and the CPU time of
    its child processes that have ended and been waited for (``getrusage(RUSAGE_CHILDREN)``,
    user + system; a sandbox's processes count once the sandbox closes; a child still running,
    such as the synthesis worker, counts only when it is reaped)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time(), ch.ru_utime + ch.ru_stime


def add_cpu_since(
    stats: dict[str, float], name: str, start: tuple[float, float, float]
) -> dict[str, float]:
    """Add the span since ``start`` (a :func:`cpu_clock` reading) to ``stats``:
    ``cpu_s/<name>`` (this process's CPU seconds) and ``cpu_s/<name>_children`` (its reaped
    children's); returns ``stats``. The wall time of a span stays under ``time/<name>``."""
    _, cpu, children = cpu_clock()
    for key, value in ((name, cpu - start[1]), (f"{name}_children", children - start[2])):
        stats[f"cpu_s/{key}"] = stats.get(f"cpu_s/{key}", 0.0) + value
    return stats


MASK_HINTS: tuple[tuple[str, str], ...] = (
    (
        "no built environment matches",
        "repository tasks need their environments built first: coderl tasks build-env",
    ),
    (
        "never called the model",
        "the agent program (tasks.options.program) never called the model: run it by hand "
        "to see why (docs/harness-byo.md)",
    ),
    (
        "exceeds context_budget",
        "the prompt does not fit the context window: raise rollout.max_context_tokens or "
        "lower rollout.max_new_tokens",
    ),
)
"""(text of a mask reason, what to do about it): the one list of known causes of masked
episodes; :func:`masked_hint` picks the hints of the causes present."""


def masked_hint(reasons: list[str]) -> str:
    """What to do about the masked episodes whose reasons (``failure_reason``, grading errors)
    are ``reasons``: the hint of each known cause among them (:data:`MASK_HINTS`), joined by
    ``"; "``, in their order there; ``""`` when no reason is a known cause."""
    return "; ".join(hint for cause, hint in MASK_HINTS if any(cause in r for r in reasons))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def reward_metrics(infos: list[dict[str, Any]], terms: Iterable[str]) -> dict[str, float]:
    """``reward/mean``, ``reward/std`` (population), ``reward/<term>`` for each of ``terms`` and
    ``resolved_rate`` over the valid (unmasked) episodes of ``infos`` (per-episode dicts of
    :func:`coderl.train.pipeline.episode_info`; NaN without one), and ``measured_episodes``,
    their count: one definition for every step, whatever dynamic sampling then drops."""
    valid = [x for x in infos if x["valid"]]
    totals = [float(x["total"]) for x in valid]
    mean = _mean(totals)
    m = {
        "reward/mean": mean,
        "reward/std": math.sqrt(_mean([(t - mean) ** 2 for t in totals])),
        "resolved_rate": _mean([float(x["resolved"]) for x in valid]),
        "measured_episodes": float(len(valid)),
    }
    for name in terms:
        m[f"reward/{name}"] = _mean([x["breakdown"][name] for x in valid if name in x["breakdown"]])
    return m


def check_step_measured(step: int, infos: list[dict[str, Any]]) -> None:
    """Fail the run when every episode a step rolled out was masked: a prompt too long for the
    context window, environments that are not built, a broken sandbox mask every episode the
    same way at every step, and the run would train on nothing and end as if it had worked.

    Args:
        step: the step's number as users see it (from 1: the step lines, ``metrics.jsonl``).

    Raises:
        coderl.stats.NothingMeasured: no episode of the step was valid (names the reasons, and
            what to do where the cause is known: :func:`masked_hint`).
    """
    if not infos or any(x["valid"] for x in infos):
        return
    reasons = sorted({str(x.get("failure_reason") or x.get("failure") or "?") for x in infos})
    hint = masked_hint(reasons)
    raise NothingMeasured(
        f"step {step}: all {len(infos)} episodes were masked, nothing to train on; "
        f"reasons: {'; '.join(reasons[:3])}" + (f" ({hint})" if hint else "")
    )


def step_alarm(
    m: dict[str, float], name: str, share: float, knob: str, limit: float, detail: Callable[[], str]
) -> None:
    """Sets the step alarm ``name`` in the step metrics ``m``: ``alarm/<name>`` is 1 (and a warning names ``knob`` and
    ``detail()``) when ``share`` is above ``limit``, else 0."""
    on = share > limit
    m[f"alarm/{name}"] = float(on)
    if on:
        log.warning("%s share %.3f above %s=%g (%s)", name, share, knob, limit, detail())


REPORTED_DIGITS = 12
"""Significant digits of a float in the JSON a user reads (:func:`reported`)."""


def reported(value: Any) -> Any:
    """``value`` with every finite float rounded to :data:`REPORTED_DIGITS` significant digits,
    through dicts, lists and tuples: what a metric, evaluation or report file holds, so that a
    sum's binary noise (``0.30000000000000004``, ``3.0464139999999995``) is not printed as
    digits. Not for checkpoints or state a resume needs exact."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{REPORTED_DIGITS}g}")
    if isinstance(value, dict):
        return {k: reported(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [reported(v) for v in value]
    return value


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the records of ``path`` up to ``last_step``. A last line cut short (the writer was
    killed in it) is dropped: no checkpoint can follow a record that was never whole."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    keep = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def _truncate_tb(tb_dir: Path, last_step: int) -> None:
    """Drop every event after ``last_step`` from the TensorBoard event files in ``tb_dir``, so a
    resumed run shows each step once in any reader. ``SummaryWriter(purge_step=...)`` alone
    hides them only from readers that honour its restart marker (the Python event
    accumulator); ``summary_iterator`` and tools built on it showed both.

    The files are TFRecords (``uint64`` length, its masked CRC32C, the ``Event`` proto, the
    proto's masked CRC32C; TensorFlow's ``tfrecord`` format): kept records are copied byte for
    byte. A file cut short or damaged (a killed writer) keeps its records before the damage."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else []:
        data, kept, at = path.read_bytes(), bytearray(), 0
        while at + 12 <= len(data):
            size = int.from_bytes(data[at : at + 8], "little")
            end = at + 12 + size + 4
            if end > len(data):
                break
            try:
                step = Event.FromString(data[at + 12 : at + 12 + size]).step
            except DecodeError:  # a damaged record: keep what came before it
                break
            if step <= last_step:
                kept += data[at:end]
            at = end
        if len(kept) < len(data):
            path.write_bytes(bytes(kept))


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
        wandb: W&B settings (None or not ``enabled``: no W&B run).
        config: the run's config as a dict, recorded as the W&B run's config.

    Raises:
        ImportError: W&B is enabled and the ``wandb`` package is missing (says how to install it).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_step: int = 0,
        tensorboard: bool = True,
        wandb: WandbConfig | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        self.extra_eval_path = self.dir / EXTRA_EVAL_FILE
        audit = self.dir / AUDIT_FILE  # written by the pipeline, cut on resume like the rest
        logs = (self.metrics_path, self.eval_path, self.extra_eval_path, audit)
        if resume_step == 0:
            for p in logs:
                p.unlink(missing_ok=True)
        for p in logs:
            _truncate_jsonl(p, resume_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if resume_step:
                _truncate_tb(self.dir / "tb", resume_step)
            self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_step + 1)
        self.wandb = None
        if wandb is not None and wandb.enabled:
            self.wandb = _wandb_run(wandb, self.dir, resume_step, config or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics, :func:`reported` in every sink (NaN and inf are written as
        null to the JSONL)."""
        metrics = reported(metrics)
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)

    def log_eval(self, step: int, result: dict[str, Any], split: str | None = None) -> None:
        """Append one evaluation (an :class:`coderl.eval.EvalResult` as a dict): a held-out one
        to ``eval.jsonl`` (scalars ``eval/pass@k``), one of another ``split``
        (``eval.extra_splits``) to ``eval_extra.jsonl`` with ``split`` in the record (scalars
        ``eval/<split>/pass@k``)."""
        path, prefix, result = self.eval_path, "eval", reported(result)
        if split is not None:
            path, prefix, result = self.extra_eval_path, f"eval/{split}", {"split": split, **result}
        with path.open("a") as f:
            f.write(json.dumps({"step": step, **result}) + "\n")
        scalars = {f"{prefix}/pass@{k}": est["mean"] for k, est in result["pass_at"].items()}
        scalars[f"{prefix}/best_of_n"] = result["best_of_n"]["mean"]
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def run_logger(cfg: Config, resume_step: int) -> MetricsLogger:
    """The :class:`MetricsLogger` of a training run (``coderl train`` and ``train-async``): its
    ``run_dir``, TensorBoard and W&B as ``cfg`` says, the config recorded in W&B."""
    return MetricsLogger(
        cfg.run_dir,
        resume_step=resume_step,
        tensorboard=cfg.tensorboard,
        wandb=cfg.logging.wandb,
        config=cfg.model_dump(by_alias=True, mode="json"),
    )


def wandb_settings(settings: WandbConfig) -> tuple[str, str]:
    """``(project, mode)`` of the W&B run: the config's when it sets them, else
    ``$WANDB_PROJECT`` / ``$WANDB_MODE`` (what a W&B user already exports), else ``coderl`` and
    ``offline``."""
    project = settings.project or os.environ.get("WANDB_PROJECT") or "coderl"
    return project, settings.mode or os.environ.get("WANDB_MODE") or "offline"


def _wandb_run(
    settings: WandbConfig, run_dir: Path, resume_step: int, config: dict[str, Any]
) -> Any:
    """Start the W&B run (see the module docstring for resumed runs); its files go to
    ``$WANDB_DIR`` when set, else ``run_dir``."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "logging.wandb.enabled needs the wandb package: pip install 'coderl[wandb]'"
        ) from e
    name = settings.name or run_dir.resolve().name
    project, mode = wandb_settings(settings)
    return wandb.init(
        project=project,
        mode=mode,
        dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
        name=f"{name}-resume-{resume_step}" if resume_step else name,
        group=name,
        config=config,
        reinit="create_new",
    )
