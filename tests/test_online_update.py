"""The online update's metrics name a point in time: "before the update" is before its first
optimizer step, whatever ``trainer.steps`` is; ``importance.mode: off`` means no weights."""

from __future__ import annotations

import copy

import pytest
import torch

from coderl import algorithms as A
from coderl.config import AlgorithmConfig, TrainerConfig
from coderl.online.update import to_segment, update
from coderl.policy.base import SamplingParams
from coderl.policy.local import LocalPolicy
from coderl.policy.tiny import tiny_random
from coderl.train.batch import build_batch

T = 0.8


@pytest.fixture(scope="module")
def recorded() -> tuple[LocalPolicy, list[dict]]:
    """A tiny policy and rows it served (exact ids and behaviour logprobs, as the server
    records them)."""
    torch.manual_seed(0)
    model, tok = tiny_random(0)
    policy = LocalPolicy(model, tok, reference=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    outs = policy.generate(prompts, SamplingParams(temperature=T, max_new_tokens=6, seed=1))
    rows = [
        {
            "interaction_id": f"i{i}",
            "prompt_token_ids": p,
            "completion_token_ids": o.token_ids,
            "behaviour_logprobs": o.logprobs,
            "policy_version": 0,
            "exploration": False,
        }
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    return policy, rows


def _fresh(policy: LocalPolicy) -> LocalPolicy:
    return LocalPolicy(copy.deepcopy(policy.model), policy.tokenizer, reference=False)


def _rescored_gap(policy: LocalPolicy, rows: list[dict]) -> dict[str, float]:
    """The sampler/trainer gap re-scored at ``policy``'s current weights."""
    batch = build_batch([to_segment(r) for r in rows], [0.0] * len(rows), policy.pad_token_id)
    with torch.no_grad():
        lp = policy.forward(batch.tokens, T).logprobs
    return A.logprob_gap(lp, batch.tokens.behavior_logprobs, batch.loss_mask)


def _update(policy: LocalPolicy, rows: list[dict], steps: int, mode: str = "truncate"):
    alg = AlgorithmConfig.model_validate({"kl": {"coef": 0.1}, "importance": {"mode": mode}})
    trainer = TrainerConfig(steps=steps, lr=5e-2, micro_batch_size=4, grad_clip=None)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    frozen = _fresh(policy)
    return update(
        policy, frozen, rows, adv, algorithm=alg, trainer=trainer, temperature=T, max_len=6
    )


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_the_gap_before_the_update_is_the_rescored_gap_whatever_the_steps(recorded, steps):
    served, rows = recorded
    policy = _fresh(served)
    before = _rescored_gap(policy, rows)
    m = _update(policy, rows, steps)
    assert m["logprob_gap"] == pytest.approx(before["logprob_gap"], abs=1e-6)
    assert m["logprob_gap_max"] == pytest.approx(before["logprob_gap_max"], abs=1e-6)
    # the first step's KL is 0 by construction: not reported; the last step's is, moved off 0
    assert ("kl" in m) == (steps > 1) and (steps == 1 or m["kl"] > 1e-6), m.get("kl")
    assert m["iw_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["optimizer_steps"] == steps
    after = _rescored_gap(policy, rows)
    # the update moved the policy: a metric measured after a step would not match `before`
    assert after["logprob_gap"] > before["logprob_gap"] + 1e-3


def test_importance_mode_off_means_no_weights(recorded):
    served, rows = recorded
    skewed = [  # behaviour logprobs away from the policy's: truncated weights would not be 1
        {
            **r,
            "behaviour_logprobs": [
                x - 0.5 * (j % 2) for j, x in enumerate(r["behaviour_logprobs"])
            ],
        }
        for r in rows
    ]
    off = _update(_fresh(served), skewed, 1, mode="off")
    assert off["ess_tokens_frac"] == pytest.approx(1.0)
    assert off["ess_seqs_frac"] == pytest.approx(1.0)
    assert off["iw_mean"] == pytest.approx(1.0) and off["iw_max"] == pytest.approx(1.0)
    weighted = _update(_fresh(served), skewed, 1, mode="truncate")
    assert weighted["ess_tokens_frac"] < 0.99
    assert weighted["iw_mean"] != pytest.approx(1.0, abs=1e-3)
