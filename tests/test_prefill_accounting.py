"""Prefill accounting of an episode's calls from its trajectory (coderl.trajectory), hand-worked."""

from __future__ import annotations

from coderl.trajectory import Segment, Trajectory, prefill_accounting


def _window(*parts: tuple[str, int]) -> Segment:
    seg = Segment()
    tok = 100
    for kind, n in parts:
        ids = list(range(tok, tok + n))
        tok += n
        if kind == "sampled":
            seg.append_sampled(ids, [-1.0] * n, 0)
        else:
            seg.append_context(ids, kind=kind)
    return seg


def test_each_call_prefills_what_its_windows_previous_call_did_not_leave():
    # window 1: prompt 10, action 4, observation 6, action 3, observation 5, action 2
    #   calls' prompts: 10, 10+4+6 = 20, 20+3+5 = 28        -> prompt_tokens 58
    #   reuse: call 2 finds 10+4-1 = 13 cached: prefills 7; call 3 finds 20+3-1 = 22: prefills 6
    #   -> prefill 10 + 7 + 6 = 23; distinct 30
    # window 2 (after a summary): prompt 12, action 5 -> prompt 12, prefill 12, distinct 17
    w1 = _window(
        ("prompt", 10),
        ("sampled", 4),
        ("observation", 6),
        ("sampled", 3),
        ("observation", 5),
        ("sampled", 2),
    )
    w2 = _window(("prompt", 12), ("sampled", 5))
    got = prefill_accounting(Trajectory([w1, w2]))
    assert got == {"distinct_tokens": 47, "prompt_tokens": 70, "prefill_tokens": 35}


def test_an_empty_trajectory_prefills_nothing():
    assert prefill_accounting(Trajectory([])) == dict.fromkeys(
        ("distinct_tokens", "prompt_tokens", "prefill_tokens"), 0
    )
