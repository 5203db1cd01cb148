"""Mined preference pairs keep the task split (held-out pairs never train), and the learned
grader preset instantiates and trains on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from coderl.graders.judge import EpisodeView
from coderl.graders.mine import mine_pairs, task_split, write_pairs
from coderl.graders.pairs import pairs_from_jsonl, write_episodes
from coderl.graders.rm import split_pairs
from coderl.tasks.humaneval import split_of

ROOT = Path(__file__).parent.parent
TRAIN_ID = next(f"HumanEval/{i}" for i in range(164) if split_of(f"HumanEval/{i}") == "train")
HELD_ID = next(f"HumanEval/{i}" for i in range(164) if split_of(f"HumanEval/{i}") == "heldout")


def _episodes(path: Path) -> None:
    rows = [
        (TRAIN_ID, "+good", True), (TRAIN_ID, "+bad", False), (TRAIN_ID, "+bad2", False),
        ("HumanEval/tie", "+a", True), ("HumanEval/tie", "+b", True),  # a tie: no pair
        (HELD_ID, "+good", True), (HELD_ID, "+bad", False),
        ("mystery/1", "+good", True), ("mystery/1", "+bad", False),  # unknown split
    ]  # fmt: skip
    views = [EpisodeView(t, "s", d) for t, d, _ in rows]
    write_episodes(path, views, [ok for _, _, ok in rows])


def test_task_split_fails_closed_and_honours_a_given_split():
    assert task_split(TRAIN_ID) == "train" and task_split(HELD_ID) == "heldout"
    assert task_split("mystery/1") == "heldout"  # unknown: never trains
    assert task_split("mystery/1", "train") == "train"


def test_mined_pairs_keep_the_split_and_held_out_pairs_never_train(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _episodes(run / "episodes.jsonl")
    pairs = mine_pairs([run])
    assert {p.context_id for p in pairs} == {TRAIN_ID, HELD_ID, "mystery/1"}  # tie dropped
    assert sum(p.context_id == TRAIN_ID for p in pairs) == 2  # good over each bad
    assert all("good" in p.chosen and "good" not in p.rejected for p in pairs)
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    back = pairs_from_jsonl(tmp_path / "pairs.jsonl")
    assert [(p.context_id, p.split) for p in back] == [(p.context_id, p.split) for p in pairs]
    train, held = split_pairs(back, heldout_fraction=0.0)  # the hash split would hold none out
    assert {p.context_id for p in train} == {TRAIN_ID}
    assert {p.context_id for p in held} == {HELD_ID, "mystery/1"}


def test_rm_mine_cli(tmp_path, capsys):
    from coderl.cli import main

    _episodes(tmp_path / "episodes.jsonl")
    out = tmp_path / "pairs.jsonl"
    assert main(["rm", "mine", str(tmp_path), "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["pairs"] == 4 and got["heldout"] == 2 and got["train"] == 2
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert main(["rm", "mine", str(empty), "--out", str(out)]) == 2  # a user error, said
    assert "episodes.jsonl" in capsys.readouterr().err


def test_the_learned_grader_preset_trains_on_tiny_random(tmp_path):
    from coderl.config import load_config
    from coderl.graders.rm import RewardModel, RMSpec
    from coderl.metrics import read_jsonl
    from coderl.train.loop import train

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # restored below: later tests in this process compare with children
    rm = RewardModel(RMSpec("tiny-random", head_only=True, max_len=64)).save(tmp_path / "rm")
    cfg = load_config(ROOT / "configs" / "humaneval-learned.yaml", [
        f"run_dir={tmp_path / 'run'}", "model.name=tiny-random", f"reward.rm.checkpoint={rm}",
        "tasks.tasks_per_step=1",
        "rollout.group_size=2", "rollout.max_new_tokens=16", "trainer.steps=1",
        "trainer.checkpoint_every=1", "sft.enabled=false", "eval.before_after=false",
        "graders.probe_every=1", "tensorboard=false", "progress=false",
    ])  # fmt: skip
    assert cfg.reward.learned_requires_tests and set(cfg.reward.terms) >= {"tests", "rm"}
    try:
        train(cfg)
    finally:
        torch.set_num_threads(before)
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["masked_rate"] == 0.0
    # a random policy resolves nothing, so the tests-gate gives the rm term 0 everywhere
    assert row["resolved_rate"] == 0.0 and row["reward/rm"] == 0.0
