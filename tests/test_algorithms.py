"""Worked examples for coderl.algorithms; the arithmetic is in the comments."""

import math

import pytest
import torch

from coderl import algorithms as A


# ---------------------------------------------------------------- group_advantages
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("leave_one_out", [True, False])
def test_constant_group_gets_exact_zero(std_normalize, leave_one_out):
    adv = A.group_advantages(
        torch.ones(4),
        torch.zeros(4, dtype=torch.long),
        std_normalize=std_normalize,
        leave_one_out=leave_one_out,
    )
    assert torch.equal(adv, torch.zeros(4))


def test_constant_group_with_inexact_float_mean_is_exact_zero():
    # mean of [0.1]*3 in float32 is not bit-equal to 0.1; the result must still be exactly 0
    adv = A.group_advantages(torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(3))


def test_grpo_worked_example():
    # rewards [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # A = +-0.5 / 0.57735 = +-0.86603
    adv = A.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
    assert torch.allclose(adv, torch.tensor([0.86603, -0.86603, 0.86603, -0.86603]), atol=1e-4)


def test_dr_grpo_is_mean_centred_only():
    # rewards [3, 1]: mean 2 -> [1, -1], no division by std (which would be 1.414)
    adv = A.group_advantages(torch.tensor([3.0, 1.0]), torch.tensor([7, 7]), std_normalize=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]))


def test_rloo_baseline_is_mean_of_others():
    # rewards [1, 0, 0]: baselines [0, 0.5, 0.5] -> A = [1, -0.5, -0.5]
    adv = A.group_advantages(
        torch.tensor([1.0, 0.0, 0.0]),
        torch.zeros(3, dtype=torch.long),
        std_normalize=False,
        leave_one_out=True,
    )
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5]))


def test_groups_formed_by_id_not_position():
    # interleaved groups: group 5 = rows 0, 2 (rewards 1, 0); group 9 = rows 1, 3 (rewards 2, 2)
    adv = A.group_advantages(
        torch.tensor([1.0, 2.0, 0.0, 2.0]), torch.tensor([5, 9, 5, 9]), std_normalize=False
    )
    assert torch.allclose(adv, torch.tensor([0.5, 0.0, -0.5, 0.0]))


def test_invalid_nan_row_does_not_touch_other_group():
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.4])
    gids = torch.tensor([0, 0, 1, 1, 1])
    clean = A.group_advantages(rewards, gids)
    with_nan = torch.cat([rewards, torch.tensor([float("nan")])])
    gids_nan = torch.cat([gids, torch.tensor([0])])  # the NaN row sits in group A (0)
    valid = torch.tensor([True] * 5 + [False])
    dirty = A.group_advantages(with_nan, gids_nan, valid=valid)
    assert torch.equal(dirty[2:5], clean[2:5])  # group B bit-identical
    assert torch.equal(dirty[:2], clean[:2])  # the invalid row contributed nothing to group A
    assert dirty[5].item() == 0.0


def test_invalid_rows_are_excluded_from_statistics():
    # group rewards [1, 0, 100(invalid)] -> statistics from [1, 0] only: A = [0.5, -0.5, 0]
    adv = A.group_advantages(
        torch.tensor([1.0, 0.0, 100.0]),
        torch.zeros(3, dtype=torch.long),
        std_normalize=False,
        valid=torch.tensor([True, True, False]),
    )
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0]))


def test_nonfinite_valid_reward_names_the_row():
    with pytest.raises(ValueError, match="row 2"):
        A.group_advantages(torch.tensor([1.0, 0.0, float("inf")]), torch.zeros(3))


def test_singleton_group_gets_zero():
    adv = A.group_advantages(torch.tensor([5.0]), torch.tensor([0]), leave_one_out=True)
    assert torch.equal(adv, torch.zeros(1))


# ---------------------------------------------------------------- gae
def test_gae_worked_example():
    # one row, three tokens, reward 1 at the end, V = [0.5, 0.5, 0.5], gamma 1, lam 1
    # A_t = sum of future rewards - V_t = 1 - 0.5 = 0.5 at every token; returns = 1
    adv, ret = A.gae(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.5, 0.5]]),
        torch.ones(1, 3),
        gamma=1.0,
        lam=1.0,
    )
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5]]))
    assert torch.allclose(ret, torch.ones(1, 3))


def test_gae_discount_and_lambda():
    # gamma 0.9, lam 0.5, V = [0, 0], r = [0, 1]
    # delta_1 = 1 - 0 = 1; delta_0 = 0 + 0.9 * 0 - 0 = 0
    # A_1 = 1; A_0 = 0 + 0.9 * 0.5 * 1 = 0.45
    adv, _ = A.gae(
        torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), gamma=0.9, lam=0.5
    )
    assert torch.allclose(adv, torch.tensor([[0.45, 1.0]]))


def test_gae_skips_masked_observation_tokens():
    # [act, obs, obs, act] with reward at the end: the masked middle must not break the chain
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.2, 9.0, 9.0, 0.4]])
    m = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv, _ = A.gae(r, v, m, gamma=1.0, lam=1.0)
    ref, _ = A.gae(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2), gamma=1.0, lam=1.0
    )
    assert torch.allclose(adv[:, [0, 3]], ref)
    assert adv[0, 1] == 0 and adv[0, 2] == 0


def test_episode_gae_carries_the_return_across_a_summary_worked_example():
    # Batch rows: [episode 0 segment 0, episode 1, episode 0 segment 1] (an episode's rows need
    # not be adjacent). Episode 0: segment 0 = [prompt, a0, a1 (the summary)], segment 1 =
    # [prompt, prompt, b0], reward 1 on b0; V(a0) = 0.5, V(a1) = 0.25, V(b0) = 0.5;
    # gamma 0.9, lam 0.5. Its states in order are a0, a1, b0:
    #   delta(b0) = 1 + 0 - 0.5 = 0.5                          A(b0) = 0.5
    #   delta(a1) = 0 + 0.9 * V(b0) - 0.25 = 0.2               A(a1) = 0.2 + 0.45 * 0.5 = 0.425
    #   delta(a0) = 0 + 0.9 * V(a1) - 0.5 = -0.275             A(a0) = -0.275 + 0.45 * 0.425
    #                                                                = -0.08375
    #   returns = A + V = 1.0, 0.675, 0.41625
    # (Each segment terminal, the old rows: A(a1) = -0.25, A(a0) = -0.3875: no credit.)
    # Episode 1, one row [prompt, c0], reward 0, V(c0) = 0.5: A(c0) = -0.5, return 0.
    r = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    v = torch.tensor([[0.0, 0.5, 0.25], [0.0, 0.5, 0.0], [0.0, 0.0, 0.5]])
    m = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 1]])
    adv, ret = A.episode_gae(r, v, m, torch.tensor([0, 1, 0]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(
        adv, torch.tensor([[0.0, -0.08375, 0.425], [0.0, -0.5, 0.0], [0.0, 0.0, 0.5]])
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.0, 0.41625, 0.675], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    )
    # each row its own episode: the boundary is terminal, as plain gae
    alone, _ = A.episode_gae(r, v, m, torch.tensor([0, 1, 2]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(alone, A.gae(r, v, m, gamma=0.9, lam=0.5)[0])
    torch.testing.assert_close(alone[0, 1:], torch.tensor([-0.3875, -0.25]))


@pytest.mark.parametrize("seed", range(6))
def test_episode_gae_split_anywhere_equals_single_row_gae(seed):
    # one episode of T tokens (random mask, rewards, values) split into two segments at a random
    # column k, each padded to T: the value at the split bootstraps, so GAE is unchanged
    g = torch.Generator().manual_seed(seed)
    T = 12
    r = torch.randn(1, T, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, generator=g, dtype=torch.float64)
    m = torch.rand(1, T, generator=g) < 0.7
    m[0, 0] = False  # a segment starts with its prompt
    k = int(torch.randint(2, T - 1, (1,), generator=g))
    gamma, lam = 0.95, 0.9
    ref_a, ref_ret = A.gae(r, v, m, gamma=gamma, lam=lam)

    def split(x, fill):
        rows = torch.full((2, T), fill, dtype=x.dtype)
        rows[0, :k], rows[1, : T - k] = x[0, :k], x[0, k:]
        return rows

    rs, vs, ms = split(r, 0.0), split(v, 7.0), split(m, False)  # padding values never read
    adv, ret = A.episode_gae(rs, vs, ms, torch.tensor([3, 3]), gamma=gamma, lam=lam)
    torch.testing.assert_close(torch.cat([adv[0, :k], adv[1, : T - k]]), ref_a[0])
    torch.testing.assert_close(torch.cat([ret[0, :k], ret[1, : T - k]]), ref_ret[0])
    # the per-segment recursion (terminal at the split) differs before it whenever a later
    # token is trainable
    cut, _ = A.gae(rs, vs, ms, gamma=gamma, lam=lam)
    if ms[1].any() and ms[0].any():
        assert not torch.allclose(cut[0, :k], ref_a[0, :k])


def test_episode_gae_rejects_misshapen_episode_ids():
    with pytest.raises(ValueError, match="episode_ids"):
        A.episode_gae(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3), gamma=1, lam=1
        )


# ---------------------------------------------------------------- aggregate
def _losses():
    # [2, 2, 2, 2, 2] (length 5) and [10] (length 1), padded to 10
    x = torch.zeros(2, 10)
    m = torch.zeros(2, 10)
    x[0, :5], m[0, :5] = 2.0, 1
    x[1, 0], m[1, 0] = 10.0, 1
    return x, m


def test_aggregate_worked_examples():
    x, m = _losses()
    # token-mean: (5 * 2 + 10) / 6 = 3.3333
    assert A.aggregate(x, m, "token-mean").item() == pytest.approx(3.33333, abs=1e-4)
    # seq-mean-token-mean: (2 + 10) / 2 = 6
    assert A.aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx(6.0)
    # seq-mean-token-sum: (10 + 10) / 2 = 10
    assert A.aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx(10.0)
    # Dr. GRPO: 20 / (B * max_len) = 20 / (2 * 10) = 1
    assert A.aggregate(x, m, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(1.0)


def test_aggregate_ignores_nan_in_padding():
    x, m = _losses()
    x[0, 7] = float("nan")
    assert A.aggregate(x, m, "token-mean").item() == pytest.approx(3.33333, abs=1e-4)


def test_aggregate_unknown_mode_lists_valid():
    x, m = _losses()
    with pytest.raises(ValueError, match="token-mean"):
        A.aggregate(x, m, "tokenmean")


# ---------------------------------------------------------------- KL
def test_kl_zero_when_policy_equals_reference():
    lp = torch.tensor([[-0.3, -1.2]])
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(A.kl_penalty(lp, lp.clone(), kind), torch.zeros(1, 2))


def test_kl_worked_values():
    # logp = log 0.5, ref = log 0.25: log_r = log 0.5 = -0.6931
    # k1 = 0.6931; k2 = 0.5 * 0.4805 = 0.2402; k3 = 0.5 - 1 + 0.6931 = 0.1931
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert A.kl_penalty(lp, ref, "k1").item() == pytest.approx(0.6931, abs=1e-4)
    assert A.kl_penalty(lp, ref, "k2").item() == pytest.approx(0.2402, abs=1e-4)
    assert A.kl_penalty(lp, ref, "k3").item() == pytest.approx(0.1931, abs=1e-4)


def test_kl_k3_finite_for_extreme_ratio():
    out = A.kl_penalty(torch.tensor([[-200.0]]), torch.tensor([[0.0]]), "k3")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_sgd_step_on_kl_lowers_true_kl(kind):
    # policy logits [1, 0] (p = [0.731, 0.269]), reference uniform [0.5, 0.5]
    logits = torch.tensor([1.0, 0.0], requires_grad=True)
    ref = torch.log(torch.tensor([0.5, 0.5]))

    def true_kl():
        p = logits.softmax(-1)
        return (p * (p.log() - ref)).sum()

    before = true_kl().item()  # 0.731 ln 1.462 + 0.269 ln 0.538 = 0.2777 - 0.1668 = 0.1109
    assert before == pytest.approx(0.1109, abs=1e-3)
    logp = logits.log_softmax(-1)
    # exact expectation over the two actions, weighted by the (detached) sampling probabilities
    est = A.kl_penalty(logp[None], ref[None], kind)[0]
    loss = (logp.exp().detach() * est).sum()
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    assert true_kl().item() < before


def _kl_gradients(theta: torch.Tensor, ref_logp: torch.Tensor):
    """Exact gradients at ``theta`` (policy logits) of KL(pi || ref) and of KL(ref || pi)."""
    th = theta.clone().requires_grad_(True)
    lp = th.log_softmax(-1)
    (rev,) = torch.autograd.grad((lp.exp() * (lp - ref_logp)).sum(), th)
    th = theta.clone().requires_grad_(True)
    lp = th.log_softmax(-1)
    (fwd,) = torch.autograd.grad((ref_logp.exp() * (ref_logp - lp)).sum(), th)
    return rev, fwd


def _estimator_gradient(theta, ref_logp, kind, samples=None):
    """Gradient of the estimator used as a loss: the mean over ``samples`` drawn from pi, or the
    exact expectation over pi (each token weighted by its detached probability) if None."""
    th = theta.clone().requires_grad_(True)
    lp = th.log_softmax(-1)  # (V,)
    if samples is None:
        per = A.kl_penalty(lp[None], ref_logp[None], kind)[0]  # (V,)
        loss = (lp.exp().detach() * per).sum()
    else:
        loss = A.kl_penalty(lp[samples][None], ref_logp[samples][None], kind).mean()
    (g,) = torch.autograd.grad(loss, th)
    return g


# a two-token policy p = softmax([1, -0.5]) = [0.818, 0.182] against ref = softmax([-0.5, 0.5]) =
# [0.269, 0.731]: grad KL(pi || ref) = [0.3729, -0.3729], grad KL(ref || pi) = [0.5486, -0.5486]
TWO_TOKEN = (torch.tensor([1.0, -0.5], dtype=torch.float64), torch.tensor([-0.5, 0.5]))
THREE_TOKEN = (torch.tensor([0.3, -1.0, 0.8], dtype=torch.float64), torch.tensor([1.0, 0.0, -1.0]))


@pytest.mark.parametrize("policy", [TWO_TOKEN, THREE_TOKEN], ids=["2 tokens", "3 tokens"])
def test_loss_estimator_gradient_is_grad_kl_pi_ref_by_monte_carlo(policy):
    # The KL loss estimator, differentiated on samples of pi, must follow grad KL(pi || ref); k3
    # (GRPO's) follows grad KL(ref || pi) instead and k1's gradient is 0 in expectation
    # (Tang & Munos 2025). 200k samples: Monte Carlo error ~3e-3, the two gradients differ by >0.1.
    theta, ref_logits = policy
    ref = ref_logits.double().log_softmax(-1)
    rev, fwd = _kl_gradients(theta, ref)
    assert (rev - fwd).norm() > 0.1
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(theta.softmax(-1), 200_000, replacement=True, generator=g)
    mc = {k: _estimator_gradient(theta, ref, k, x) for k in ("k1", "k2", "k3")}
    loss_mc = mc[A.KL_LOSS_ESTIMATOR]
    assert (loss_mc - rev).norm() < 0.02
    assert (loss_mc - fwd).norm() > 0.1
    assert (mc["k3"] - fwd).norm() < 0.02  # why k3 is not the loss
    assert mc["k1"].norm() < 0.02
    # the exact expectations say the same to float precision
    exact = {k: _estimator_gradient(theta, ref, k) for k in ("k1", "k2", "k3")}
    torch.testing.assert_close(exact[A.KL_LOSS_ESTIMATOR], rev, rtol=0, atol=1e-12)
    torch.testing.assert_close(exact["k3"], fwd, rtol=0, atol=1e-12)
    torch.testing.assert_close(exact["k1"], torch.zeros_like(rev), rtol=0, atol=1e-12)


def test_two_token_kl_gradients_worked():
    # d/dtheta_0 KL(pi || ref) = p0 p1 (log(p0/r0) - log(p1/r1))
    #   = 0.8176 * 0.1824 * (log(0.8176/0.2689) - log(0.1824/0.7311)) = 0.1491 * 2.5005 = 0.3729
    # d/dtheta_0 KL(ref || pi) = p0 - r0 = 0.8176 - 0.2689 = 0.5486
    theta, ref_logits = TWO_TOKEN
    rev, fwd = _kl_gradients(theta, ref_logits.double().log_softmax(-1))
    assert rev[0].item() == pytest.approx(0.3729, abs=1e-4)
    assert fwd[0].item() == pytest.approx(0.5486, abs=1e-4)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k3"):
        A.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------- token_logprobs / entropy
def test_token_logprobs_temperature_before_softmax():
    # logits / 0.5 = [4, 2, 0]; log softmax at 0 = 4 - log(e^4 + e^2 + 1) = 4 - 4.1429 = -0.1429
    # (-0.4076 would be T=1; -0.815 would be dividing the T=1 logprob by T)
    lp = A.token_logprobs(torch.tensor([[[2.0, 1.0, 0.0]]]), torch.tensor([[0]]), temperature=0.5)
    assert lp.item() == pytest.approx(-0.1429, abs=1e-4)


def test_token_logprobs_rejects_zero_temperature():
    with pytest.raises(ValueError):
        A.token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0)


def test_entropy_uniform_and_masked():
    # uniform over 4: ln 4 = 1.3863; masked position -> 0
    h = A.entropy(torch.zeros(1, 2, 4), torch.tensor([[1, 0]]))
    assert h[0, 0].item() == pytest.approx(math.log(4), abs=1e-5)
    assert h[0, 1].item() == 0.0


# ---------------------------------------------------------------- policy_loss
def test_ppo_ratio_and_clip_worked_example():
    # behaviour -1.0, current -0.5: ratio e^0.5 = 1.6487; A = 1 > 0, clip 0.2 -> objective 1.2 * A
    logp = torch.tensor([[-0.5]], requires_grad=True)
    loss, m = A.policy_loss(logp, torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1))
    assert m["ratio_mean"] == pytest.approx(1.6487, abs=1e-4)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0
    loss.backward()
    assert logp.grad.item() == 0.0  # clipped: no gradient pushes the ratio further


def test_ppo_unclipped_inside_range():
    # ratio e^0.1 = 1.1052 inside [0.8, 1.2]: loss = -1.1052 * 2
    loss, _ = A.policy_loss(
        torch.tensor([[-0.9]]), torch.tensor([[-1.0]]), torch.tensor([2.0]), torch.ones(1, 1)
    )
    assert loss.item() == pytest.approx(-2.2103, abs=1e-4)


def test_ppo_clip_higher_asymmetric():
    # ratio 1.25, A > 0: clip_high 0.28 keeps 1.25 (DAPO clip-higher); clip_high 0.2 uses 1.2
    lp, old = torch.tensor([[math.log(1.25)]]), torch.tensor([[0.0]])
    a, mask = torch.tensor([1.0]), torch.ones(1, 1)
    assert A.policy_loss(lp, old, a, mask, clip_high=0.28)[0].item() == pytest.approx(-1.25)
    assert A.policy_loss(lp, old, a, mask, clip_high=0.2)[0].item() == pytest.approx(-1.2)


def test_dual_clip_caps_negative_advantage():
    # ratio e^2 = 7.389, A = -1: plain PPO loss = -min(-7.389, -1.2) = 7.389; dual clip 3 caps at 3
    lp, old, a, m = (
        torch.tensor([[2.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
    )
    assert A.policy_loss(lp, old, a, m)[0].item() == pytest.approx(7.389, abs=1e-3)
    loss, met = A.policy_loss(lp, old, a, m, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert met["dual_clip_frac"] == 1.0


def test_policy_loss_rejects_missing_or_nonfinite_old_logp():
    lp, a, m = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="position 1"):
        A.policy_loss(lp, torch.tensor([[0.0, float("nan")]]), a, m)
    with pytest.raises(ValueError):
        A.policy_loss(lp, None, a, m)  # type: ignore[arg-type]


def test_policy_loss_ignores_nonfinite_old_logp_at_padding():
    loss, _ = A.policy_loss(
        torch.zeros(1, 2),
        torch.tensor([[0.0, float("nan")]]),
        torch.tensor([1.0]),
        torch.tensor([[1, 0]]),
    )
    assert loss.item() == pytest.approx(-1.0)


def test_policy_loss_importance_weights_scale_tokens():
    # ratio 1, A = 1, weights [0.5, 2]: per-token [-0.5, -2], token-mean -1.25
    loss, _ = A.policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        weights=torch.tensor([[0.5, 2.0]]),
    )
    assert loss.item() == pytest.approx(-1.25)


def test_rejected_tokens_leave_the_normaliser():
    # ratio 1, A = 1, weights [1, 1, 0, 1] (token 2 rejected by masked importance sampling):
    # token-mean = -(1 + 1 + 1) / 3 = -1.0, not -(1 + 1 + 0 + 1) / 4 = -0.75; the same loss as
    # with token 2 masked out
    lp, old, a = torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([1.0])
    w = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    loss, m = A.policy_loss(lp, old, a, torch.ones(1, 4), weights=w)
    assert loss.item() == pytest.approx(-1.0)
    masked, _ = A.policy_loss(lp, old, a, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    assert loss.item() == masked.item()
    assert m["ratio_mean"] == 1.0
    # seq-mean-token-mean: row 1 entirely rejected leaves the row count:
    # row 0 kept [1, 1, -, 1] -> -1; mean over the one non-empty row = -1.0 (not -0.5)
    w2 = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    loss2, _ = A.policy_loss(
        torch.zeros(2, 4),
        torch.zeros(2, 4),
        torch.ones(2),
        torch.ones(2, 4),
        weights=w2,
        agg="seq-mean-token-mean",
    )
    assert loss2.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        A.policy_loss(lp, old, a, torch.ones(1, 4), weights=-w)


def test_policy_loss_per_token_advantages():
    loss, _ = A.policy_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)
    )
    assert loss.item() == pytest.approx(-2.0)


# ---------------------------------------------------------------- importance_weights
def test_importance_weights_token_truncate():
    # log ratios [ln 0.5, ln 3]: weights [0.5, 3] -> truncated at cap 2 -> [0.5, 2]
    w = A.importance_weights(
        torch.log(torch.tensor([[0.5, 3.0]])), torch.zeros(1, 2), torch.ones(1, 2), cap=2.0
    )
    assert torch.allclose(w, torch.tensor([[0.5, 2.0]]))


def test_importance_weights_sequence_is_geometric_mean():
    # token ratios [2, 8] -> geometric mean 4 (the product would be 16); cap 10
    w = A.importance_weights(
        torch.log(torch.tensor([[2.0, 8.0, 1.0]])),
        torch.zeros(1, 3),
        torch.tensor([[1, 1, 0]]),
        level="sequence",
        cap=10.0,
    )
    assert torch.allclose(w, torch.tensor([[4.0, 4.0, 0.0]]))


def test_importance_weights_mask_mode_zeroes_outside():
    # ratios [0.5, 1.0, 3.0] with [low, cap] = [0.8, 2] -> [0, 1, 0]
    w = A.importance_weights(
        torch.log(torch.tensor([[0.5, 1.0, 3.0]])),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        mode="mask",
        low=0.8,
        cap=2.0,
    )
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0]]))


def test_importance_weights_finite_for_extreme_inputs():
    w = A.importance_weights(
        torch.tensor([[1e4, -1e4]]),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        level="sequence",
        mode="mask",
    )
    assert torch.isfinite(w).all()


# ---------------------------------------------------------------- value_loss
def test_value_loss_clip():
    # V = 2, old V = 0, R = 0, clip 0.5: unclipped 0.5 * 4 = 2; clipped V' = 0.5 -> 0.125; max = 2
    v = torch.tensor([[2.0]])
    assert A.value_loss(v, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)).item() == 2.0
    # V = 0.2, old V = 1, R = 1, clip 0.5: unclipped 0.5 * 0.64 = 0.32; clipped V' = 0.5 -> 0.125
    assert A.value_loss(
        torch.tensor([[0.2]]), torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip=0.5
    ).item() == pytest.approx(0.32)


# ---------------------------------------------------------------- pass@k, best-of-n
def test_pass_at_k_worked():
    assert A.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert A.pass_at_k(4, 1, 4) == pytest.approx(1.0)
    assert A.pass_at_k(2, 0, 5) == 0.0
    # n=10, c=3, k=2: 1 - C(7,2)/C(10,2) = 1 - 21/45 = 0.5333
    assert A.pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)


def test_pass_at_k_matches_combinatorial_formula():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert A.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError):
        A.pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        A.pass_at_k(3, 1, 0)


def test_best_of_n():
    assert A.best_of_n([[0, 1, 0], [0, 0, 0]]) == 0.5
    with pytest.raises(ValueError):
        A.best_of_n([])
