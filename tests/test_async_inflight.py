"""In-flight weight updates (``async.inflight``): a running completion picks up new weights
between decode chunks, the engine recomputes its KV cache under them, and every token keeps the
version (and the behaviour logprob) of the weights that sampled it. Tiny random model; no test
depends on wall-clock timing (swaps happen at a chunk boundary the test chooses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coderl import algorithms as A
from coderl.asyncrl.trainer import EnvSampler, TrainLearner, task_stream, train_async
from coderl.asyncrl.types import Group, Job
from coderl.config import load_config
from coderl.policy import SamplingParams, load_policy
from coderl.policy.batch import collate
from coderl.train.checkpoint import load_trainable, trainable_state
from coderl.train.metrics import read_jsonl

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
OVERRIDES = [
    "rollout.group_size=4",
    "trainer.micro_batch_size=8",
    "tensorboard=false",
    "progress=false",
    "eval.before_after=false",
]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7]]  # the last repeats the first (shared prefill)


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _perturbed(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Other weights: each tensor plus Gaussian noise of 0.3 of its std (a large update)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.3 * v.float().std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)
        for k, v in weights.items()
    }


class SwapAt:
    """A ``between_chunks`` callback that loads ``weights`` as ``version`` at its ``at``-th call
    (1-based) and counts its calls."""

    def __init__(self, policy, weights, version: int, at: int = 1):
        self.policy, self.weights, self.version, self.at = policy, weights, version, at
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls == self.at:
            load_trainable(self.policy.model, self.weights)
            self.policy.version = self.version
        return self.policy.version


def _trainer_logprobs(policy, weights, prompts, completions):
    """Per sampled token, the trainer's logprob under ``weights`` (loaded, then left loaded)."""
    load_trainable(policy.model, weights)
    seqs = [p + c.token_ids for p, c in zip(prompts, completions, strict=True)]
    lps = policy.logprobs(seqs)
    return [lp[len(p) :] for lp, p in zip(lps, prompts, strict=True)]


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_tokens_after_a_mid_completion_swap_carry_the_new_version_and_its_logprobs(backend):
    policy = load_policy("tiny-random", reference=False, engine=backend)
    a = trainable_state(policy.model)
    b = _perturbed(a)
    swap = SwapAt(policy, b, version=1, at=2)  # at the second boundary: after 8 tokens
    params = SamplingParams(max_new_tokens=14, seed=3, ignore_eos=True)
    out = policy.generate(PROMPTS, params, between_chunks=swap, chunk_tokens=4)
    assert swap.calls == 3  # boundaries after 4, 8 and 12 tokens
    lp_a = _trainer_logprobs(policy, a, PROMPTS, out)
    lp_b = _trainer_logprobs(policy, b, PROMPTS, out)
    for c, la, lb in zip(out, lp_a, lp_b, strict=True):
        assert c.policy_version == 0 and c.versions() == [0] * 8 + [1] * 6
        before, after = c.logprobs[:8], c.logprobs[8:]
        assert max(abs(x - y) for x, y in zip(before, la[:8], strict=True)) < 1e-4
        assert max(abs(x - y) for x, y in zip(after, lb[8:], strict=True)) < 1e-4
        # the swap matters: under the old weights the same tokens have other logprobs
        assert max(abs(x - y) for x, y in zip(after, la[8:], strict=True)) > 1e-2


def test_bf16_sampler_takes_up_the_swapped_weights():
    policy = load_policy("tiny-random", reference=False)
    policy.set_sampler_precision("bfloat16")
    a = trainable_state(policy.model)
    b = _perturbed(a)
    params = SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True)
    out = policy.generate(PROMPTS, params, between_chunks=SwapAt(policy, b, 1), chunk_tokens=4)
    lp_a = _trainer_logprobs(policy, a, PROMPTS, out)
    lp_b = _trainer_logprobs(policy, b, PROMPTS, out)
    for c, la, lb in zip(out, lp_a, lp_b, strict=True):
        assert c.versions() == [0] * 4 + [1] * 8
        gap_b = sum(abs(x - y) for x, y in zip(c.logprobs[4:], lb[4:], strict=True)) / 8
        gap_a = sum(abs(x - y) for x, y in zip(c.logprobs[4:], la[4:], strict=True)) / 8
        assert gap_b < 0.05 < gap_a  # bf16 rounding of B, not the stale copy of A


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_chunk_boundaries_without_a_new_version_change_nothing(backend):
    policy = load_policy("tiny-random", reference=False, engine=backend)
    params = SamplingParams(max_new_tokens=11, seed=7)
    plain = policy.generate(PROMPTS, params)
    calls: list[int] = []
    chunked = policy.generate(
        PROMPTS, params, between_chunks=lambda: calls.append(1) or 0, chunk_tokens=3
    )
    assert calls  # the boundaries were reached
    for p, c in zip(plain, chunked, strict=True):
        assert (p.token_ids, p.logprobs, p.finish_reason) == (
            c.token_ids,
            c.logprobs,
            c.finish_reason,
        )
        assert c.versions() == [0] * len(c.token_ids)
