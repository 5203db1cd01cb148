import math
import time

import pytest

from coderl.config import RewardConfig
from coderl.rewards import REWARD_TERMS, RewardArityError, RewardSample, compute_rewards


def _cfg(**kw):
    return RewardConfig(**kw)


def test_tests_and_broken_call_terms_with_breakdown():
    cfg = _cfg(
        terms={"tests": 1.0, "broken_calls": 1.0}, broken_call_penalty=0.2, broken_call_cap=2
    )
    samples = [
        RewardSample("a", resolved=True),
        RewardSample("a", resolved=False, broken_tool_calls=1),
        RewardSample("a", resolved=False, broken_tool_calls=7),  # capped at 2 -> -0.4
    ]
    r = compute_rewards(samples, cfg)
    assert r.totals == pytest.approx([1.0, -0.2, -0.4])
    assert r.breakdown[1] == pytest.approx({"tests": 0.0, "broken_calls": -0.2})
    assert r.valid == [True, True, True]
    assert r.counts["masked"] == 0


def test_fraction_mode():
    r = compute_rewards(
        [RewardSample("a", fraction_passed=0.75)], _cfg(terms={"tests": 1.0}, tests="fraction")
    )
    assert r.totals == [0.75]


def test_length_penalty_scales_with_difficulty():
    # budget 100, free 0.2, power 2, coef 0.1. 60 tokens: excess = (0.6-0.2)/0.8 = 0.5 -> 0.25.
    cfg = _cfg(terms={"length": 1.0}, length={"coef": 0.1, "free_fraction": 0.2, "power": 2.0})
    easy = [RewardSample("easy", resolved=True, sampled_tokens=60, token_budget=100)] * 1
    easy = easy + [RewardSample("easy", resolved=True, sampled_tokens=10, token_budget=100)]
    half = [
        RewardSample("half", resolved=True, sampled_tokens=60, token_budget=100),
        RewardSample("half", resolved=False, sampled_tokens=100, token_budget=100),
    ]
    hard = [RewardSample("hard", resolved=False, sampled_tokens=100, token_budget=100)] * 2
    meta = [RewardSample("meta", ease=1.0, sampled_tokens=100, token_budget=100)]
    r = compute_rewards(easy + half + hard + meta, cfg)
    # easy: ease 1 -> -0.1 * 0.25 = -0.025; 10 tokens is inside the free 20% -> 0
    # half: ease 0.5 -> -0.1 * 0.5 * 0.25 = -0.0125 and -0.1 * 0.5 * 1 = -0.05
    # hard: ease 0 -> 0 whatever the length; meta: ease 1 from metadata, full budget -> -0.1
    assert r.totals == pytest.approx([-0.025, 0.0, -0.0125, -0.05, 0.0, 0.0, -0.1])


def test_kl_in_reward_is_k1():
    r = compute_rewards([RewardSample("a", kl_k1=2.0)], _cfg(terms={"kl": 1.0}, kl_coef=0.05))
    assert r.totals == pytest.approx([-0.1])


def test_crashing_term_masks_that_sample_and_is_counted():
    def flaky(samples, cfg):
        out = []
        for s in samples:
            if s.task_id == "boom":
                raise RuntimeError("reward server down")
            out.append(1.0)
        return out

    terms = dict(REWARD_TERMS, flaky=flaky)
    samples = [RewardSample("ok"), RewardSample("boom"), RewardSample("ok", resolved=True)]
    r = compute_rewards(samples, _cfg(terms={"tests": 1.0, "flaky": 1.0}), terms)
    assert r.valid == [True, False, True]
    assert r.totals[0] == 1.0 and math.isnan(r.totals[1]) and r.totals[2] == 2.0
    assert r.counts["term_errors"] == 1 and r.counts["masked"] == 1
    assert "reward server down" in r.errors[0]


def test_a_term_that_exits_masks_its_sample_and_never_stops_the_trainer():
    """A term that raises ``SystemExit`` (a ``BaseException``: ``sys.exit`` or ``argparse`` on
    what the policy wrote) fails like any crashing term: masked and counted. It was re-raised
    in the trainer's thread before, past every ``except Exception``."""

    def exits(samples, cfg):
        if any(s.task_id == "exit" for s in samples):
            raise SystemExit(2)
        return [1.0] * len(samples)

    def not_a_number(samples, cfg):
        return ["n/a" if s.task_id == "exit" else 1.0 for s in samples]

    terms = dict(REWARD_TERMS, exits=exits, not_a_number=not_a_number)
    for name in ("exits", "not_a_number"):
        r = compute_rewards(
            [RewardSample("ok"), RewardSample("exit")], _cfg(terms={name: 1.0}), terms
        )
        assert r.valid == [True, False] and r.counts["term_errors"] == 1, name
    assert (
        "SystemExit"
        in compute_rewards([RewardSample("exit")], _cfg(terms={"exits": 1.0}), terms).errors[0]
    )


def test_timed_out_term_masks_and_counts():
    def slow(samples, cfg):
        if any(s.task_id == "slow" for s in samples):
            time.sleep(0.5)
        return [0.0] * len(samples)

    terms = dict(REWARD_TERMS, slow=slow)
    cfg = _cfg(terms={"slow": 1.0}, term_timeout_s=0.1)
    r = compute_rewards([RewardSample("fast"), RewardSample("slow")], cfg, terms)
    assert r.valid == [True, False]
    assert r.counts["term_timeouts"] == 1


def test_grading_error_masks_and_is_excluded_from_group_rate():
    samples = [RewardSample("a", resolved=True), RewardSample("a", grading_error="sandbox died")]
    r = compute_rewards(samples, _cfg(terms={"tests": 1.0}))
    assert r.valid == [True, False] and r.counts["grading_errors"] == 1
    assert samples[0].group_pass_rate == 1.0


def test_wrong_number_of_values_is_an_error():
    terms = dict(REWARD_TERMS, short=lambda samples, cfg: [1.0])
    with pytest.raises(RewardArityError, match="'short' returned 1 values for 2 samples"):
        compute_rewards([RewardSample("a"), RewardSample("b")], _cfg(terms={"short": 1.0}), terms)


def test_unknown_term_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: \\['broken_calls'"):
        compute_rewards([RewardSample("a")], _cfg(terms={"nope": 1.0}))
