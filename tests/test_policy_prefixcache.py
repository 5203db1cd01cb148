"""KV reuse across sampling calls (coderl.policy.prefixcache): an agent's next turn prefills only
its new tokens and samples what a full prefill samples (the same tokens, logprobs equal up to
rounding); any change of the weights empties the cache; the vLLM server's prefix caching flag."""

from __future__ import annotations

import sys

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from test_agent_loop import TASK, one_torch_thread  # noqa: F401 - a fixture
from test_agent_tools import make_repo, open_sandbox

from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.runner import run_episodes
from coderl.config import Config
from coderl.policy import LoraSpec, SamplingParams, load_policy
from coderl.policy.prefixcache import PrefixCache
from coderl.policy.rollout import build_engine
from coderl.policy.vllm_server import VLLMServer

LORA = LoraSpec(rank=4, alpha=8.0)


def _adapter_noise(policy, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA state with non-zero B (peft starts B at 0, where the adapter changes nothing)."""
    g = torch.Generator().manual_seed(seed)
    state = get_peft_model_state_dict(policy.model)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in state.items()}


def _pair(lora: LoraSpec | None = LORA):
    """Two policies with the same weights: one reusing KV across calls, one never."""
    cached = load_policy("tiny-random", reference=False, lora=lora)
    plain = load_policy("tiny-random", reference=False, lora=lora)
    plain.set_prefix_cache(0)
    if lora is not None:
        noise = _adapter_noise(cached, seed=1)
        set_peft_model_state_dict(cached.model, noise)
        set_peft_model_state_dict(plain.model, noise)
    assert cached.engine.prefix_cache is not None and plain.engine.prefix_cache is None
    return cached, plain


# fp32 rounding only: reused keys and values were computed by decode steps or a prefill of
# another length (measured max |gap| 1.1e-5 nats; the sampler/trainer gap is of the same order).
TOL = 1e-4


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < TOL


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T1-seeded"])
def test_multi_turn_reuse_samples_what_a_full_prefill_samples(temperature):
    cached, plain = _pair()
    system = list(range(5, 45))  # a shared system prompt (40 tokens)
    contexts = [system + [50, 51], system + [52, 53, 54], system + [50, 51]]
    expected_reuse = 0  # KV the next call can read: each extended row's prompt and completion
    for turn in range(4):
        params = SamplingParams(temperature=temperature, max_new_tokens=10, seed=turn)
        before = cached.engine.prefill_stats["reused_tokens"]
        got = cached.generate(contexts, params)
        _same(got, plain.generate(contexts, params))
        assert cached.engine.prefill_stats["reused_tokens"] - before == expected_reuse
        obs = [60 + turn, 61, 62]
        ran = [len(c) + len(x.token_ids) - 1 for c, x in zip(contexts, got, strict=True)]
        contexts = [c + x.token_ids + obs for c, x in zip(contexts, got, strict=True)]
        extends = [True, True, True]
        if turn == 1:
            # row 1 starts a new window (a self-summary): it shares only the system prompt
            contexts[1], extends[1] = system + [70, 71, 72], False
            # row 2's completion was cut by the harness: only part of it is in the next prompt
            contexts[2], extends[2] = contexts[2][: -len(obs) - 4] + obs, False
        distinct = {tuple(c): n for c, n, e in zip(contexts, ran, extends, strict=True) if e}
        expected_reuse = sum(distinct.values())  # a repeated prompt is prefilled once
    stats, full = cached.engine.prefill_stats, plain.engine.prefill_stats
    assert stats["prompt_tokens"] == full["prompt_tokens"]
    assert stats["prefilled_tokens"] < full["prefilled_tokens"] / 2  # measured 0.2-0.3x


@pytest.mark.usefixtures("one_torch_thread")
def test_a_weight_change_of_any_kind_empties_the_cache():
    cached, plain = _pair()
    prompt = [list(range(5, 60))]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    first = cached.generate(prompt, params)
    _same(first, plain.generate(prompt, params))
    nxt = [prompt[0] + first[0].token_ids + [61, 62]]

    def check(what: str) -> None:
        reused = cached.engine.prefill_stats["reused_tokens"]
        _same(cached.generate(nxt, params), plain.generate(nxt, params))
        assert cached.engine.prefill_stats["reused_tokens"] == reused, what

    # an adapter reload (no version bump): every parameter's version counter moves
    noise = _adapter_noise(cached, seed=2)
    set_peft_model_state_dict(cached.model, noise)
    set_peft_model_state_dict(plain.model, noise)
    check("adapter reload")
    # the reference policy: the same parameters with the adapter disabled
    with cached.model.disable_adapter(), plain.model.disable_adapter():
        check("adapter disabled")
    # a version bump alone (a fused optimizer's step leaves the counters as they were)
    cached.bump_version()
    plain.bump_version()
    check("version bump")
    # unchanged weights: a prompt that extends the last call's row does reuse its KV
    last = cached.generate(nxt, params)
    plain.generate(nxt, params)
    reused = cached.engine.prefill_stats["reused_tokens"]
    again = [nxt[0] + last[0].token_ids + [63]]
    _same(cached.generate(again, params), plain.generate(again, params))
    assert cached.engine.prefill_stats["reused_tokens"] - reused == len(again[0]) - 2


@pytest.mark.usefixtures("one_torch_thread")
def test_a_trainer_step_empties_the_cache_of_a_bf16_sampler():
    # the bf16 copy takes up the changed adapter before sampling; its merged weights then
    # change in place, which the cache sees (the copy, not the trainer's model, is sampled)
    policy = load_policy("tiny-random", reference=False, lora=LORA)
    policy.set_sampler_precision("bfloat16")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    prompt = list(range(5, 40))
    first = policy.generate([prompt], params)[0]
    nxt = prompt + first.token_ids + [61]
    stats = policy.engine.prefill_stats
    second = policy.generate([nxt], params)[0]
    assert stats["reused_tokens"] == len(nxt) - 2  # unchanged weights: reused
    with torch.no_grad():  # an optimizer step on the adapter, without a version bump
        for p in policy.trainable_parameters():
            p.add_(0.1)
    reused = stats["reused_tokens"]
    policy.generate([nxt + second.token_ids + [62]], params)
    assert stats["reused_tokens"] == reused


def test_the_cache_keeps_its_memory_bound_and_drops_what_is_covered():
    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)  # 2 * 32 bytes per token

    cache = PrefixCache(max_bytes=64 * 10)  # ten tokens
    cache.put([1, 2, 3], *kv(3))
    cache.put([1, 2, 3, 4, 5], *kv(5))  # extends [1, 2, 3]: that entry goes
    assert len(cache) == 1 and cache.nbytes == 64 * 5
    assert cache.lookup([1, 2, 3, 4, 5, 9])[1] == 5
    assert cache.lookup([1, 2, 3, 4, 9]) == (None, 0)  # not an extension: a full prefill
    assert cache.lookup([1, 2, 3, 4, 5]) == (None, 0)  # the last prompt token is always run
    assert cache.lookup([7, 8]) == (None, 0)
    cache.put([7, 8, 9, 10], *kv(4))
    cache.lookup([1, 2, 3, 4, 5, 6])  # [1..5] is now the most recently used
    cache.put([20, 21], *kv(2))  # 11 tokens: the least recently used ([7..10]) goes
    assert sorted(cache.entries) == [(1, 2, 3, 4, 5), (20, 21)] and cache.nbytes == 64 * 7
    cache.put(list(range(11)), *kv(11))  # larger than the bound: not kept
    assert len(cache) == 2
    assert cache.forget([[1, 2, 3, 4, 5, 6, 7], [20, 22]]) == 1 and len(cache) == 1
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="for 3 tokens"):
        cache.put([1, 2, 3], *kv(4))
    with pytest.raises(ValueError, match="prefix_cache_mib must be >= 0"):
        cached, _ = _pair(lora=None)
        cached.set_prefix_cache(-1)


@pytest.mark.usefixtures("one_torch_thread")
def test_agent_episodes_reuse_kv_and_free_it_when_they_end(tmp_path):
    cached, plain = _pair()
    base = make_repo(tmp_path)
    tasks = [SimpleTask(t, TASK + t, kind="tiny") for t in ("a", "b")]  # two prompts, one call
    cfg = EpisodeConfig(
        max_turns=4,
        max_tokens_per_turn=12,
        context_budget=800,  # the 674-token window is summarised after two turns
        summary_max_tokens=12,
        instructions="Fix the bug.",
        toolsets={"tiny": ("read_file", "submit")},
        temperature=1.0,
        seed=0,
    )
    runs = []
    for policy in (cached, plain):
        boxes = [open_sandbox(base) for _ in tasks]
        try:
            runs.append(run_episodes(policy, list(zip(tasks, boxes, strict=True)), cfg))
        finally:
            for box in boxes:
                box.close()
    for a, b in zip(*runs, strict=True):
        assert a.error is None and b.error is None, a.error or b.error
        assert a.stats.turns >= 2, a.stats
        assert [s.token_ids for s in a.trajectory.segments] == [
            s.token_ids for s in b.trajectory.segments
        ]
        for sa, sb in zip(a.trajectory.segments, b.trajectory.segments, strict=True):
            gap = max(
                abs(x - y) for x, y in zip(sa.behavior_logprobs, sb.behavior_logprobs, strict=True)
            )
            assert gap < TOL
    assert any(len(e.trajectory.segments) > 1 for e in runs[0]), "no self-summary happened"
    # every token of a window is run once: prefilled, or decoded after it was sampled (all
    # sampled tokens but each turn's last); sharing across the group only lowers the count
    once = sum(
        len(s) - s.num_trainable + len(s.provenance["actions"])
        for e in runs[0]
        for s in e.trajectory.segments
    )
    # measured: 3,247 prefilled with reuse (the system prompt is shared within a call), 5,257
    # run once, 5,616 prefilled without reuse (every turn re-prefills its whole window)
    assert cached.engine.prefill_stats["prefilled_tokens"] <= once
    assert plain.engine.prefill_stats["prefilled_tokens"] > once
    assert len(cached.engine.prefix_cache) == 0  # every episode ended: nothing is kept


def test_the_engine_config_sets_the_bound():
    policy = load_policy("tiny-random", reference=False)
    build_engine(Config(engine={"prefix_cache_mib": 0}), policy)
    assert policy.engine.prefix_cache is None
    build_engine(Config(engine={"prefix_cache_mib": 8}), policy)
    assert policy.engine.prefix_cache is not None
    assert policy.engine.prefix_cache.max_bytes == 8 * 2**20


@pytest.mark.parametrize("on", [True, False])
def test_the_vllm_server_is_started_with_prefix_caching_as_configured(tmp_path, on):
    server = VLLMServer(tmp_path, tmp_path / "log", python=sys.executable, prefix_caching=on)
    flag = "--enable-prefix-caching" if on else "--no-enable-prefix-caching"
    assert flag in server.args and sum("prefix-caching" in a for a in server.args) == 1
