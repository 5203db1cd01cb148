"""The bf16 trainer: bf16 matmuls in the decoder, fp32 weights, LM head, log-softmax and loss;
its gradient against fp32's (tiny random model; torch runs bf16 on any CPU, slowly without bf16
units)."""

import torch

from coderl.config import TrainerConfig
from coderl.policy.forward import forward
from coderl.policy.kvcache import causal_lm
from coderl.policy.loading import load_policy
from coderl.policy.local import LoraSpec
from coderl.train.batch import build_batch
from coderl.train.step import uses_bf16
from coderl.trajectory import Segment


def _batch(policy, rows=6):
    g = torch.Generator().manual_seed(0)
    common = torch.randint(3, 100, (24,), generator=g).tolist()
    segs = []
    for i in range(rows):
        seg = Segment()
        seg.append_context(common + torch.randint(3, 100, (4 + i,), generator=g).tolist())
        action = torch.randint(3, 100, (12 + 3 * i,), generator=g).tolist()
        seg.append_sampled(action, [-1.0] * len(action), 0)
        segs.append(seg)
    return build_batch(segs, [1.0 if i % 2 else -1.0 for i in range(rows)], policy.pad_token_id)


def test_bf16_lora_gradient_keeps_fp32s_direction_and_only_the_mlps_run_bf16():
    policy = load_policy("tiny-random", lora=LoraSpec(rank=8), reference=False)
    lm = causal_lm(policy.model)
    with torch.no_grad():  # logits spread like a trained model's (std ~5), not near-uniform
        lm.model.embed_tokens.weight.mul_(25.0)
    batch = _batch(policy)
    seen: dict[str, list] = {"head": [], "q_proj": [], "down_proj": []}
    layer = lm.model.layers[0]
    for name, module in [
        ("head", lm.lm_head),
        ("q_proj", layer.self_attn.q_proj),
        ("down_proj", layer.mlp.down_proj),
    ]:
        module.register_forward_hook(lambda m, a, out, name=name: seen[name].append(out.dtype))
    grads, logps = {}, {}
    for bf16 in (False, True):
        policy.model.zero_grad()
        out = forward(policy.model, batch.tokens, temperature=1.0, bf16=bf16, pack=True)
        mask = batch.tokens.loss_mask
        adv = batch.advantages[:, None]
        (-(adv * out.logp * mask).sum() / mask.sum()).backward()
        grads[bf16] = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
        logps[bf16] = out.logp.detach()
        assert out.logp.dtype == torch.float32
    f32, b16 = torch.float32, torch.bfloat16
    assert set(seen["head"]) == {f32} and seen["q_proj"] == [f32, f32]  # head: once per row
    assert seen["down_proj"] == [f32, b16]  # fp32 run, then bf16 run
    gap = (logps[True] - logps[False]).abs().max()
    assert 1e-4 < gap < 0.5  # bf16 did run (the numbers moved), and not wildly
    cos = torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0)
    assert cos >= 0.999, float(cos)


def test_bf16_auto_follows_the_hardware(monkeypatch):
    from coderl.policy import precision as P

    cpu = torch.device("cpu")
    monkeypatch.setattr(P, "bf16_flags", lambda: [])
    assert not uses_bf16(TrainerConfig(bf16="auto"), cpu)
    assert uses_bf16(TrainerConfig(bf16=True), cpu)
    monkeypatch.setattr(P, "bf16_flags", lambda: ["amx_bf16"])
    assert uses_bf16(TrainerConfig(bf16="auto"), cpu)
    assert not uses_bf16(TrainerConfig(bf16=False), cpu)


def test_bf16_checkpointed_gradient_equals_bf16():
    # the recompute in the backward runs under the forward's autocast state: attention fp32,
    # MLPs bf16, as in the forward (a recompute in another precision would change the gradient)
    policy = load_policy("tiny-random", lora=LoraSpec(rank=8), reference=False)
    batch = _batch(policy, rows=3)
    grads = []
    for checkpoint in (False, True):
        policy.model.zero_grad()
        out = forward(
            policy.model, batch.tokens, temperature=1.0, bf16=True, pack=True, checkpoint=checkpoint
        )
        (out.logp * batch.tokens.loss_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable_parameters()]))
    scale = float(grads[0].abs().max())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-4 * scale)
