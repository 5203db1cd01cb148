"""The head-only reward model: a frozen backbone whose pooled features are computed once per
sequence, a head fitted on them; it learns a separable preference, checkpoints, and scores as
``reward.terms.rm`` like the LoRA reward model."""

from __future__ import annotations

import json

import pytest
import torch
from test_graders import _synthetic_pairs as _marker_pairs  # chosen: token 300, rejected: 301

from coderl.graders.rm import (
    RewardModel,
    RMSpec,
    fit_head,
    last_token,
    mean_pool,
    pairwise_accuracy,
    split_pairs,
    train_rm,
)


def test_pools_hand_worked():
    h = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]]])  # (1, 3, 2), last row is padding
    mask = torch.tensor([[1, 1, 0]])
    assert last_token(h, mask).tolist() == [[3.0, 2.0]]
    assert mean_pool(h, mask).tolist() == [[2.0, 1.0]]


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_head_only_learns_a_separable_preference_and_checkpoints(tmp_path, pool):
    torch.set_num_threads(1)
    train, held = split_pairs(_marker_pairs(), 0.3)
    model = RewardModel(RMSpec("tiny-random", head_only=True, pool=pool, max_len=32))
    frozen = {n: p.clone() for n, p in model.backbone.named_parameters()}
    losses = train_rm(model, train, steps=150, batch_size=16, lr=1e-2)
    acc = pairwise_accuracy(model, held)
    assert acc.accuracy >= 0.85 and acc.lo > 0.6, acc
    assert sum(losses[-10:]) < sum(losses[:10])
    assert all(torch.equal(p, frozen[n]) for n, p in model.backbone.named_parameters())
    assert set(model.trainable_state()) == {"head.weight", "head.bias"}  # the checkpoint
    model.save(tmp_path / "rm")
    again = RewardModel.load(tmp_path / "rm")
    items = [held[0].chosen, held[1].rejected]
    assert again.rewards(items) == pytest.approx(model.rewards(items), abs=1e-5)


def test_the_folded_head_gives_the_standardised_fit_on_raw_features():
    """After fitting, head(h) on raw features must order every pair as v . z did: the
    standardisation is folded into w and b, not lost."""
    pairs = _marker_pairs(24)
    model = RewardModel(RMSpec("tiny-random", head_only=True, pool="mean", max_len=32))
    fit_head(model, pairs, steps=0)  # the initial v, folded
    items = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    feats = model.feature_table(items)  # (48, H)
    mu, sd = feats.mean(0), feats.std(0, unbiased=False).clamp(min=1e-6)
    v = model.head.weight[0] * sd  # v = w * sd
    want = ((feats - mu) / sd) @ v  # (48,)
    assert model.rewards(items) == pytest.approx(want.tolist(), abs=1e-4)


def test_feature_table_rows_follow_the_items_not_the_length_order():
    model = RewardModel(RMSpec("tiny-random", head_only=True, pool="last", max_len=32))
    items = [(11, 12, 13, 14, 15), (20,), (30, 31, 32)]
    table = model.feature_table(items, batch_size=2)  # (3, H), batched as [1], [2, 0]
    one = torch.cat([model.feature_table([x]) for x in items])
    assert torch.allclose(table, one, atol=1e-5)


def test_head_only_features_are_computed_once_per_sequence():
    model = RewardModel(RMSpec("tiny-random", head_only=True, pool="mean", max_len=32))
    calls = []
    model.backbone.register_forward_hook(
        lambda m, a, k, out: calls.append(k["input_ids"].shape[0]), with_kwargs=True
    )
    first = model.rewards([(11, 12), (13,), (11, 12)])
    assert sum(calls) == 2  # the repeated item is one row
    assert model.rewards([(13,), (11, 12)]) == pytest.approx(first[1:]) and sum(calls) == 2
    model.rewards([(14, 15)])
    assert sum(calls) == 3 and model.feature_table([]).shape == (0, model.head.in_features)


def test_unknown_pool_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: \\['last', 'mean'\\]"):
        RewardModel(RMSpec("tiny-random", head_only=True, pool="max"))


def test_rm_cli_head_only_scores_as_the_rm_term(tmp_path):
    from coderl.cli import main
    from coderl.config import load_config
    from coderl.rewards import RewardSample, compute_rewards

    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(16):
            row = {"id": f"t{i}", "chosen": f"def f{i}(x):\n    return x + {i}\n",
                   "rejected": f"def f{i}(x):\n    return None\n", "split": "heldout" if i < 4 else "train"}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    ckpt = tmp_path / "rm"
    rc = main(["rm", "train", "--pairs", str(pairs), "--backbone", "tiny-random", "--out",
               str(ckpt), "--steps", "20", "--head-only", "--pool", "mean", "--lr", "1e-2"])  # fmt: skip
    assert rc == 0
    spec = json.loads((ckpt / "rm.json").read_text())
    assert spec["head_only"] and spec["pool"] == "mean"
    result = json.loads((ckpt / "rm_eval.json").read_text())
    assert result["train_pairs"] == 12 and result["n"] == 4
    cfg = load_config(None, ["reward.terms={tests: 1.0, rm: 1.0}", f"reward.rm.checkpoint={ckpt}",
                             "reward.term_timeout_s=120"])  # fmt: skip
    res = compute_rewards(
        [RewardSample("t/0", resolved=True, diff="+x"), RewardSample("t/1", resolved=True)],
        cfg.reward,  # the rm is gated on the tests (the default): it scores solved samples
    )
    assert all(res.valid) and all(0 < b["rm"] < 1 for b in res.breakdown)


def test_mined_pairs_never_hold_the_tests_verdict():
    """A mined pair's label is the hidden tests' verdict; the tests report states it in words,
    so the text a reward model reads (and is trained on) must not carry it, nor the outcome
    lines, whatever the episode view holds."""
    from coderl.graders.judge import EpisodeView
    from coderl.graders.pairs import pairs_from_outcomes, render_episode

    views = [
        EpisodeView("t", "fix f", "-a\n+b", "run: 1 passed", "resolved: 2/2 tests passed"),
        EpisodeView("t", "fix f", "-a\n+c", "run: 1 failed", "not resolved: 1/2 tests passed"),
    ]
    [pair] = pairs_from_outcomes(views, [True, False])
    for text in (pair.chosen, pair.rejected, *map(render_episode, views)):
        assert "resolved" not in text and "tests passed" not in text
    assert "+b" in pair.chosen and "run: 1 failed" in pair.rejected  # the code and actions stay
