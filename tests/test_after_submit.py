"""What the policy writes after its ``submit`` call is sampled and scored but not trained: the
submit call's tokens and the one after it (stop, or go on) keep ``loss_mask`` 1, every later
token of the message gets 0 (``coderl.agent.episode._untrain_after_submit``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_agent_loop import assert_token_exact
from test_agent_tools import PLAIN_CHATML, make_repo, open_sandbox

from coderl.agent.branch import BranchSpec
from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.runner import run_episode, run_episodes
from coderl.agent.scripted import ScriptedPolicy
from coderl.config import AlgorithmConfig
from coderl.policy.episode import tokens_covering
from coderl.policy.tiny import tiny_tokenizer
from coderl.train.batch import build_batch
from coderl.train.step import accumulate_gradients
from coderl.trajectory import Segment

TASK = SimpleTask("calc", "Fix add() in pkg/calc.py.")
JUNK = "\n<tool_call>\n<function=solve_tool_call>\n</"  # the demo's babble, cut mid-call


@pytest.fixture(scope="module")
def tiny():
    t = tiny_tokenizer()
    t.chat_template = PLAIN_CHATML
    return t


@pytest.fixture(scope="module")
def smollm2():
    """The default model's tokenizer (from its GGUF, a few seconds), whose merges are the
    demo's."""
    from coderl.policy.loading import gguf_tokenizer, smollm2_gguf_path

    return gguf_tokenizer(smollm2_gguf_path())


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request):
    return request.getfixturevalue(request.param)


def run(tok, tmp_path: Path, script, fmt="hermes", **cfg):
    policy = ScriptedPolicy(tok, script)
    with open_sandbox(make_repo(tmp_path)) as box:
        ep = run_episode(policy, TASK, box, EpisodeConfig(call_format=fmt, **cfg))
    assert ep.error is None, ep.error
    for seg in ep.trajectory.segments:
        seg.validate()
    assert_token_exact(ep, policy)
    return ep


def last_action(ep) -> tuple[list[int], list[int]]:
    """The last action's token ids and loss mask."""
    seg = ep.trajectory.segments[-1]
    _, start, end = [s for s in seg.provenance["spans"] if s[0] == "action"][-1]
    return seg.token_ids[start:end], seg.loss_mask[start:end]


def assert_trained_through(tok, ids, mask, text: str) -> None:
    """Trainable: exactly the fewest leading tokens that write ``text``, and one more."""
    n = sum(mask)
    assert mask == [1] * n + [0] * (len(ids) - n)  # one trainable prefix, then untrained
    decode = lambda k: tok.decode(ids[:k], skip_special_tokens=False)  # noqa: E731
    assert decode(n - 1).startswith(text) and not decode(n - 2).startswith(text)


@pytest.mark.parametrize("fmt", ["xml", "hermes"])
def test_everything_after_the_submit_call_and_the_next_token_is_untrained(tok, tmp_path, fmt):
    call = CALL_FORMATS[fmt].format_call
    done = "Fixed.\n" + call("read_file", {"path": "pkg/calc.py"}) + call("submit", {})
    ep = run(tok, tmp_path, [done + call("read_file", {"path": "pkg/calc.py"}) + JUNK], fmt)
    assert ep.stats.finish_reason == "submitted"
    assert [c.status for c in ep.tool_calls] == ["ok", "ok", "not_run", "broken"]
    assert ep.stats.broken_tool_calls == 1  # the babble is still scored
    ids, mask = last_action(ep)
    assert_trained_through(tok, ids, mask, done)
    seg = ep.trajectory.segments[-1]
    untrained = len(ids) - sum(mask)
    assert untrained > 5 and seg.provenance["actions"][-1]["untrained"] == untrained
    assert seg.provenance["untrained"] == [[len(seg) - untrained, len(seg), "after submit"]]
    # sampled, not trained: the logprobs stay for the reward terms that measure sampling
    assert seg.num_sampled == ep.stats.generated_tokens == seg.num_trainable + untrained


def test_a_submit_followed_by_the_stop_token_untrains_nothing(tok, tmp_path):
    ep = run(tok, tmp_path, [CALL_FORMATS["xml"].format_call("submit", {})], "xml")
    ids, mask = last_action(ep)
    assert ep.stats.finish_reason == "submitted" and ids[-1] == tok.eos_token_id
    assert mask == [1] * len(ids)
    assert "untrained" not in ep.trajectory.segments[0].provenance


def test_only_the_first_token_after_submit_is_trained(smollm2, tmp_path):
    """A newline then the stop token: the newline is the trained choice (stop or go on), the
    stop token after it is not trained (a documented limit of the one-token rule)."""
    submit = CALL_FORMATS["xml"].format_call("submit", {})
    ep = run(smollm2, tmp_path, [submit + "\n"], "xml")
    ids, mask = last_action(ep)
    assert smollm2.decode(ids[-2:]) == "\n<|im_end|>"
    assert mask == [1] * (len(ids) - 1) + [0]


def test_a_submit_cut_by_the_budget_is_a_broken_call_and_fully_trained(tiny, tmp_path):
    submit = CALL_FORMATS["xml"].format_call("submit", {})
    cut = len(tiny.encode(submit, add_special_tokens=False)) - 2
    ep = run(tiny, tmp_path, [submit], "xml", max_turns=1, max_tokens_per_turn=cut)
    ids, mask = last_action(ep)
    assert ep.stats.finish_reason == "max_turns" and ep.stats.broken_tool_calls == 1
    assert len(ids) == cut and mask == [1] * cut


def test_babble_cut_by_the_budget_after_a_submit_is_untrained(tiny, tmp_path):
    """The demo's case: the babble runs into ``max_tokens_per_turn`` (finish reason
    ``length``, no stop token)."""
    submit = CALL_FORMATS["xml"].format_call("submit", {})
    budget = len(tiny.encode(submit + JUNK * 8, add_special_tokens=False)) - 3
    ep = run(tiny, tmp_path, [submit + JUNK * 8], "xml", max_tokens_per_turn=budget)
    ids, mask = last_action(ep)
    assert ep.trajectory.segments[0].provenance["actions"][-1]["finish_reason"] == "length"
    assert ep.stats.broken_tool_calls == 8 and len(ids) == budget
    assert_trained_through(tiny, ids, mask, submit)


def test_a_submit_in_a_later_turn_untrains_only_that_turns_tail(tok, tmp_path):
    call = CALL_FORMATS["hermes"].format_call
    first = call("read_file", {"path": "pkg/calc.py"}) + "<tool_call>{}"  # broken: trained
    last = call("edit", {"path": "pkg/calc.py", "old": "a - b", "new": "a + b"}) + call(
        "submit", {}
    )
    ep = run(tok, tmp_path, [first, last + "\nDone." + JUNK])
    assert ep.stats.turns == 2 and ep.stats.broken_tool_calls == 2
    (seg,) = ep.trajectory.segments
    actions = [(s, e) for kind, s, e in seg.provenance["spans"] if kind == "action"]
    assert all(seg.loss_mask[actions[0][0] : actions[0][1]])  # the first turn keeps every token
    ids, mask = last_action(ep)
    assert_trained_through(tok, ids, mask, last)


def test_after_a_summary_the_submit_window_alone_is_untrained(tiny, tmp_path):
    """Two context windows: the submit is in the second; the first keeps every sampled token."""
    call = CALL_FORMATS["hermes"].format_call
    read = call("read_file", {"path": "pkg/calc.py"})
    script = [read, "I read calc.py.", call("submit", {}) + JUNK]
    probe = run(tiny, tmp_path / "probe", [call("submit", {})])
    prompt = probe.trajectory.segments[0].provenance["spans"][0][2]
    ep = run(tiny, tmp_path, script, context_budget=prompt + 120, max_tokens_per_turn=60)
    assert ep.stats.summaries == 1 and len(ep.trajectory.segments) == 2
    first, second = ep.trajectory.segments
    assert first.num_trainable == first.num_sampled and "untrained" not in first.provenance
    ids, mask = last_action(ep)
    assert_trained_through(tiny, ids, mask, call("submit", {}))


def test_each_continuation_untrains_its_own_tail_only(tiny, tmp_path):
    call = CALL_FORMATS["hermes"].format_call
    turns = iter([call("read_file", {"path": "pkg/calc.py"})] + [call("submit", {}) + JUNK] * 3)
    policy = ScriptedPolicy(tiny, lambda prompt: next(turns))
    cfg = EpisodeConfig(branch=BranchSpec(turns=(1,), k=2))
    with open_sandbox(make_repo(tmp_path)) as box:
        (ep,) = run_episodes(policy, [(TASK, box)], cfg)
    eps = [ep, *(b.episode for b in ep.branches)]
    assert len(eps) == 3 and all(e.stats.finish_reason == "submitted" for e in eps)
    for e in eps:
        (seg,) = e.trajectory.segments
        assert len(seg.provenance["untrained"]) == 1  # its own, not a sibling's
        ids, mask = last_action(e)
        assert_trained_through(tiny, ids, mask, call("submit", {}))


def test_tokens_covering_finds_the_fewest_tokens_through_a_multibyte_character(smollm2):
    text = "x = 'é✓'\n<tool_call>\n"
    ids = smollm2.encode(text, add_special_tokens=False)
    for chars in range(len(text) + 1):
        k = tokens_covering(smollm2, ids, chars)
        decode = lambda n: smollm2.decode(ids[:n])  # noqa: E731
        assert decode(k).startswith(text[:chars])
        assert k == 0 or not decode(k - 1).startswith(text[:chars])
    with pytest.raises(ValueError, match="outside"):
        tokens_covering(smollm2, ids, len(text) + 1)


def test_segment_untrain_keeps_what_was_sampled():
    seg = Segment()
    seg.append_context([5, 6])
    seg.append_sampled([7, 8, 9], [-0.5, -1.0, -2.0], 3)
    assert seg.untrain(3, "after submit") == 2
    assert seg.loss_mask == [0, 0, 1, 0, 0] and seg.behavior_logprobs[3:] == [-1.0, -2.0]
    assert seg.sampled_mask() == [0, 0, 1, 1, 1] and seg.num_sampled == 3
    assert seg.num_trainable == 1 and seg.untrain(4, "again") == 0
    seg.validate()
    with pytest.raises(ValueError, match="outside"):
        seg.untrain(6, "past the end")


def test_untrained_tokens_get_no_gradient_in_a_grpo_step(tiny, tmp_path):
    """End to end on the tiny random model: episodes that stop and that babble after a resolving
    submit, their GRPO advantages, one accumulated gradient. Changing the untrained tokens
    changes nothing; changing the decision token after submit does; the same batch with its
    babble trained (as before the fix) gets a different gradient."""
    from coderl.algorithms.advantages import group_advantages
    from coderl.policy.loading import load_policy
    from coderl.policy.local import LoraSpec

    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    submit = CALL_FORMATS["xml"].format_call("submit", {})
    segs = [
        run(tiny, tmp_path / str(i), [text], "xml").trajectory.segments[0]
        for i, text in enumerate([submit, submit + JUNK * 3])
    ]
    for seg in segs:  # as if sampled at temperature 1 by this model: every ratio starts at 1
        logp = policy.logprobs([seg.token_ids], 1.0)[0]
        seg.behavior_logprobs = [
            lp if v >= 0 else 0.0 for lp, v in zip(logp, seg.policy_versions, strict=True)
        ]
    rewards = torch.tensor([1.0, 1.0 - 0.2 * 3])  # tests 1.0 each, broken -0.2 per call
    adv = group_advantages(rewards, torch.tensor([0, 0])).tolist()
    assert adv[0] > 0 > adv[1]
    babble = segs[1]
    first = babble.provenance["untrained"][0][0]  # the first untrained token
    assert babble.loss_mask[first - 1] == 1 and babble.loss_mask[first] == 0

    def grad(seg_list: list[Segment]) -> torch.Tensor:
        policy.model.zero_grad()
        batch = build_batch(seg_list, adv, policy.pad_token_id)
        cfg = AlgorithmConfig(loss_agg="token-mean", old_logp="behaviour")
        accumulate_gradients(
            policy.model, batch, cfg, micro_batch_size=2, temperature=1.0, max_len=64
        )
        return torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])

    def with_ids(seg: Segment, at: range, token: int) -> Segment:
        other = copy.deepcopy(seg)
        for t in at:
            other.token_ids[t] = token
        return other

    base = grad(segs)
    assert base.abs().max() > 0
    changed_tail = grad([segs[0], with_ids(babble, range(first, len(babble)), 3)])
    torch.testing.assert_close(changed_tail, base, rtol=0, atol=0)
    changed_decision = grad([segs[0], with_ids(babble, range(first - 1, first), 3)])
    assert not torch.equal(changed_decision, base)
    trained = copy.deepcopy(babble)
    trained.loss_mask = babble.sampled_mask()  # the babble trained, as before the fix
    assert not torch.equal(grad([segs[0], trained]), base)


def test_babble_after_submit_is_scored_lower_and_counted_as_sampled(tiny):
    """The anti-hack side: untrained tokens still count for the reward (its broken calls, and
    ``sampled_tokens``, which the length term reads)."""
    from coderl.config import load_config
    from coderl.envs.agent import AgentEnvironment
    from coderl.policy.base import SamplingParams
    from coderl.rewards import compute_rewards
    from coderl.tasks.humaneval import humaneval_tasks
    from coderl.train.pipeline import attribute, reward_samples

    task = humaneval_tasks("train")[0]
    overrides = [
        "rollout.max_turns=1", "rollout.max_new_tokens=8192", "rollout.max_context_tokens=32768",
        'reward.terms={"tests": 1.0, "broken_calls": 1.0}',
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    env = AgentEnvironment(cfg, humaneval_tasks)
    script = [CALL_FORMATS["hermes"].format_call("submit", {})] * 2
    script[1] += JUNK
    eps = env.rollout(ScriptedPolicy(tiny, script), [task], SamplingParams(), 2)
    grades = env.grade([task, task], eps)
    fails = [attribute(e, g) for e, g in zip(eps, grades, strict=True)]
    samples = reward_samples(env, [task, task], ["k", "k"], eps, grades, fails)
    res = compute_rewards(samples, cfg.reward)
    seg = eps[1].trajectory.segments[0]
    assert seg.num_sampled - seg.num_trainable > 3  # the babble is untrained ...
    assert samples[1].sampled_tokens == seg.num_sampled  # ... but counted as sampled
    assert eps[1].broken_tool_calls == 1 and res.totals[1] < res.totals[0]
