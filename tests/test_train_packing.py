"""Token-budget micro-batches with sequence packing, and activation checkpointing: the same
gradient as the padded, uncheckpointed step (tiny random model, fp32)."""

import pytest
import torch
from torch import nn

from coderl.config import AlgorithmConfig, ConfigError, load_config
from coderl.policy import packing
from coderl.policy.forward import forward
from coderl.policy.loading import load_policy
from coderl.policy.local import LoraSpec
from coderl.train.batch import build_batch, micro_batch_spans
from coderl.train.step import accumulate_gradients
from coderl.trajectory import Segment

SYSTEM = 20  # shared context tokens (above MIN_SHARED_CONTEXT: the shared-prefix path runs)


def _segments(n=6, shared=SYSTEM, seed=0):
    """Rows of unequal lengths: ``shared`` common context tokens, 2..2+n own context tokens,
    3..3+2n sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, 100, (shared,), generator=g).tolist()
    segs = []
    for i in range(n):
        seg = Segment()
        seg.append_context(common + torch.randint(3, 100, (2 + i,), generator=g).tolist())
        action = torch.randint(3, 100, (3 + 2 * i,), generator=g).tolist()
        seg.append_sampled(action, [-1.0 - 0.05 * j for j in range(len(action))], 0)
        segs.append(seg)
    return segs


def _grad(params):
    return torch.cat([p.grad.flatten() for p in params])


def _close(got, want, msg):
    scale = float(want.abs().max())
    assert scale > 0, msg
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=msg)


def test_micro_batch_spans_cut_by_real_tokens():
    # rows of 5, 8, 11, 14, 17, 20 real tokens (no shared context): budget 25 -> 5+8+11 | 14 |
    # 17 | 20; budget 16 -> 5+8 | 11 | 14 | 17 | 20 (a 17- or 20-token row still gets one);
    # budget 10 -> every row alone
    batch = build_batch(_segments(shared=0), [1.0] * 6, 0)
    assert [int(n) for n in batch.tokens.attention_mask.sum(-1)] == [5, 8, 11, 14, 17, 20]
    assert micro_batch_spans(batch, 4) == [(0, 4), (4, 6)]
    assert micro_batch_spans(batch, 4, 25) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert micro_batch_spans(batch, 4, 16) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert micro_batch_spans(batch, 4, 10) == [(i, i + 1) for i in range(6)]
    assert micro_batch_spans(batch, 4, 1000) == [(0, 6)]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        micro_batch_spans(batch, 4, 0)


def test_pack_layout_restarts_positions_and_maps_back():
    # two rows sharing 3 tokens: [7 8 9 | 1 2] and [7 8 9 | 4], right padded to T = 5
    seg_a, seg_b = Segment(), Segment()
    seg_a.append_context([7, 8, 9, 1, 2])
    seg_b.append_context([7, 8, 9, 4])
    tokens = build_batch([seg_a, seg_b], [0.0, 0.0], 0).tokens
    p = packing.pack(tokens)
    assert p.input_ids.tolist() == [[7, 8, 9, 1, 2, 7, 8, 9, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert p.index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, -1]]
    q = packing.pack(tokens, shared=3)
    assert q.input_ids.tolist() == [[7, 8, 9, 1, 2, 4]]
    assert q.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    assert q.row.tolist() == [-1, -1, -1, 0, 0, 1]
    assert q.index.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, -1]]
    mask = packing.prefix_block_causal_mask(q)[0, 0].int()
    # row 1's token (packed 5) sees the prefix and itself, not row 0's tokens 3 and 4
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    with pytest.raises(ValueError, match="do not share their first 4 tokens"):
        packing.pack(tokens, shared=4)


@pytest.mark.parametrize("shared", [0, SYSTEM])
def test_packed_attention_never_crosses_rows(shared):
    # change every token of row 0: packed, row 1's logprobs must not move
    policy = load_policy("tiny-random", reference=False)
    batch = build_batch(_segments(3, shared=shared), [1.0] * 3, policy.pad_token_id)
    other = build_batch(_segments(3, shared=shared), [1.0] * 3, policy.pad_token_id)
    n0 = int(other.tokens.attention_mask[0].sum())
    other.tokens.input_ids[0, shared:n0] = (other.tokens.input_ids[0, shared:n0] + 7) % 100 + 3
    with torch.no_grad():
        a = forward(policy.model, batch.tokens, temperature=1.0, pack=True).logp
        b = forward(policy.model, other.tokens, temperature=1.0, pack=True).logp
    assert (a[0] - b[0]).abs().max() > 1e-3  # row 0 itself did change
    torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-6)


def _ppo_batch(policy, value_head):
    """The rows with advantages, reference logprobs unlike the policy's and PPO value targets."""
    batch = build_batch(_segments(), [1.0, -1.0, 0.5, -0.5, 2.0, -2.0], policy.pad_token_id)
    g = torch.Generator().manual_seed(3)
    mask = batch.tokens.loss_mask
    with torch.no_grad():
        out = forward(policy.model, batch.tokens, temperature=1.0, value_head=value_head)
    batch.ref_logp = (out.logp - 0.3 * torch.rand(mask.shape, generator=g)) * mask
    batch.old_values = out.values * mask
    batch.returns = torch.randn(mask.shape, generator=g) * mask
    return batch


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_packed_gradient_equals_padded(lora):
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4) if lora else None, reference=False)
    torch.manual_seed(0)
    head = nn.Linear(policy.model.config.hidden_size, 1)
    params = [*policy.trainable_parameters(), *head.parameters()]
    batch = _ppo_batch(policy, head)
    cfg = AlgorithmConfig(old_logp="trainer", kl={"coef": 0.1}, value_coef=0.5, entropy_coef=0.01)
    results = {}
    # padded rows (today's path, 2 rows each) vs packed by budgets that cut the 6 rows (25..40
    # real tokens each) into 6 micro-batches of one row and 3 of 3, 2 and 1 rows
    for name, kw in {
        "padded": {"micro_batch_size": 2},
        "packed 40": {"micro_batch_size": 2, "max_tokens": 40},
        "packed 90": {"micro_batch_size": 2, "max_tokens": 90},
    }.items():
        for p in params:
            p.grad = None
        m = accumulate_gradients(
            policy.model, batch, cfg, temperature=1.0, max_len=20, value_head=head, **kw
        )
        results[name] = (_grad(params), _grad(list(head.parameters())), m)
    g_ref, head_ref, m_ref = results["padded"]
    for name in ("packed 40", "packed 90"):
        g, g_head, m = results[name]
        _close(g, g_ref, name)
        _close(g_head, head_ref, f"{name}: value head")
        for key in ("loss", "pg_loss", "kl", "value_loss", "entropy"):
            assert m[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), (name, key)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_checkpointed_gradient_equals_plain_and_keeps_fewer_activations(lora):
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4) if lora else None, reference=False)
    batch = build_batch(_segments(4), [1.0, -1.0, 0.5, -0.5], policy.pad_token_id)
    params = policy.trainable_parameters()
    grads, saved = {}, {}
    for name, kw in {
        "plain": {},
        "checkpointed": {"checkpoint": True},
        "packed, checkpointed": {"pack": True, "checkpoint": True},
    }.items():
        policy.model.zero_grad()
        nbytes = [0]

        def keep(t, nbytes=nbytes):
            nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = forward(policy.model, batch.tokens, temperature=1.0, **kw)
        (out.logp * batch.tokens.loss_mask).sum().backward()
        grads[name], saved[name] = _grad(params), nbytes[0]
    for name in ("checkpointed", "packed, checkpointed"):
        _close(grads[name], grads["plain"], name)
    # what autograd keeps between forward and backward: the layers' inputs only, not their
    # activations (the recompute's own saved tensors are made and freed inside the backward)
    assert saved["checkpointed"] < 0.5 * saved["plain"]
    assert saved["packed, checkpointed"] < 0.5 * saved["plain"]
    assert not any(m.training for m in policy.model.modules())  # eval mode is restored


def test_trainer_config_validates_the_new_fields():
    cfg = load_config(
        None,
        [
            "trainer.max_tokens_per_micro_batch=2048",
            "trainer.activation_checkpointing=true",
            "trainer.bf16=auto",
        ],
    )
    assert cfg.trainer.max_tokens_per_micro_batch == 2048
    assert cfg.trainer.activation_checkpointing is True and cfg.trainer.bf16 == "auto"
    for bad in ("trainer.max_tokens_per_micro_batch=0", "trainer.bf16=sometimes"):
        with pytest.raises(ConfigError, match="trainer"):
            load_config(None, [bad])
