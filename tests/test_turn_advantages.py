"""Turn-level credit (coderl.algorithms.turn_advantages): hand-worked values and invariants."""

import pytest
import torch

from coderl import algorithms as A

# A 3-turn episode with outcome R = 1 (on its last turn). Values at its boundaries:
#   V(s_0) = 0.5   the group mean of the full episodes
#   V(s_1) = 0.25  K = 4 continuations from s_1 returned 0, 0, 1, 0
#   V(s_2) = 0.75  K = 4 continuations from s_2 returned 1, 1, 0, 1
#   V(s_3) = 0     terminal (the outcome is the last turn's reward)
CONT = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]]], dtype=torch.float64)
REWARDS = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1]], dtype=torch.bool)


def _values(v1_known: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    v, known = A.mc_turn_values(CONT, torch.ones_like(CONT, dtype=torch.bool))
    values = torch.tensor([[0.5, float(v[0, 0]), float(v[0, 1]), 0.0]], dtype=torch.float64)
    known = torch.tensor([[True, v1_known, bool(known[0, 1]), False]])
    return values, known


def test_mc_values_mean_of_valid_continuations():
    returns = torch.tensor([[[0.0, 1.0, float("nan")], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    valid = torch.tensor([[[True, True, False], [False, False, False]]])
    v, known = A.mc_turn_values(returns, valid)
    # (0 + 1) / 2 over the two valid ones; the NaN one is masked; no continuation: unknown
    assert v.tolist() == [[0.5, 0.0]] and known.tolist() == [[True, False]]
    with pytest.raises(ValueError, match="non-finite"):
        A.mc_turn_values(returns, torch.ones_like(valid))


def test_vineppo_three_turns_by_hand():
    values, known = _values()
    assert values[0, :3].tolist() == [0.5, 0.25, 0.75]
    adv, ret = A.turn_advantages(values, known, REWARDS, MASK)  # gamma = 1, lam = 0
    # A_0 = V1 - V0 = 0.25 - 0.5; A_1 = V2 - V1 = 0.75 - 0.25; A_2 = R - V2 = 1 - 0.75
    assert adv.tolist() == [[-0.25, 0.5, 0.25]]
    assert ret.tolist() == [[0.25, 0.75, 1.0]]  # A + V(s_t): the one-step targets
    # the advantages telescope to the episode's outcome advantage R - V(s_0)
    assert float(adv.sum()) == 1.0 - 0.5


def test_turn_gae_lambda_and_gamma_by_hand():
    values, known = _values()
    adv, _ = A.turn_advantages(values, known, REWARDS, MASK, lam=1.0)
    # lam = 1: A_t = G - V(s_t) = 1 - 0.5, 1 - 0.25, 1 - 0.75
    assert adv.tolist() == [[0.5, 0.75, 0.25]]
    adv, _ = A.turn_advantages(values, known, REWARDS, MASK, lam=0.5)
    # A_2 = 0.25; A_1 = 0.5 + 0.5 * 0.25 = 0.625; A_0 = -0.25 + 0.5 * 0.625 = 0.0625
    assert adv.tolist() == [[0.0625, 0.625, 0.25]]
    adv, _ = A.turn_advantages(values, known, REWARDS, MASK, gamma=0.5)
    # A_0 = 0.5 * 0.25 - 0.5 = -0.375; A_1 = 0.5 * 0.75 - 0.25 = 0.125; A_2 = 1 - 0.75
    assert adv.tolist() == [[-0.375, 0.125, 0.25]]


def test_unbranched_boundary_merges_turns():
    values, known = _values(v1_known=False)  # no continuation sampled at s_1
    adv, _ = A.turn_advantages(values, known, REWARDS, MASK)
    # turns 0 and 1 are one step from s_0 to s_2: V2 - V0 = 0.75 - 0.5 for both; A_2 = 0.25
    assert adv.tolist() == [[0.25, 0.25, 0.25]]
    adv, _ = A.turn_advantages(values, known, REWARDS, MASK, gamma=0.5)
    # the merged step is two turns long: discount 0.5^2: 0.25 * 0.75 - 0.5 = -0.3125
    assert adv.tolist() == [[-0.3125, -0.3125, 0.25]]


def test_padding_and_errors():
    values = torch.tensor([[0.5, 0.25, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]], dtype=torch.float64)
    known = torch.tensor([[True, True, False, False], [True, False, False, False]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv, _ = A.turn_advantages(values, known, rewards, mask)
    # episode 0: 0.25 - 0.5, 1 - 0.25; episode 1 (one turn, R = 0): 0 - 0.2; padding stays 0
    assert adv.tolist() == [[-0.25, 0.75, 0.0], [-0.2, 0.0, 0.0]]
    with pytest.raises(ValueError, match="prefix"):
        A.turn_advantages(values, known, rewards, torch.tensor([[1, 0, 1], [1, 0, 0]]))
    with pytest.raises(ValueError, match="s_0"):
        A.turn_advantages(values, known & False, rewards, mask)


def test_potential_shaping_by_hand():
    # Phi after each turn's tests: 0 at the start, half the visible tests pass after turn 1 and 2;
    # the terminal's potential is 0 (the 0.9 after the last turn is ignored)
    phi = torch.tensor([[0.0, 0.5, 0.5, 0.9]], dtype=torch.float64)
    f = A.potential_shaping(phi, MASK)
    # F_0 = 0.5 - 0; F_1 = 0.5 - 0.5; F_2 = 0 - 0.5 (terminal): the sum is -Phi(s_0) = 0
    assert f.tolist() == [[0.5, 0.0, -0.5]]
    f = A.potential_shaping(phi, MASK, gamma=0.5)
    # F_0 = 0.25; F_1 = 0.25 - 0.5; F_2 = -0.5; sum_t 0.5^t F_t = 0.25 - 0.125 - 0.125 = 0
    assert f.tolist() == [[0.25, -0.25, -0.5]]


def test_shaping_keeps_the_order_of_complete_episodes():
    """Shaped return = G - Phi(s_0) (telescoping, Phi(terminal) = 0); Phi(s_0) is the task's,
    so the episodes of one task keep their order whatever the potentials in between. 200 random
    tasks (a seeded sweep: hypothesis costs ~1 s an example on the shared CI box)."""
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        n_eps, max_turns = 2 + case % 5, 1 + case % 4
        gamma = (1.0, 0.9)[case % 2]
        turns = torch.randint(1, max_turns + 1, (n_eps,), generator=g)
        mask = torch.arange(max_turns)[None, :] < turns[:, None]  # (E, T)
        phi = torch.rand(n_eps, max_turns + 1, generator=g, dtype=torch.float64)
        phi[:, 0] = 0.3  # the task's starting state: the same in every episode
        outcome = torch.rand(n_eps, generator=g, dtype=torch.float64)
        rewards = torch.zeros(n_eps, max_turns, dtype=torch.float64)
        rewards[torch.arange(n_eps), turns - 1] = outcome
        disc = gamma ** torch.arange(max_turns, dtype=torch.float64)  # (T,)
        plain = (rewards * disc).sum(1)  # (E,)
        shaped = ((rewards + A.potential_shaping(phi, mask, gamma=gamma)) * disc).sum(1)
        assert float((shaped - (plain - 0.3)).abs().max()) < 1e-12
        assert torch.equal(shaped.argsort(), plain.argsort()), case
