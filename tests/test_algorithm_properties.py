"""Property tests (hypothesis) for invariants of coderl.algorithms."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coderl import algorithms as A

rewards_st = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(rewards_st, st.integers(1, 4), st.booleans(), st.booleans(), st.data())
def test_group_advantages_sum_to_zero(rewards, n_groups, std_normalize, loo, data):
    gids = data.draw(
        st.lists(st.integers(0, n_groups), min_size=len(rewards), max_size=len(rewards))
    )
    valid = data.draw(st.lists(st.booleans(), min_size=len(rewards), max_size=len(rewards)))
    r = torch.tensor(rewards, dtype=torch.float64)
    g, v = torch.tensor(gids), torch.tensor(valid)
    adv = A.group_advantages(r, g, std_normalize=std_normalize, leave_one_out=loo, valid=v)
    assert torch.isfinite(adv).all()
    assert (adv[~v] == 0).all()
    for gid in g.unique():
        rows = g == gid
        assert abs(adv[rows].sum().item()) < 1e-6 * max(1.0, adv.abs().max().item())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 6), st.data())
def test_aggregate_invariant_to_padding(B, T, pad, data):
    vals = data.draw(st.lists(st.floats(-5, 5, width=32), min_size=B * T, max_size=B * T))
    bits = data.draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    x = torch.tensor(vals, dtype=torch.float64).view(B, T)
    m = torch.tensor(bits).view(B, T)
    xp = torch.cat([x, torch.randn(B, pad, dtype=torch.float64)], dim=1)
    mp = torch.cat([m, torch.zeros(B, pad, dtype=torch.bool)], dim=1)
    for mode in A.AGGREGATIONS:
        a = A.aggregate(x, m, mode, max_len=16)
        b = A.aggregate(xp, mp, mode, max_len=16)
        assert torch.allclose(a, b, atol=1e-9), mode


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=2, max_size=16),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from(["truncate", "mask"]),
)
def test_importance_weights_finite_and_bounded(lps, level, mode):
    t = torch.tensor(lps, dtype=torch.float32).view(1, -1)
    w = A.importance_weights(
        t, torch.zeros_like(t), torch.ones_like(t), level=level, mode=mode, cap=2.0
    )
    assert torch.isfinite(w).all()
    assert (w <= 2.0).all() and (w >= 0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.data())
def test_pass_at_k_monotone_in_k(n, data):
    c = data.draw(st.integers(0, n))
    vals = [A.pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(0.0 <= v <= 1.0 for v in vals)
    assert all(a <= b + 1e-12 for a, b in zip(vals, vals[1:], strict=False))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 16), st.integers(1, 4), st.integers(0, 3), st.data())
def test_episode_gae_of_an_episode_cut_into_segments_is_its_gae(T, n_cuts, other, data):
    # an episode cut into segments at any points (rows padded to T, interleaved with `other`
    # one-row episodes) gets exactly the GAE of its uncut row
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    r, v = torch.randn(1, T, generator=g, dtype=torch.float64), torch.randn(1, T, generator=g)
    v = v.double()
    m = torch.rand(1, T, generator=g) < 0.7
    gamma, lam = data.draw(st.floats(0, 1)), data.draw(st.floats(0, 1))
    cuts = sorted(data.draw(st.lists(st.integers(1, T - 1), min_size=n_cuts, max_size=n_cuts)))
    bounds = [0, *cuts, T]
    rows_r, rows_v, rows_m, ids = [], [], [], []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        for x, rows in ((r, rows_r), (v, rows_v), (m, rows_m)):
            row = torch.zeros(T, dtype=x.dtype)
            row[: b - a] = x[0, a:b]
            rows.append(row)
        ids.append(0)
        if k < other:  # another episode's row between two segments
            rows_r.append(torch.ones(T, dtype=r.dtype))
            rows_v.append(torch.ones(T, dtype=v.dtype))
            rows_m.append(torch.ones(T, dtype=torch.bool))
            ids.append(k + 1)
    adv, ret = A.episode_gae(
        torch.stack(rows_r),
        torch.stack(rows_v),
        torch.stack(rows_m),
        torch.tensor(ids),
        gamma=gamma,
        lam=lam,
    )
    ref_a, ref_ret = A.gae(r, v, m, gamma=gamma, lam=lam)
    mine = [i for i, e in enumerate(ids) if e == 0]
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    got_a = torch.cat([adv[i, :n] for i, n in zip(mine, lengths, strict=True)])
    got_ret = torch.cat([ret[i, :n] for i, n in zip(mine, lengths, strict=True)])
    torch.testing.assert_close(got_a, ref_a[0])
    torch.testing.assert_close(got_ret, ref_ret[0])
