"""Segments -> padded tensors: masks independent of the pad id, padding-invariant logprobs, and
losses averaged over sampled tokens only."""

import pytest
import torch

from coderl.algorithms import aggregate, kl_penalty, policy_loss
from coderl.policy import collate, load_policy
from coderl.trajectory import Segment

EOS = 2


def segment(prompt, sampled, logprob=-1.0, version=0):
    seg = Segment()
    seg.append_context(prompt, kind="prompt")
    seg.append_sampled(sampled, [logprob] * len(sampled), version)
    return seg


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny-random")


def test_pad_equal_to_eos_keeps_the_real_eos_in_the_loss():
    # completion [5, 7, EOS] (true length 3) padded to 5 with pad == EOS: [5, 7, EOS, EOS, EOS]
    short = segment([3, 4], [5, 7, EOS])
    long = segment([3, 4], [5, 7, 9, 9, 9])
    batch = collate([short, long], pad_id=EOS)
    assert batch.input_ids[0, 2:].tolist() == [5, 7, EOS, EOS, EOS]
    assert batch.loss_mask[0, 2:].tolist() == [1, 1, 1, 0, 0]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert batch.loss_mask[1].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert batch.policy_versions[0].tolist() == [-1, -1, 0, 0, 0, -1, -1]


def test_left_pads_do_not_change_logprobs(policy):
    seg = segment([11, 12, 13, 14], [15, 16, 17, EOS])
    plain = policy.forward_logprobs(collate([seg], EOS))  # (1, 8), 0 pads
    padded = policy.forward_logprobs(collate([seg], EOS, pad_side="left", pad_to=12))  # 4 pads
    assert padded.shape == (1, 12)
    assert torch.allclose(plain[0, 1:], padded[0, 5:], atol=1e-4)
    # and in a batch next to a longer row, right-padded
    other = segment([1, 3, 5, 7, 9, 11], [13, 15, 17, 19, 21])
    batched = policy.forward_logprobs(collate([seg, other], EOS))  # (2, 11)
    assert torch.allclose(plain[0], batched[0, :8], atol=1e-4)


def test_loss_mask_and_averages_cover_sampled_tokens_only(policy):
    # [prompt 3][action 2][observation 4][action 3] -> mask 000 11 0000 111
    seg = Segment()
    seg.append_context([10, 11, 12], kind="prompt")
    seg.append_sampled([13, 14], [-1.0, -2.0], version=0)
    seg.append_context([15, 16, 17, 18], kind="observation")
    seg.append_sampled([19, 20, EOS], [-1.5, -0.5, -3.0], version=0)
    batch = collate([seg], EOS)
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    sampled = [3, 4, 9, 10, 11]

    out = policy.forward(batch, with_entropy=True)
    ref = policy.reference_logprobs(batch)
    kl = kl_penalty(out.logprobs, ref, "k3")
    loss, _ = policy_loss(
        out.logprobs, batch.behavior_logprobs, torch.tensor([1.0]), batch.loss_mask
    )
    mask = batch.loss_mask
    # each average equals the plain mean over the 5 sampled positions
    for per_token in (out.entropy, kl):
        assert torch.allclose(
            aggregate(per_token, mask, "token-mean"), per_token[0, sampled].mean()
        )
    ratio = (out.logprobs - batch.behavior_logprobs).exp()[0, sampled]
    clipped = torch.minimum(ratio, ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss, -clipped.mean())
    # hand-worked: per-token values 0..11 average to (3 + 4 + 9 + 10 + 11) / 5 = 7.4
    assert aggregate(torch.arange(12.0)[None], mask, "token-mean").item() == pytest.approx(7.4)
    # gradient reaches the policy only through the 5 sampled tokens' logprobs
    logp = out.logprobs
    logp.retain_grad()
    loss.backward()
    assert (logp.grad[0] != 0).nonzero().squeeze(-1).tolist() == sampled


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        collate([], EOS)
    with pytest.raises(ValueError, match="valid"):
        collate([segment([1], [2])], EOS, pad_side="middle")
    with pytest.raises(ValueError, match="pad_to"):
        collate([segment([1, 2], [3])], EOS, pad_to=2)
    bad = segment([1], [2])
    bad.loss_mask[0] = 1
    with pytest.raises(ValueError, match="first token"):
        collate([bad], EOS)
    bad = segment([1], [2])
    bad.behavior_logprobs.pop()
    with pytest.raises(ValueError, match="lengths"):
        collate([bad], EOS)
