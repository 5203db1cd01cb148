"""A user's first day (issue 48), fifth pass: a run whose every step was skipped says so, an
incomplete checkpoint is named with the one used instead, and ``--help``/usage errors say what
the options really are. (The gateway's program that never called the model:
``tests/test_gateway.py``.)"""

import shutil
from pathlib import Path

import pytest

from coderl.cli import build_parser, main
from coderl.envs.base import GradeRecord
from coderl.envs.toy import ToyEnvironment
from coderl.metrics import read_jsonl
from coderl.train.checkpoint import list_checkpoints
from coderl.train.run import step_status

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
FAST = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.steps=2",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=5",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", TOY, *FAST, f"run_dir={run_dir}", *extra, "--no-report"])


# --- a run whose every step was skipped ---------------------------------------------------------


def _same_grade(self, tasks, episodes):
    """Every episode graded, every one the same: each group has zero reward variance."""
    return [GradeRecord(resolved=False, fraction_passed=0.0) for _ in episodes]


def test_a_run_where_no_step_updated_the_policy_ends_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ToyEnvironment, "grade", _same_grade)
    assert _train(tmp_path / "run", "dynamic_sampling.mode=drop") == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["optimizer_steps"] for r in rows] == [0.0, 0.0]
    assert all(r["dynamic/dropped_groups"] == 2 for r in rows)
    err = capsys.readouterr().err
    assert "WARNING: none of steps 1-2 updated the policy" in err, err
    assert step_status(rows[0]) == (
        "all 2 groups had zero reward variance, dropped (no update): "
        f"reward 0.000 resolved 0% of {int(rows[0]['measured_episodes'])} episodes"
    )


def test_a_run_that_updated_the_policy_has_no_such_warning(tmp_path, capsys):
    assert _train(tmp_path / "run", "trainer.steps=1") == 0
    assert "updated the policy" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("metrics", "said"),
    [
        ({"episodes": 0.0, "dynamic/dropped_groups": 4.0},
         "all 4 groups had zero reward variance, dropped (no update)"),
        ({"episodes": 8.0, "reward/masked": 8.0},
         "no episode measured (no update); 8 of 8 episodes masked"),
        ({"episodes": 8.0, "reward/masked": 8.0, "dynamic/dropped_groups": 2.0},
         "no episode measured (no update); 2 zero-variance groups dropped; 8 of 8 episodes masked"),
    ],
    ids=["all-dropped", "all-masked", "dropped-and-the-rest-masked"],
)  # fmt: skip
def test_the_step_line_says_why_nothing_was_updated(metrics, said):
    assert step_status(metrics) == said


# --- an incomplete checkpoint is named, with the one used ---------------------------------------


def _incomplete_step3(run_dir: Path) -> Path:
    """A save that did not finish: ``checkpoints/step-000003`` without its ``state.json``."""
    step2 = list_checkpoints(run_dir)[-1]
    step3 = step2.parent / "step-000003"
    shutil.copytree(step2, step3)
    (step3 / "state.json").unlink()
    return step3


def test_an_incomplete_checkpoint_is_named_with_the_one_used(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(run_dir) == 0
    capsys.readouterr()
    step2 = list_checkpoints(run_dir)[-1]
    step3 = _incomplete_step3(run_dir)
    used = f"checkpoint {step3} is incomplete (no state.json: its save did not finish)"
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    assert f"{used} and is skipped; using {step2}" in err, err
    # named itself: one line with the newest complete one
    assert main(["export", str(step3), "--out", str(tmp_path / "export2")]) == 2
    err = capsys.readouterr().err
    assert f"{used}; the newest complete one is {step2}" in err, err
    # --resume says which checkpoint it starts from, and the one it skips, in one line
    assert main(["train", "--resume", str(run_dir), "trainer.steps=3", "--no-report"]) == 0
    out = capsys.readouterr().out
    line = f"resume: from {step2} (step 2); {used} and is skipped; using {step2}"
    assert line in out.splitlines(), out
    assert list_checkpoints(run_dir)[-1] == step3  # the resumed run's own step 3, complete
    assert main(["train", "--resume", str(run_dir), "trainer.steps=4", "--no-report"]) == 0
    assert f"resume: from {step3} (step 3)" in capsys.readouterr().out.splitlines()


def test_a_run_with_only_an_incomplete_checkpoint_names_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(run_dir, "trainer.steps=1") == 0
    step1 = list_checkpoints(run_dir)[0]
    (step1 / "state.json").unlink()
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert f"no complete checkpoint under checkpoints/ ({step1} is incomplete" in err, err


# --- --help and usage errors say what the options are -------------------------------------------


def test_no_flag_shows_a_default_that_reads_as_its_opposite() -> None:
    parser = build_parser("*")
    subs = next(a for a in parser._actions if a.choices and "train" in a.choices).choices
    for name, sub in subs.items():
        text = sub.format_help()
        assert "(default: True)" not in text and "(default: False)" not in text, name
    assert "skip the report\n" in subs["train"].format_help()


@pytest.mark.parametrize("command", ["serve", "sft"])
def test_a_missing_config_does_not_call_the_overrides_required(command, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([command])
    usage, error = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "CONFIG [OVERRIDES ...]" in usage
    assert "missing CONFIG" in error and "OVERRIDES" not in error, error
