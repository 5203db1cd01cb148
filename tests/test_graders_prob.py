"""The probability-scored judge: the G-Eval expectation worked by hand, the verdict position on
the tiny tokenizer, scores equal to a forward pass done by hand, padding-invariant batches,
group mode, the vLLM top-logprobs path with its exact fallback, and the config dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from coderl.graders.judge import EpisodeView
from coderl.graders.probjudge import (
    LocalScorer,
    ProbJudge,
    VLLMScorer,
    expected_rating,
    verdict_prompt,
)
from coderl.graders.rubric import Rubric
from coderl.policy.episode import encode
from coderl.policy.tiny import tiny_random, tiny_tokenizer

RUBRIC = Rubric.model_validate(
    {
        "version": "p1",
        "criteria": [
            {"name": "correct", "weight": 3.0, "scale": [1, 5], "wording": "is it right?"},
            {"name": "minimal", "weight": 1.0, "scale": [0, 2], "wording": "is it small?"},
        ],
    }
)
VIEWS = [
    EpisodeView("t/0", "make f return x + 1", "+def f(x):\n+    return x + 1\n"),
    EpisodeView("t/0", "make f return x + 1", "+def f(x):\n+    return x\n" * 3),
    EpisodeView("t/1", "sort a list", "+sorted(xs)\n", "turn 1: edit -> ok"),
]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = tiny_random(seed=0)
    return model.eval(), tok


def test_expected_rating_hand_worked():
    # tokens with p = 0.2, 0.2, 0.1 (the rest of the vocabulary elsewhere); label 0 is token 0,
    # label 1 is spelled by tokens 1 and 2: renormalised 0.2 / 0.5 and 0.3 / 0.5
    p = expected_rating([math.log(0.2), math.log(0.2), math.log(0.1)], [[0], [1, 2]])
    assert p == pytest.approx([0.4, 0.6])


def test_verdict_prompt_picks_the_end_where_every_label_is_one_token():
    tok = tiny_tokenizer()
    # the tiny tokenizer splits text as Qwen2's does: a digit is always a token of its own, so
    # " 1" is a space token then "1" and the digits go after "correct: " (as on SmolLM2)
    assert encode(tok, " 1") == encode(tok, " ") + encode(tok, "1")
    ids, spell = verdict_prompt(tok, "correct:", ["1", "2", "3"])
    assert ids == encode(tok, "correct: ")
    assert spell == [encode(tok, "1"), encode(tok, "2"), encode(tok, "3")]
    # " a" and " b" are one token each: the first ending, the label read with its space, wins
    assert len(encode(tok, " a")) == len(encode(tok, " b")) == 1
    ids, spell = verdict_prompt(tok, "correct:", ["a", "b"])
    assert ids == encode(tok, "correct:") and spell == [encode(tok, " a"), encode(tok, " b")]
    # " 1" is two tokens and "correct: " + "a" puts the space into " a": neither of the first
    # two endings holds both, the bare labels after ":" do
    ids, spell = verdict_prompt(tok, "correct:", ["1", "a"])
    assert ids == encode(tok, "correct:") and spell == [encode(tok, "1"), encode(tok, "a")]
    with pytest.raises(ValueError, match="one token"):
        verdict_prompt(tok, "correct:", ["no", "yes"])  # two tokens each on this tokenizer


def _by_hand(model, tok, view, c, opening):
    from coderl.graders.probjudge import pointwise_heads

    chat = pointwise_heads(view, RUBRIC, 6000)[[x.name for x in RUBRIC.criteria].index(c.name)]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = encode(tok, text + opening)  # digits after ": " on this tokenizer (test above)
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    labs = [encode(tok, str(k))[0] for k in range(c.scale[0], c.scale[1] + 1)]
    p = lp[labs].softmax(0)
    return float(sum(i * p[i] for i in range(len(labs))) / (c.scale[1] - c.scale[0]))


def test_scores_are_the_rating_expectation_of_one_forward_pass(tiny):
    model, tok = tiny
    judge = ProbJudge(LocalScorer(model, tok.pad_token_id, batch_size=3), tok, RUBRIC, "tiny")
    js = judge.judge(VIEWS)
    assert judge.counts["judged"] == 6 and "malformed" not in judge.counts
    for v, j in zip(VIEWS, js, strict=True):
        want = {c.name: _by_hand(model, tok, v, c, f"{c.name}: ") for c in RUBRIC.criteria}
        assert j.normalised == pytest.approx(want, abs=1e-5)
        assert j.score == pytest.approx((3 * want["correct"] + want["minimal"]) / 4, abs=1e-5)
    # right padding in a batch changes nothing: one at a time gives the same numbers
    one = ProbJudge(LocalScorer(model, tok.pad_token_id, batch_size=1), tok, RUBRIC, "tiny")
    assert one.score(VIEWS) == pytest.approx([j.score for j in js], abs=1e-5)


def test_group_mode_reads_each_episode_with_the_group_in_view(tiny):
    model, tok = tiny
    judge = ProbJudge(LocalScorer(model, tok.pad_token_id), tok, RUBRIC, "tiny", mode="group")
    scores = judge.score(VIEWS)
    assert all(0 <= s <= 1 for s in scores)
    assert judge.counts["judged"] == 2 * 3  # (2 + 1 episodes) x 2 criteria
    assert scores[0] != scores[1]  # "Episode 1" vs "Episode 2" openings of one group chat
    assert judge.score(VIEWS[:1]) == [scores[0]]  # a re-call on one sample: no group of one
    assert judge.counts["judged"] == 6


def test_cache_reads_probabilities_back(tiny, tmp_path):
    from coderl.graders.cache import JudgementCache

    model, tok = tiny
    cache = JudgementCache(tmp_path / "c.sqlite")
    first = ProbJudge(LocalScorer(model, tok.pad_token_id), tok, RUBRIC, "tiny", cache=cache)
    a = first.score(VIEWS)
    again = ProbJudge(LocalScorer(model, tok.pad_token_id), tok, RUBRIC, "tiny", cache=cache)
    assert again.score(VIEWS) == pytest.approx(a) and again.counts["judged"] == 0


def test_vllm_scorer_uses_top_logprobs_and_scores_a_missing_label_exactly():
    calls = []

    def post(path, body):
        calls.append(body)
        if "logprobs" in body:  # top-2: token 7 and 9 present, token 8 absent
            top = {"token_id:7": math.log(0.5), "token_id:9": math.log(0.2)}
            return {"choices": [{"logprobs": {"top_logprobs": [top]}}]}
        assert body["prompt"] == [1, 2, 8] and body["prompt_logprobs"] == 0
        return {"choices": [{"prompt_logprobs": [None, {}, {"8": {"logprob": math.log(0.05)}}]}]}

    s = VLLMScorer(post, "m", top_k=2)
    (row,) = s.next_token_logprobs([[1, 2]], [7, 8, 9])
    assert row == pytest.approx([math.log(0.5), math.log(0.05), math.log(0.2)])
    assert s.counts["outside_top_k"] == 1 and calls[0]["return_tokens_as_token_ids"] is True
    assert calls[0]["max_tokens"] == 1 and calls[0]["logprobs"] == 2


def test_default_judge_term_gives_a_number_where_the_generating_judge_masked(tmp_path):
    """Through REWARD_TERMS with the default scoring (probability) and a random tiny judge:
    every sample gets a finite score, none is masked (the generating judge masks these)."""
    from coderl.config import load_config
    from coderl.graders.probjudge import ProbJudge as PJ
    from coderl.rewards import RewardSample, compute_rewards
    from coderl.rewards.learned import learned_grader

    cfg = load_config(None, ["reward.terms={tests: 1.0, judge: 0.5}", "reward.judge.model=tiny-random",
                             f"reward.judge.cache={tmp_path / 'c.sqlite'}",
                             "reward.term_timeout_s=120"])  # fmt: skip
    samples = [RewardSample("t/0", resolved=True, statement="s", diff=VIEWS[0].diff)]
    res = compute_rewards(samples, cfg.reward)
    assert res.valid == [True] and res.counts["masked"] == 0
    assert isinstance(learned_grader("judge", cfg.reward), PJ)
    assert 0 < res.breakdown[0]["judge"] < 0.5  # 0.5 x a score in (0, 1)


def test_rubric_labels_need_one_per_rating():
    with pytest.raises(ValueError, match="one per rating"):
        Rubric.model_validate({"version": "b", "criteria": [{"name": "ok", "weight": 1,
                               "scale": [0, 1], "labels": ["yes"], "wording": "?"}]})  # fmt: skip
