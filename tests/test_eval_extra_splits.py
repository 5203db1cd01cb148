"""``eval.extra_splits``: a further split (the repair demo's kept-back ``outside`` set) is
evaluated beside the held-out split at the start and after the last step, logged apart
(``eval_extra.jsonl``), reported with its own paired RL-only change, and never trained on. The toy
source's ``n_outside`` option gives it such a split (tiny random model, seconds)."""

from __future__ import annotations

import json

import pytest

from coderl.cli.demo import DEFAULT_CONFIG, run_demo
from coderl.config import ConfigError, load_config

TOY = DEFAULT_CONFIG.parent / "toy.yaml"
QUICK = ["trainer.steps=2", "tensorboard=false", "progress=false"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_extra_split_is_evaluated_reported_apart_and_never_trained_on(
    tmp_path, monkeypatch, capsys
):
    import coderl.train.loop as loop

    trained: list[str] = []  # every task a training round rolled out
    original = loop.rollout_round

    def spy(run, drawn, seed, stats):
        trained.extend(task.id for _, task in drawn)
        return original(run, drawn, seed, stats)

    monkeypatch.setattr(loop, "rollout_round", spy)
    run_dir = tmp_path / "toy"
    over = [f"run_dir={run_dir}", *QUICK, "tasks.options.n_outside=4"]
    assert run_demo(TOY, [*over, "eval.extra_splits=[outside]"]) == 0
    out = capsys.readouterr().out

    extra = _records(run_dir / "eval_extra.jsonl")
    assert [(e["split"], e.get("phase"), e["step"]) for e in extra] == [
        ("outside", "start", 0),
        ("outside", None, 2),
    ]
    outside = {f"toy/outside/{i}" for i in range(200, 204)}
    for e in extra:
        assert {row["task_id"] for row in e["per_task"]} == outside
        assert e["samples"] == 4 and e["time_s"] > 0
    held = _records(run_dir / "eval.jsonl")  # the held-out records alone, as before
    assert [e.get("phase") for e in held] == ["start", None]
    assert all(row["task_id"].startswith("toy/heldout/") for e in held for row in e["per_task"])
    assert trained and all(t.startswith("toy/train/") for t in trained), set(trained)

    from coderl.eval.summary import read_extra_evals, summary_lines

    rows = dict(summary_lines(held, extra=read_extra_evals(run_dir)))
    assert rows["outside split: RL only: pass@1 change (paired, 95% CI)"]
    assert "RL only: pass@1 change (paired, 95% CI)" in rows  # the held-out one, apart
    assert "(n=4, T=0.8)" in rows["outside split: pass@1, start"]
    assert "eval outside start" in rows["phase times"]
    assert "outside split apart" in out and "outside split:" in out  # printed by the demo
    page = (run_dir / "report" / "index.html").read_text()
    assert "outside split: RL only: pass@1 change" in page


def test_without_extra_splits_nothing_else_is_evaluated(tmp_path):
    from coderl.train.loop import train

    cfg = load_config(TOY, [f"run_dir={tmp_path / 'r'}", *QUICK, "tasks.options.n_outside=4"])
    run_dir = train(cfg)
    assert not (run_dir / "eval_extra.jsonl").exists()


@pytest.mark.parametrize(
    "splits", ["[heldout]", "[train]", "[outside, outside]"], ids=["heldout", "train", "twice"]
)
def test_extra_splits_name_neither_the_training_nor_the_heldout_split(splits):
    with pytest.raises((ConfigError, ValueError), match="eval.extra_splits"):
        load_config(TOY, [f"eval.extra_splits={splits}"])


def test_a_missing_extra_split_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import coderl.train.run as run_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_module, "build_policy", no_model)
    cfg = load_config(TOY, [f"run_dir={tmp_path / 'r'}", *QUICK, "eval.extra_splits=[outside]"])
    with pytest.raises(ValueError, match=r"^eval.extra_splits: unknown toy split 'outside'"):
        run_module.setup_run(cfg, load_sft=False)
