"""The collapse alarm: pass@k at the largest k against the best earlier held-out evaluation
(:func:`coderl.eval.passk.collapse_check`), worked by hand, and wired through ``coderl train``
(metrics JSONL, TensorBoard, the warning, the report)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from coderl.config import load_config
from coderl.eval.passk import collapse_check
from coderl.eval.report import write_report
from coderl.metrics import read_jsonl
from coderl.train import loop

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"


def _rec(step, correct, n=4, phase=None):
    per_task = [{"task_id": f"t{i}", "n": n, "correct": c} for i, c in enumerate(correct)]
    return {"step": step, "per_task": per_task, **({"phase": phase} if phase else {})}


def test_a_fall_of_every_task_raises_the_alarm_against_the_best_earlier_evaluation():
    # pass@4 with n = 4: 1 if the task was solved at all. Step 0: 4 of 4 tasks (1.0); step 2:
    # 3 of 4 (0.75); step 4: none. The best is step 0; every task changes by -1, so every
    # bootstrap resample's mean is -1 and the CI is [-1, -1]: its upper end is below 0.
    earlier = [_rec(0, [4, 4, 4, 4], phase="sft"), _rec(2, [4, 4, 4, 0])]
    check = collapse_check(earlier, _rec(4, [0, 0, 0, 0]))
    assert check is not None and check.alarm
    assert (check.k, check.best_step, check.drop) == (4, 0, 1.0)
    assert (check.change.lo, check.change.hi) == (-1.0, -1.0)


def test_a_flat_run_or_a_fall_inside_the_ci_does_not_raise_it():
    earlier = [_rec(0, [4, 1, 0, 2], phase="start")]
    flat = collapse_check(earlier, _rec(2, [4, 1, 0, 2]))
    assert flat is not None and not flat.alarm and flat.drop == 0.0
    assert flat.change.hi == 0.0  # the rule is "below 0", so no change is no alarm
    # one task of four falls from 1 to 0: the paired differences are [-1, 0, 0, 0] (mean
    # -0.25); a resample without the -1 has probability (3/4)^4 = 0.32 > 0.025, so the CI's
    # upper end is 0: a drop of 0.25, not beyond its CI, raises nothing
    one = collapse_check(earlier, _rec(2, [0, 1, 0, 2]))
    assert one is not None and not one.alarm and one.drop == 0.25 and one.change.hi == 0.0
    # half of 20 tasks fall from 1 to 0: the CI of the mean -0.5 is far from 0
    half = collapse_check([_rec(0, [4] * 20)], _rec(1, [0] * 10 + [4] * 10))
    assert half is not None and half.alarm and half.drop == 0.5 and half.change.hi < 0


def test_k_is_the_smallest_n_and_the_base_model_is_no_reference():
    # the earlier evaluation has n = 2, so k = 2. With n = 4 and 1 correct, pass@2 =
    # 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; with n = 2 and 1 correct it is 1 - C(1,2)/C(2,2) = 1.
    check = collapse_check([_rec(0, [1, 1, 1], n=2)], _rec(3, [1, 1, 1], n=4))
    assert check is not None and check.k == 2 and check.drop == 0.5 and check.alarm
    assert collapse_check([_rec(0, [4, 4], phase="base")], _rec(1, [0, 0])) is None
    assert collapse_check([], _rec(1, [0, 0])) is None
    # of two equal best evaluations the first is the reference
    tie = collapse_check([_rec(0, [4, 0], phase="sft"), _rec(2, [0, 4])], _rec(4, [4, 4]))
    assert tie is not None and tie.best_step == 0 and tie.drop == -0.5 and not tie.alarm
    with pytest.raises(ValueError, match="same distinct tasks"):
        collapse_check([_rec(0, [4, 4, 4])], _rec(1, [4, 4]))


def _run(tmp_path, monkeypatch, correct_at):
    """A 3-step toy run with a held-out evaluation every step whose per-task counts are
    replaced by ``correct_at(step)`` (the manipulated evaluation the alarm must see)."""
    real = loop.run_eval

    def scripted(run, *a, **kw):
        rec = real(run, *a, **kw)
        for t in rec["per_task"]:
            t["correct"] = correct_at(run.step)
        return rec

    monkeypatch.setattr(loop, "run_eval", scripted)
    cfg = load_config(
        TOY,
        [
            f"run_dir={tmp_path}",
            "progress=false",
            "trainer.steps=3",
            "trainer.checkpoint_every=3",
            "tasks.tasks_per_step=1",
            "rollout.group_size=2",
            "eval.every=1",
            "eval.tasks=6",
            "eval.samples=2",
            "eval.k=[1,2]",
        ],
    )
    loop.train(cfg)
    return read_jsonl(tmp_path / "metrics.jsonl")


def _tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_forced_collapse_raises_the_alarm_in_a_run_and_a_flat_run_does_not(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="coderl.train")
    rows = _run(tmp_path / "fall", monkeypatch, lambda step: 2 if step < 2 else 0)
    alarm = {r["step"]: r.get("eval/collapse_alarm") for r in rows}
    assert alarm == {1: 0.0, 2: 1.0, 3: 1.0}  # step 0 (start) is the best: solved, then not
    assert [r["eval/collapse_drop"] for r in rows] == [0.0, 1.0, 1.0]
    assert _tensorboard(tmp_path / "fall", "eval/collapse_alarm") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    warned = [r.getMessage() for r in caplog.records if "collapse alarm" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("collapse alarm at step 2: held-out pass@2")
    evals = read_jsonl(tmp_path / "fall" / "eval.jsonl")
    assert [e.get("collapse", {}).get("alarm") for e in evals] == [None, False, True, True]
    html = write_report(tmp_path / "fall").read_text()
    assert "RAISED at step 2, 3 of 3 checks" in html and "COLLAPSE ALARM: pass@2 -1.000" in html

    caplog.clear()
    flat = _run(tmp_path / "flat", monkeypatch, lambda step: 1)
    assert [r["eval/collapse_alarm"] for r in flat] == [0.0, 0.0, 0.0]
    assert not [r for r in caplog.records if "collapse alarm" in r.getMessage()]
    assert "not raised in 3 checks" in write_report(tmp_path / "flat").read_text()
    json.dumps(flat)  # plain data
