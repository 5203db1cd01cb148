"""In-flight weight updates (``async.inflight``): a running completion picks up new weights
between decode chunks, the engine recomputes its KV cache under them, and every token keeps the
version (and the behaviour logprob) of the weights that sampled it. Tiny random model; no test
depends on wall-clock timing (swaps happen at a chunk boundary the test chooses)."""

from __future__ import annotations

import json

import pytest
import torch
from test_async_train import OVERRIDES, TOY, _weights, one_torch_thread  # noqa: F401 - a fixture

from coderl import algorithms as A
from coderl.asyncrl.metrics import hist_mean, token_staleness
from coderl.asyncrl.trainer import (
    EnvSampler,
    TrainLearner,
    check_supported,
    task_stream,
    train_async,
)
from coderl.asyncrl.types import Episode, Group, Job
from coderl.config import load_config
from coderl.metrics import read_jsonl
from coderl.policy import SamplingParams, load_policy
from coderl.policy.batch import collate
from coderl.train.checkpoint import load_trainable, trainable_state
from coderl.trajectory import Segment, Trajectory

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7]]  # the last repeats the first (shared prefill)


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


def test_the_next_turn_reuses_the_kv_recomputed_at_the_swap():
    # the prefix cache keeps each finished row's KV; after a swap that KV is the one recomputed
    # under the new weights, so a next turn that extends the completion reads it and its
    # logprobs are still the new weights'
    policy = load_policy("tiny-random", reference=False, engine="static")
    b = _perturbed(trainable_state(policy.model))
    params = SamplingParams(max_new_tokens=10, seed=2, ignore_eos=True)
    first = policy.generate(
        PROMPTS[:2], params, between_chunks=SwapAt(policy, b, 1), chunk_tokens=4
    )
    turn = [p + c.token_ids + [40, 41] for p, c in zip(PROMPTS, first, strict=False)]
    reused = policy.engine.prefill_stats["reused_tokens"]
    second = policy.generate(turn, SamplingParams(max_new_tokens=5, seed=3))
    assert policy.engine.prefill_stats["reused_tokens"] - reused == sum(len(t) - 3 for t in turn)
    expected = _trainer_logprobs(policy, b, turn, second)
    for c, lb in zip(second, expected, strict=True):
        assert c.versions() == [1] * len(c.token_ids)
        assert max(abs(x - y) for x, y in zip(c.logprobs, lb, strict=True)) < 1e-4


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


def test_a_swap_inside_an_async_rollout_reaches_the_batch_and_its_importance_weights(tmp_path):
    # the worker's sampler on the toy task; the first chunk boundary (after 3 of 8 tokens) loads
    # version 1: each episode's first 3 tokens carry version 0 and the old policy's logprobs,
    # the rest version 1 and the new one's, and at version 1 only the first 3 are off-policy
    over = [*OVERRIDES, f"run_dir={tmp_path}", "async.inflight.enabled=true"]
    cfg = load_config(TOY, [*over, "async.inflight.chunk_tokens=3"])
    learner, sampler = TrainLearner(cfg), EnvSampler(cfg)
    a = learner.weights()
    b = _perturbed(a)
    sampler.load_weights(0, a)
    calls: list[int] = []

    def between_turns() -> int:  # the worker's sync: call 1 starts the turn, call 2 is a boundary
        calls.append(1)
        if len(calls) == 2:
            sampler.load_weights(1, b)
        return sampler.policy.version

    task_id, task = task_stream(learner.run.env.tasks("train"), 0)(0)
    job = Job(0, task, task_id, seed=1)
    episodes = sampler.rollout(job, between_turns)
    assert len(calls) == 3  # the turn's start, then boundaries after 3 and 6 tokens
    assert [ep.sampled_versions() for ep in episodes] == [[0] * 3 + [1] * 5] * 4
    segs = [ep.trajectory.segments[0] for ep in episodes]
    policy = learner.run.policy
    load_trainable(policy.model, b)  # the trainer at version 1
    batch = collate(segs, policy.pad_token_id)
    mask = batch.loss_mask.float()
    train_logp = policy.forward(batch).logprobs.detach()  # (B, T)
    w = A.importance_weights(train_logp, batch.behavior_logprobs, mask, cap=1e9)
    old = (batch.policy_versions == 0) & (mask > 0)
    new = (batch.policy_versions == 1) & (mask > 0)
    assert int(old.sum()) == 12 and int(new.sum()) == 20
    assert (w[new] - 1).abs().max() < 1e-4  # sampled by the weights the trainer holds
    assert (w[old] - 1).abs().min() > 1e-3  # corrected with their own (old) behaviour logprob
    assert token_staleness([Group(job, episodes, version=0)], 1) == {1: 12, 0: 20}


def test_token_staleness_worked_example():
    # one group, two episodes: versions [0, 0, 1] and [2]; trained at version 2
    def episode(versions):
        seg = Segment()
        seg.append_context([1], kind="prompt")
        seg.append_sampled([5] * len(versions), [-1.0] * len(versions), versions)
        return Episode("t", Trajectory([seg]))

    group = Group(Job(0, None, "t", 0), [episode([0, 0, 1]), episode([2])])
    hist = token_staleness([group], 2)
    assert hist == {2: 2, 1: 1, 0: 1}
    assert hist_mean(hist) == pytest.approx((2 + 2 + 1 + 0) / 4)
    assert 2 - group.oldest_version() == max(hist)  # the group's staleness is its stalest token


def _boundaries(monkeypatch) -> list[int]:
    """Counts the chunk boundaries the torch engine reaches (thread workers share the class)."""
    from coderl.policy.engine import TorchEngine

    real, seen = TorchEngine.generate, []

    def spy(self, prompts, params, *, version=0, between_chunks=None, chunk_tokens=0):
        inner = between_chunks
        if inner is not None:

            def between_chunks():
                seen.append(chunk_tokens)
                return inner()

        return real(
            self,
            prompts,
            params,
            version=version,
            between_chunks=between_chunks,
            chunk_tokens=chunk_tokens,
        )

    monkeypatch.setattr(TorchEngine, "generate", spy)
    return seen


def test_inflight_on_without_mid_episode_updates_learns_exactly_what_off_does(
    tmp_path, monkeypatch
):
    # max_staleness=0: every rollout is issued after the weights it uses were published, so no
    # update arrives mid-episode; the chunk boundaries run and must change nothing
    seen = _boundaries(monkeypatch)
    common = [
        *OVERRIDES,
        "trainer.steps=3",
        "trainer.checkpoint_every=3",
        "async.max_staleness=0",
        "async.num_workers=2",
    ]
    train_async(load_config(TOY, [*common, f"run_dir={tmp_path / 'off'}"]))
    assert seen == []
    on = [*common, f"run_dir={tmp_path / 'on'}", "async.inflight.enabled=true"]
    summary = train_async(load_config(TOY, [*on, "async.inflight.chunk_tokens=3"]))
    assert seen and set(seen) == {3}
    assert summary["token_staleness_max"] == 0 and summary["token_staleness_mean"] == 0.0
    a, b = _weights(tmp_path / "off", 3), _weights(tmp_path / "on", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("off", "on"))
    for key in ("loss", "reward/mean", "logprob_gap", "token_staleness_max"):
        assert [m[key] for m in ma] == [m[key] for m in mb], key
    assert all(m["async/token_staleness_mean"] == 0.0 for m in mb)


def test_resume_with_inflight_on_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    seen = _boundaries(monkeypatch)
    common = [
        *OVERRIDES,
        "trainer.checkpoint_every=2",
        "async.max_staleness=0",
        "async.num_workers=2",
        "async.inflight.enabled=true",
        "async.inflight.chunk_tokens=3",
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train_async(load_config(TOY, [*common, "trainer.steps=4", f"run_dir={whole}"]))
    train_async(load_config(TOY, [*common, "trainer.steps=2", f"run_dir={parts}"]))
    train_async(load_config(TOY, [*common, "trainer.steps=4", f"run_dir={parts}"]), resume=True)
    assert seen  # the chunk boundaries ran in every segment of both runs
    a, b = _weights(whole, 4), _weights(parts, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (
        json.loads((d / "checkpoints" / "step-000004" / "state.json").read_text())
        for d in (whole, parts)
    )
    assert (sa["cursor"], sa["version"]) == (sb["cursor"], sb["version"]) == (8, 4)
    ma, mb = read_jsonl(whole / "metrics.jsonl"), read_jsonl(parts / "metrics.jsonl")
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]


def test_inflight_is_refused_with_the_vllm_engine(tmp_path):
    cfg = load_config(
        TOY, [*OVERRIDES, f"run_dir={tmp_path}", "engine.kind=vllm", "async.inflight.enabled=true"]
    )
    with pytest.raises(ValueError, match="in-flight weight updates are implemented by the torch"):
        check_supported(cfg)
