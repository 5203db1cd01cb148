"""Reward terms checked against each other: no cheaper behaviour can outscore solving.

A composed reward ``sum_name weight_name * term_name`` is only a training signal for solving if
every episode that solves its task (``resolved``) can outscore every episode that does not, by
whatever the other terms add or take away. :func:`check_reward_order` proves that from the
terms' per-episode ranges (weighted) before a run starts, one pair at a time and then all the
pairs at once, and refuses the config otherwise:

=================  ==========================================  ================================
term               range per episode (weighted)                what the check needs
=================  ==========================================  ================================
``tests``          ``resolved``: w if solved, else 0;          present with w > 0; the
                   ``fraction``: w times the share of          *margin* is w (``resolved``)
                   FAIL_TO_PASS tests passed, 0 when a
                   PASS_TO_PASS test breaks
``length``         ``-w * length.coef`` .. 0 (a long solving   ``w * coef < margin``: the work
                   episode pays it)                            of solving never costs the fix
``broken_calls``   ``-w * penalty * cap`` .. 0 (never needed   one call costs more than the
                   to solve)                                   length penalty can save, and
                                                               less than the margin
``judge``          0 .. w (rubric score in [0, 1])             gated on the tests
                                                               (``learned_requires_tests``, the
                                                               default), or ``w < margin``
``rm``             0 .. w with ``rm.squash``; unbounded        ``rm.squash``; then as ``judge``
                   without
``kl``             unbounded either way (k1 estimate)          not checked (see Limits)
=================  ==========================================  ================================

Every weight is at least 0: a term carries its own sign, so a negative weight would pay for
what the term penalises (``broken_calls: -1`` paid a failing episode with five broken calls as
much as a solve). All pairs at once: the length penalty a solving episode may pay and one broken call, plus what
the ungated learned terms can pay a failing one, stay below the margin. With ``tests: fraction`` an episode that
fails one test of n earns ``w * (1 - 1/n)``, so the margin is not known before the task is: no
other term that can lower a solving episode or raise a failing one is accepted with it.

Limits: the KL-in-reward term (``kl``) is a per-episode sum of log-ratios with no bound, so its
order against the tests cannot be proved; it regularises towards the reference policy, which
staying put (not solving) always satisfies. Keep ``kl_coef`` small; the check does not.
"""

from __future__ import annotations

from typing import Any

LEARNED = ("judge", "rm")
"""The learned terms: each pays at most its weight per episode (``rm`` with ``squash``)."""


def check_reward_order(rew: Any) -> None:
    """Refuse a reward composition (``rew``: a :class:`coderl.config.RewardConfig`; duck-typed
    because the config package imports this module) under which an episode that does not solve its task can
    outscore one that does (see the module docstring for each term's range).

    Raises:
        ValueError: naming the terms of the pair that breaks the order and their values.
    """
    w = rew.terms
    negative = {k: v for k, v in w.items() if v < 0}
    if negative:  # each term carries its own sign: a negative weight turns a penalty into pay
        raise ValueError(
            f"reward.terms={w}: negative weights {negative}; a weight scales a term, the term "
            "carries its sign (length and broken_calls are already penalties, judge and rm "
            "rewards), so a negative weight pays for what the term penalises"
        )
    if w.get("tests", 0.0) <= 0:
        raise ValueError(
            f"reward.terms={w}: no positive tests term, so nothing pays for solving the task"
        )
    if "rm" in w and not rew.rm.squash:
        raise ValueError(
            "reward.rm.squash=false: the reward model's raw score is unbounded, so a solved "
            "episode could score below a failing one; keep squash (sigmoid) on"
        )
    length = w.get("length", 0.0) * rew.length.coef
    one_call = w.get("broken_calls", 0.0) * rew.broken_call_penalty
    ungated = 0.0 if rew.learned_requires_tests else sum(w.get(t, 0.0) for t in LEARNED)
    if rew.tests == "fraction":
        others = {"length": length, "broken_calls": one_call, "ungated learned terms": ungated}
        bad = sorted(k for k, v in others.items() if v > 0)
        if bad:
            raise ValueError(
                f"reward.tests=fraction pays a failing episode up to the full test reward, so "
                f"no margin is left for {bad}: use reward.tests=resolved with them"
            )
        return
    margin = w["tests"]
    if length >= margin:
        raise ValueError(
            f"reward.length.coef: the length penalty can take {length:g} from a solving "
            f"episode, at least the test reward {margin:g}: a short wrong episode would "
            "outscore a long correct one"
        )
    if one_call > 0 and one_call <= length:
        raise ValueError(
            f"reward.broken_call_penalty: a broken call costs {one_call:g} but the length "
            f"penalty can reach {length:g}; breaking a call would dodge a negative reward"
        )
    if one_call >= margin:
        raise ValueError(
            f"reward.broken_call_penalty: one broken call costs {one_call:g}, at least the test "
            f"reward {margin:g}: giving up would outscore solving after one slip"
        )
    if ungated >= margin:
        raise ValueError(
            f"reward.learned_requires_tests=false: the learned terms can pay a failing episode "
            f"{ungated:g}, at least the test reward {margin:g}; gate them on the tests"
        )
    if length + one_call + ungated >= margin:
        raise ValueError(
            f"reward.terms: a long solving episode with one broken call can lose "
            f"{length + one_call:g} while a failing one gains {ungated:g} from ungated learned "
            f"terms, together at least the test reward {margin:g}"
        )
