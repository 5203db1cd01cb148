"""Held-out evaluations inside a training run, shared by ``coderl train``'s loop
(:mod:`coderl.train.loop`) and ``coderl train-async`` (:mod:`coderl.asyncrl.trainer`): logging
one with its collapse alarm, evaluating the further splits of ``eval.extra_splits`` beside it
(:func:`log_extra_evals`), and running without them when the task source has no held-out split.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from coderl.eval.passk import collapse_check
from coderl.metrics import MetricsLogger, read_jsonl
from coderl.train.run import Run, run_eval

log = logging.getLogger(__name__)


def log_eval_with_alarm(
    logger: MetricsLogger, step: int, record: dict[str, Any]
) -> dict[str, float]:
    """Log a held-out evaluation made during RL with its collapse alarm
    (:func:`coderl.eval.passk.collapse_check` against the run's earlier evaluations, read back
    from ``eval.jsonl`` so a resumed run compares with the same ones): the record gains
    ``collapse`` (the check as a dict), a raised alarm logs one warning line, and the step's
    metrics get ``eval/collapse_alarm`` (1 or 0) and ``eval/collapse_drop`` (returned; {} when
    there is no earlier evaluation)."""
    check = collapse_check(read_jsonl(logger.eval_path), record)
    if check is None:
        logger.log_eval(step, record)
        return {}
    if check.alarm:
        c = check.change
        log.warning(
            "collapse alarm at step %d: held-out pass@%d fell %.3f below step %d's "
            "(paired change %+.3f, 95%% CI [%+.3f, %+.3f])",
            step, check.k, check.drop, check.best_step, c.mean, c.lo, c.hi,
        )  # fmt: skip
    logger.log_eval(step, {**record, "collapse": check.to_dict()})
    return {"eval/collapse_alarm": float(check.alarm), "eval/collapse_drop": check.drop}


def without_heldout_evals(run: Run) -> None:
    """A run whose task source has no held-out tasks (a user's own synthesised tasks, all
    ``train``) trains without held-out evaluations, saying so in one line, rather than failing
    after the model loaded; ``run.cfg`` is changed only when evaluations were configured."""
    cfg = run.cfg
    if not (cfg.eval.before_after or cfg.eval.every):
        return
    try:
        heldout = run.env.tasks(cfg.tasks.heldout_split)
    except KeyError:
        heldout = []
    if heldout:
        return
    print(
        f"train: tasks.heldout_split={cfg.tasks.heldout_split!r} holds no tasks of "
        f"tasks.source={cfg.tasks.source!r}: training without held-out evaluations (mark some "
        "tasks split=heldout, or evaluate later with coderl eval RUN tasks=SOURCE:SPLIT)",
        file=sys.stderr,
        flush=True,
    )
    off = cfg.eval.model_copy(update={"before_after": False, "every": 0})
    run.cfg = cfg.model_copy(update={"eval": off})


def log_extra_evals(run: Run, logger: MetricsLogger, step: int, phase: str | None = None) -> None:
    """Evaluate each split of ``eval.extra_splits`` as the held-out split is evaluated
    (:func:`coderl.train.run.run_eval`: the same ``eval.tasks``, samples and seeds) and log it to
    ``eval_extra.jsonl`` with its ``split`` (and ``phase``, as the held-out record beside it:
    ``sft`` or ``start`` before RL, none after). Called at the start and after the last step,
    so each split gets its own paired RL-only change; nothing in the run reads these records
    (no collapse check, no task of theirs reaches the sampler)."""
    for split in run.cfg.eval.extra_splits:
        record = run_eval(run, split)
        logger.log_eval(step, {**record, **({"phase": phase} if phase else {})}, split=split)
