"""Learned graders: the judge's strict parser, retry-then-mask, cache, group mode, Bradley-Terry,
probes against a naive and a comment-blind grader, and the tests-gate in reward composition."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from coderl.config import RewardConfig
from coderl.graders.cache import JudgementCache
from coderl.graders.judge import EpisodeView, Judge
from coderl.graders.pairs import PreferencePair, pairs_from_outcomes, pairs_from_store
from coderl.graders.probes import PROBES, probe_gate, run_probes
from coderl.graders.report import agreement_with_tests, spearman
from coderl.graders.rm import RewardModel, RMSpec, bt_loss, pairwise_accuracy, split_pairs, train_rm
from coderl.graders.rubric import (
    MalformedJudgement,
    Rubric,
    parse_group_judgement,
    parse_judgement,
)
from coderl.policy.base import Completion
from coderl.policy.tiny import tiny_tokenizer
from coderl.rewards import RewardSample, compute_rewards
from coderl.rewards.learned import grader_term

RUBRIC = Rubric.model_validate(
    {
        "version": "t1",
        "criteria": [
            {"name": "correct", "weight": 3.0, "scale": [1, 5], "wording": "is it right?"},
            {"name": "minimal", "weight": 1.0, "scale": [0, 2], "wording": "is it small?"},
        ],
    }
)
DIFF = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,3 @@\n def f(x):\n+    y = x + 1\n-    return x\n+    return y\n"
VIEW = EpisodeView("t/0", "make f return x + 1", DIFF, "turn 1: edit(path='m.py') -> ok", "")


# -- parser -------------------------------------------------------------------------------
def test_well_formed_judgement_and_its_score():
    scores = parse_judgement('Sure. {"correct": 5, "minimal": 1} done', RUBRIC)
    assert scores == {"correct": 5, "minimal": 1}
    # (3 * (5-1)/4 + 1 * (1-0)/2) / 4 = (3 + 0.5) / 4
    assert RUBRIC.score(scores) == pytest.approx(0.875)


@pytest.mark.parametrize(
    "reply, why",
    [
        ("I would give it a 4.", "exactly one JSON object, found 0"),
        ('{"correct": 5, "minimal": 1} {"correct": 1, "minimal": 0}', "found 2"),  # two scores
        ('{"correct": 5, "correct": 1, "minimal": 1}', "twice"),  # two scores for one key
        ('{"correct": 6, "minimal": 1}', "outside the scale"),
        ('{"correct": 0, "minimal": 1}', "outside the scale"),
        ('{"correct": 5}', "missing criteria ['minimal']"),  # partial
        ('{"correct": 5, "minimal": 1, "bonus": 10}', "extra keys ['bonus']"),
        ('{"correct": 4.0, "minimal": 1}', "expected an integer"),
        ('{"correct": true, "minimal": 1}', "expected an integer"),
        ('{"correct": "5", "minimal": 1}', "expected an integer"),
        ('{"correct": 5, "minimal": 1', "found 0"),  # truncated
        ("[5, 1]", "found 0"),
        ('{"correct": ' + "[" * 5000 + "]" * 5000 + "}", "found 0"),  # past the decoder's depth
        ('{"a": ' * 3000 + "}" * 3000, "found 0"),
    ],
)
def test_malformed_judgements_raise(reply, why):
    with pytest.raises(MalformedJudgement, match=re.escape(why)):
        parse_judgement(reply, RUBRIC)


def test_group_judgement_needs_every_label():
    ok = '{"1": {"correct": 5, "minimal": 2}, "2": {"correct": 1, "minimal": 0}}'
    assert parse_group_judgement(ok, RUBRIC, 2)[1] == {"correct": 1, "minimal": 0}
    with pytest.raises(MalformedJudgement, match="labels"):
        parse_group_judgement('{"1": {"correct": 5, "minimal": 2}}', RUBRIC, 2)
    with pytest.raises(MalformedJudgement, match="episode 2: "):
        parse_group_judgement(ok.replace('"correct": 1', '"correct": 9'), RUBRIC, 2)


# -- the judge through an engine ----------------------------------------------------------
class ScriptedEngine:
    """Replies ``script(prompt_text, call_index)``; records every call."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.temperature, params.seed))
        out = []
        for p in prompts:
            ids = self.tok.encode(self.script(self.tok.decode(p), len(self.calls)))
            out.append(Completion(ids, [0.0] * len(ids), "length"))
        return out


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _judge(tok, script, **kw):
    eng = ScriptedEngine(tok, script)
    return Judge(eng, tok, RUBRIC, model_id="scripted", **kw), eng


def test_malformed_is_retried_once_then_masked_and_counted_never_zero(tok):
    # episode "good" answers well; episode "bad" answers malformed at every attempt
    def script(prompt, call):
        return '{"correct": 5, "minimal": 2}' if "GOOD" in prompt else "score: 10/10"

    judge, eng = _judge(tok, script)
    good = EpisodeView("t/0", "GOOD task", DIFF)
    bad = EpisodeView("t/1", "other task", DIFF)
    samples = [
        RewardSample(v.task_id, resolved=True, statement=v.statement, diff=v.diff)
        for v in (good, bad)
    ]
    cfg = RewardConfig(terms={"tests": 1.0, "judge": 1.0}, learned_requires_tests=False)
    res = compute_rewards(samples, cfg, terms={"tests": _tests, "judge": grader_term(judge)})
    assert eng.calls[0][0] == 2 and eng.calls[1][0] == 1  # first pass both, retry only the bad one
    assert eng.calls[1][1] >= 0.7 and eng.calls[1][2] != eng.calls[0][2]  # retry samples anew
    assert len(eng.calls) == 2  # the composer's per-sample pass re-used the judgements
    assert judge.counts["retried"] == 1 and judge.counts["malformed"] == 1
    assert res.valid == [True, False] and math.isnan(res.totals[1])  # masked, not 0
    assert res.counts["masked"] == 1 and res.counts["term_errors"] == 1
    assert res.totals[0] == pytest.approx(2.0)
    assert res.breakdown[0]["judge/correct"] == 1.0 and res.breakdown[0]["judge/minimal"] == 1.0


def _tests(samples, cfg):
    return [1.0 if s.resolved else 0.0 for s in samples]


def test_a_retry_that_succeeds_scores(tok):
    judge, eng = _judge(
        tok, lambda p, call: "nope" if call == 1 else '{"correct": 3, "minimal": 0}'
    )
    [j] = judge.judge([VIEW])
    assert j is not None and j.scores == {"correct": 3, "minimal": 0} and j.score == 0.375
    assert judge.counts["malformed"] == 0 and judge.counts["retried"] == 1


def test_cache_hit_skips_the_engine(tok, tmp_path):
    path = tmp_path / "c.sqlite"
    first, eng1 = _judge(
        tok, lambda p, c: '{"correct": 4, "minimal": 1}', cache=JudgementCache(path)
    )
    assert first.score([VIEW]) == [pytest.approx((3 * 0.75 + 0.5) / 4)]
    again, eng2 = _judge(tok, lambda p, c: "never called", cache=JudgementCache(path))
    assert again.score([VIEW]) == first.score([VIEW]) and eng2.calls == []
    assert again.counts["cached"] == 1
    other = Rubric.model_validate({**RUBRIC.model_dump(), "version": "t2"})  # new rubric: miss
    j3 = Judge(ScriptedEngine(tok, lambda p, c: '{"correct": 1, "minimal": 0}'), tok, other,
               model_id="scripted", cache=JudgementCache(path))  # fmt: skip
    assert j3.score([VIEW]) == [0.0]


def test_group_mode_scores_a_group_in_one_reply(tok):
    def script(prompt, call):
        assert "episode 1>" in prompt and "episode 2>" in prompt and "episode 3>" not in prompt
        return json.dumps({"1": {"correct": 5, "minimal": 2}, "2": {"correct": 1, "minimal": 0}})

    judge, eng = _judge(tok, script, mode="group")
    views = [VIEW, EpisodeView("t/0", VIEW.statement, ""), VIEW.__class__("t/1", "x", DIFF),
             EpisodeView("t/1", "x", "")]  # fmt: skip
    assert judge.score(views) == [1.0, 0.0, 1.0, 0.0]
    assert eng.calls[0][0] == 2  # two groups, one batched call
    assert judge.score(views[1:2]) == [0.0] and len(eng.calls) == 1  # no re-judging alone


# -- composition with the tests -----------------------------------------------------------
def test_tests_gate_gives_a_failing_patch_no_learned_reward(tok):
    judge, eng = _judge(tok, lambda p, c: '{"correct": 5, "minimal": 2}')  # loves everything
    samples = [RewardSample("t/0", resolved=r, diff=DIFF) for r in (True, False)]
    terms = {"tests": _tests, "judge": grader_term(judge)}
    off = RewardConfig(terms={"tests": 1.0, "judge": 1.0}, learned_requires_tests=False)
    ungated = compute_rewards(samples, off, terms)
    assert ungated.totals == [2.0, 1.0]  # without the gate the judge rewards the failing patch
    cfg = RewardConfig(terms={"tests": 1.0, "judge": 1.0})  # gated by default
    gated = compute_rewards(
        [RewardSample("t/0", resolved=r, diff=DIFF) for r in (True, False)], cfg, terms
    )
    assert gated.totals == [2.0, 0.0] and gated.breakdown[1]["judge"] == 0.0
    assert all(gated.valid)


# -- reward model -------------------------------------------------------------------------
def test_bt_loss_hand_worked():
    # pairs with margins 1 and 0: (-log sigmoid(1) - log sigmoid(0)) / 2
    # = (log(1 + e^-1) + log 2) / 2 = (0.313262 + 0.693147) / 2 = 0.503204
    loss = bt_loss(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.5]))
    assert float(loss) == pytest.approx(0.503204, abs=1e-6)


def _synthetic_pairs(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        seqs = []
        for marker in (300, 301):  # chosen carries token 300, rejected token 301
            s = torch.randint(10, 200, (12,), generator=g)
            s[torch.randperm(12, generator=g)[:4]] = marker
            seqs.append(tuple(s.tolist()))
        out.append(PreferencePair(f"ctx{i}", *seqs))
    return out


def test_bradley_terry_learns_a_separable_preference(tmp_path):
    train, held = split_pairs(_synthetic_pairs(), 0.3)
    assert len(held) >= 20 and not {p.context_id for p in train} & {p.context_id for p in held}
    model = RewardModel(RMSpec("tiny-random", lora_rank=None, max_len=32))
    losses = train_rm(model, train, steps=12, batch_size=8, lr=1e-3)
    acc = pairwise_accuracy(model, held)
    assert acc.accuracy >= 0.85 and acc.lo > 0.6, acc
    assert sum(losses[-3:]) < sum(losses[:3])
    model.save(tmp_path / "rm")
    again = RewardModel.load(tmp_path / "rm")
    assert again.rewards([held[0].chosen]) == pytest.approx(
        model.rewards([held[0].chosen]), abs=1e-5
    )


def test_outcome_pairs_prefer_resolved_episodes_of_the_same_task():
    views = [EpisodeView("a", "s", "d1"), EpisodeView("a", "s", "d2"), EpisodeView("b", "s", "d3")]
    pairs = pairs_from_outcomes(views, [True, False, True])
    assert len(pairs) == 1 and "d1" in pairs[0].chosen and "d2" in pairs[0].rejected


def test_episodes_without_pairs_say_why(tmp_path):
    import argparse

    from coderl.cli.rm import _pairs
    from coderl.graders.pairs import write_episodes

    eps = tmp_path / "eps.jsonl"
    write_episodes(eps, [EpisodeView("a", "s", "d1"), EpisodeView("b", "s", "d2")], [True, True])
    args = argparse.Namespace(pairs=None, episodes=str(eps), store=None)
    with pytest.raises(ValueError, match="2 episodes, 2 resolved, no task with both"):
        _pairs(args)


def test_store_pairs_prefer_kept_over_discarded(tmp_path):
    from coderl.online.events import parse_event
    from coderl.online.store import Store, interaction_row

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    for iid, comp in (("i1", [7]), ("i2", [8]), ("i3", [9])):
        store.record_interaction(interaction_row(iid, policy_version=0, created_at=1.0,
            prompt_token_ids=[1, 2], completion_token_ids=comp, behaviour_logprobs=None,
            temperature=1.0))  # fmt: skip
    events = [
        {"event_id": "e1", "interaction_id": "i1", "type": "accepted"},
        {"event_id": "e2", "interaction_id": "i2", "type": "edit_persisted", "fraction": 0.1,
         "after_minutes": 30},  # reverted
        {"event_id": "e3", "interaction_id": "i3", "type": "accepted"},
        {"event_id": "e4", "interaction_id": "i3", "type": "rejected"},  # ambiguous: skipped
    ]  # fmt: skip
    store.ingest([parse_event(json.dumps(e)) for e in events], now=2.0)
    pairs = pairs_from_store(store)
    store.close()
    assert [(p.chosen, p.rejected) for p in pairs] == [((1, 2, 7), (1, 2, 8))]


# -- probes -------------------------------------------------------------------------------
class NaiveGrader:
    """Believes whatever the diff says about its score."""

    def score(self, views):
        return [1.0 if "score 10" in v.diff else 0.5 for v in views]


class CommentBlindGrader:
    """The same grader, reading the diff with comments stripped."""

    def score(self, views):
        strip = [re.sub(r"#.*", "", v.diff) for v in views]
        return [1.0 if "score 10" in d else 0.5 for d in strip]


def _views(n=8):
    return [EpisodeView(f"t/{i}", f"task {i}", DIFF.replace("1", str(i + 1))) for i in range(n)]


def test_injection_probe_flags_the_naive_grader_not_the_comment_blind_one():
    [naive] = run_probes(NaiveGrader(), _views(), ["injection_comment"])
    assert naive.flagged and naive.mean == pytest.approx(0.5) and naive.n == 8
    ok, reason = probe_gate([naive])
    assert not ok and "injection_comment" in reason
    [blind] = run_probes(CommentBlindGrader(), _views(), ["injection_comment"])
    assert not blind.flagged and blind.mean == 0.0
    ok, reason = probe_gate([blind])
    assert ok and "1 of 1 probes measured" in reason
    # a probe that applies to no episode (no diff) measured nothing: the gate fails closed
    [empty] = run_probes(CommentBlindGrader(), [EpisodeView("t/0", "task", "")], ["rename"])
    assert empty.n == 0
    ok, reason = probe_gate([empty])
    assert not ok and reason.startswith("nothing measured")
    # the string variant is not a comment: it gets through the comment-blind grader
    [s] = run_probes(CommentBlindGrader(), _views(), ["injection_string"])
    assert s.flagged


def test_every_probe_applies_and_rename_keeps_the_diff_consistent():
    v = _views(1)[0]
    for name, probe in PROBES.items():
        out = probe(v)
        assert out is not None and out != v, name
    renamed = PROBES["rename"](v).diff
    assert "y_value = x" in renamed and "return y_value" in renamed and "y =" not in renamed
    padded = PROBES["verbose_comments"](v).diff
    assert "@@ -1,2 +1,5 @@" in padded  # two added lines -> two comments, header recomputed


def test_unknown_probe_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid"):
        run_probes(NaiveGrader(), _views(), ["nope"])


# -- report pieces ------------------------------------------------------------------------
def test_spearman_hand_worked_and_agreement():
    # ranks x: 1,2,3,4 ; y: 1,3,2,4 -> d^2 = 0,1,1,0 -> rho = 1 - 6*2/(4*15) = 0.8
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [0, 0, 1]) == pytest.approx(1.0)  # ties share mid-ranks
    a = agreement_with_tests([0.9, 0.2, math.nan, 0.7], [True, False, True, False])
    assert a["n"] == 3 and a["masked"] == 1 and a["accuracy"] == pytest.approx(2 / 3)


def test_registered_judge_term_with_a_random_model_masks_instead_of_scoring(tmp_path):
    """End to end through REWARD_TERMS: a random tiny judge writes token soup, every judgement
    is malformed twice, and the samples are masked and counted (not rewarded 0)."""
    from coderl.config import load_config
    from coderl.rewards import learned as graders_terms

    cfg = load_config(None, ["reward.terms={tests: 1.0, judge: 0.5}", "reward.judge.model=tiny-random",
                             f"reward.judge.cache={tmp_path / 'c.sqlite'}",
                             "reward.judge.max_new_tokens=8", "reward.term_timeout_s=120",
                             "reward.judge.scoring=generate"])  # fmt: skip
    samples = [RewardSample("t/0", resolved=True, statement="s", diff=DIFF)]
    res = compute_rewards(samples, cfg.reward)
    judge = next(g for (kind, _), g in graders_terms._GRADERS.items() if kind == "judge")
    assert res.valid == [False] and res.counts["masked"] == 1
    assert judge.counts["malformed"] == 1 and judge.counts["judged"] == 2


def test_rm_cli_train_probe_and_report_section(tmp_path, capsys):
    """``coderl rm train`` on outcome pairs, the rm as ``reward.terms.rm``, ``coderl graders
    probe --grader rm`` and the report's graders section, on a tiny backbone."""
    from coderl.cli import main
    from coderl.config import load_config
    from coderl.graders.pairs import write_episodes
    from coderl.graders.report import html_section

    views = [EpisodeView(f"t/{i // 2}", f"task {i // 2}", DIFF if i % 2 else DIFF.replace("+", "+#"))
             for i in range(12)]  # fmt: skip
    eps = tmp_path / "episodes.jsonl"
    write_episodes(eps, views, [bool(i % 2) for i in range(12)])
    ckpt = tmp_path / "rm"
    rc = main(["rm", "train", "--episodes", str(eps), "--backbone", "tiny-random", "--out",
               str(ckpt), "--steps", "2", "--lora-rank", "4", "--max-len", "64", "--heldout", "0.3"])  # fmt: skip
    assert rc == 0 and (ckpt / "rm.safetensors").is_file()
    result = json.loads((ckpt / "rm_eval.json").read_text())
    assert result["train_pairs"] + result["n"] == 6
    cfg = load_config(None, ["reward.terms={tests: 1.0, rm: 1.0}", f"reward.rm.checkpoint={ckpt}",
                             "reward.term_timeout_s=120"])  # fmt: skip
    res = compute_rewards(
        [RewardSample("t/0", resolved=True, diff=DIFF), RewardSample("t/1", resolved=True)],
        cfg.reward,  # the rm is gated on the tests (the default): it scores solved samples
    )
    assert all(res.valid) and all(0 < b["rm"] < 1 for b in res.breakdown)
    out = tmp_path / "probes.jsonl"
    rc = main(["graders", "probe", str(eps), f"reward.rm.checkpoint={ckpt}", "--grader", "rm",
               "--out", str(out)])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["probe"] for r in rows] == list(PROBES) and rc == (
        1 if any(r["flagged"] for r in rows) else 0
    )
    assert "Probes: rm" in html_section(tmp_path, [], out)
    assert "graders_criteria.png" in html_section(
        tmp_path,
        [{"step": 1, "reward/judge/minimal": 0.5}, {"step": 2, "reward/judge/minimal": 0.7}],
        out,
    )


def test_probe_schedule_for_the_training_loop():
    from coderl.config import load_config
    from coderl.graders.probes import maybe_probe

    cfg = load_config(None, ["graders.probe_every=2", "graders.probes=[injection_comment]"])
    assert maybe_probe(1, cfg, NaiveGrader(), _views()) == {}
    m = maybe_probe(2, cfg, NaiveGrader(), _views())
    assert m["graders/probe/injection_comment/flagged"] == 1.0 and m["graders/probe/flagged"] == 1.0
    assert maybe_probe(2, load_config(), NaiveGrader(), _views()) == {}  # probe_every=0: never


def test_learned_fields_from_pipeline_records():
    from types import SimpleNamespace as NS

    from coderl.rewards.learned import learned_fields

    call = NS(turn=1, name="edit", arguments={"path": "m.py"}, status="ok")
    ep = NS(answer="ignored", episode=NS(diff=DIFF, tool_calls=[call]))
    grade = NS(resolved=False, result=NS(tests={"t::a": "passed", "t::b": "failed"}))
    f = learned_fields(NS(problem_statement="fix f"), ep, grade)
    assert f == {"statement": "fix f", "diff": DIFF, "tool_log": "turn 1: edit(path='m.py') -> ok",
                 "tests_report": "not resolved: 1/2 tests passed; not passing: t::b"}  # fmt: skip
    bare = learned_fields(NS(), NS(answer=DIFF, episode=None), NS(resolved=True, result=None))
    assert bare == {"statement": "", "diff": DIFF, "tool_log": "", "tests_report": ""}


def test_the_judge_criteria_observer_logs_them_over_valid_episodes():
    from coderl.config import load_config
    from coderl.envs.base import EpisodeRecord
    from coderl.eval.observers import JudgeCriteria
    from coderl.train.pipeline import episode_info
    from coderl.trajectory import Trajectory

    def info(valid, minimal):
        ep = EpisodeRecord("t/0", Trajectory(segments=[]))
        breakdown = {"tests": 1.0, "judge/minimal": minimal}
        return episode_info(ep, RewardSample("t/0"), 1.0, valid, breakdown, (None, ""))

    infos = [info(True, 0.25), info(True, 0.75), info(False, 1.0)]
    m = JudgeCriteria().step(load_config(), 1, infos)
    assert m["reward/judge/minimal"] == pytest.approx(0.5)


def test_format_injection_shows_up_as_masked_episodes():
    class Obedient:  # stops answering in the schema when the diff asks it to
        def score(self, views):
            return [math.nan if "prose only" in v.diff else 0.5 for v in views]

    [r] = run_probes(Obedient(), _views(), ["injection_format"])
    assert r.masked == 8 and r.n == 0 and not r.flagged and math.isnan(r.mean)


def test_rm_term_without_a_checkpoint_is_a_config_error():
    from coderl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="reward.rm.checkpoint"):
        load_config(None, ["reward.terms={tests: 1.0, rm: 1.0}"])
