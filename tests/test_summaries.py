"""Self-summarization in training: every segment of an episode (its summary tokens included) is
trained with the episode's advantage, an episode is one member of its group however many
segments it has, GAE carries the return across segments, summaries are counted per step, and
the repo-bugfix preset's context budget does make episodes summarise."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_agent_tools import make_repo, open_sandbox
from torch import nn

from coderl.agent.context import ChatRenderer
from coderl.agent.episode import EpisodeConfig, SimpleTask
from coderl.agent.parsing import get_call_format
from coderl.agent.runner import run_episodes
from coderl.agent.tools import TOOLS, resolve_tools
from coderl.config import AlgorithmConfig, load_config
from coderl.envs import EpisodeRecord, GradeRecord
from coderl.policy.episode import EpisodeBuilder
from coderl.policy.forward import forward
from coderl.policy.loading import load_policy, smollm2_gguf_path
from coderl.train import pipeline as P
from coderl.train.step import accumulate_gradients, train_step
from coderl.trajectory import Segment, Trajectory

CONFIGS = Path(__file__).parent.parent / "configs"
TOY = CONFIGS / "toy.yaml"
GRPO = load_config(TOY, ["algorithm.advantage=grpo"])
TASK_TEXT = "Fix add() in pkg/calc.py so that test_calc.py passes."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model is faster on one thread, and far faster on a loaded machine (two threads
    spinning for a shared core made a forward pass 50x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def segment(prompt: list[int], sampled: list[int]) -> Segment:
    seg = Segment()
    seg.append_context(prompt, kind="prompt")
    if sampled:
        seg.append_sampled(sampled, [-1.0] * len(sampled), 0)
    return seg


def episode(n_segments: int, *, empty_last: bool = False) -> Trajectory:
    """``n_segments`` windows of 2 prompt and 3 sampled tokens (the last sampled run of each
    but the last window stands for its summary), plus an optional prompt-only last window."""
    segs = [segment([5, 6], [7 + k, 8, 9]) for k in range(n_segments)]
    if empty_last:
        segs.append(segment([5, 6, 10], []))
    return Trajectory(segs)


def test_an_episode_is_one_group_member_whatever_its_segments():
    # group g: A (3 segments, reward 1), B (1 segment, 0), C (2 segments + the prompt-only
    # window a too-long summary opened, 0). Per episode: mean 1/3, unbiased std
    # sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 0.57735, so A = (2/3) / 0.57735 = 1.1547 and
    # B = C = -0.57735 on every one of their segments. Counting segments as members
    # ([1, 1, 1, 0, 0, 0]) would give +-0.9129 instead.
    policy = SimpleNamespace(pad_token_id=0, device="cpu")
    trajs = [episode(3), episode(1), episode(2, empty_last=True)]
    batch = P.make_batch(GRPO, policy, None, trajs, [1.0, 0.0, 0.0], [True] * 3, ["g"] * 3)
    assert batch is not None and batch.size == 6  # C's prompt-only window has nothing to train
    a, b = 2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        batch.advantages, torch.tensor([a, a, a, b, b, b]), atol=1e-4, rtol=0
    )
    only_empty = Trajectory([segment([5, 6], [])])
    assert P.make_batch(GRPO, policy, None, [only_empty], [1.0], [True], ["g"]) is None


def test_gae_credits_the_windows_before_a_summary_with_the_outcome():
    # lam = 1: the GAE return of a sampled token is the Monte-Carlo return, the outcome R
    # discounted once per sampled token after it in the *episode*: R * gamma^(L - 1 - j) for its
    # j-th of L sampled tokens over all segments. Episode 0 (3 windows of 3 sampled tokens, then
    # the prompt-only window a too-long summary opened) has L = 9: its first token's return is
    # 0.9^8 R. With each segment terminal (the old rows) the windows before a summary had
    # return 0; with the reward on every segment they would restart at R in each.
    cfg = load_config(TOY, ["algorithm.advantage=gae", "algorithm.gamma=0.9", "algorithm.lam=1.0"])
    policy = load_policy("tiny-random")
    head = nn.Linear(policy.model.config.hidden_size, 1)
    trajs = [episode(3, empty_last=True), episode(2), episode(1)]
    rewards = [1.0, -0.5, 2.0]
    batch = P.make_batch(cfg, policy, head, trajs, rewards, [True] * 3, ["a", "b", "c"])
    assert batch is not None and batch.returns is not None and batch.size == 6
    m = batch.loss_mask
    want = [R * 0.9**k for R, L in zip(rewards, (9, 6, 3), strict=True) for k in reversed(range(L))]
    torch.testing.assert_close(batch.returns[m], torch.tensor(want), atol=1e-5, rtol=0)
    assert (batch.advantages[m] != 0).all()


class FixedGrades:
    """An environment whose grader returns the grades it was given."""

    def __init__(self, grades: list[GradeRecord]):
        self.grades = grades

    def grade(self, tasks, episodes):
        return list(self.grades)

    def token_budget(self) -> int:
        return 16

    def ease(self, task) -> float | None:
        return None


def test_summary_metrics_count_summaries_and_split_the_resolved_rate():
    # 4 episodes: summaries 2, 1, 0, 0; resolved yes, no, yes, yes; the last one masked (an
    # infra failure): per episode 3/4 = 0.75, with a summary 2/4; resolved with a summary 1/2,
    # without 1/1 (the masked one is not counted in a resolved rate)
    eps = [
        EpisodeRecord("t", episode(3), "submitted", summaries=2),
        EpisodeRecord("t", episode(2), "submitted", summaries=1),
        EpisodeRecord("t", episode(1), "submitted"),
        EpisodeRecord("t", episode(1), "error"),
    ]
    solved = GradeRecord(resolved=True, fraction_passed=1.0)
    grades = [solved, GradeRecord(), solved, solved]
    cfg = load_config(TOY, ["reward.terms={tests: 1.0}", "reward.tests=resolved"])
    s = P.score(FixedGrades(grades), None, cfg, [SimpleNamespace(id="t")] * 4, ["t#0"] * 4, eps)
    m = P.step_metrics(s.infos, cfg)
    assert m["summary/per_episode"] == 0.75 and m["summary/episodes_with"] == 0.5
    assert m["summary/resolved_with"] == 0.5 and m["summary/resolved_without"] == 1.0
    assert (m["summary/valid_with"], m["summary/valid_without"]) == (2.0, 1.0)
    none = P.summary_metrics(s.infos[2:3])
    assert none["summary/episodes_with"] == 0.0 and math.isnan(none["summary/resolved_with"])


# ---------------------------------------------------------------- a tiny model that summarises
SHORT = {
    "instructions": "Fix the bug, then call submit.",
    "summary_instruction": "Summarise.",
    "no_action_message": "Call a tool.",
    "summary_template": "\n{summary}",
    "toolsets": {"repo": ("submit",)},  # a short prompt keeps the CPU test fast
}


def prompt_tokens(tokenizer, task, cfg: EpisodeConfig) -> int:
    """Tokens of the opening window of ``task``'s episodes (system prompt, tools, task)."""
    tools = resolve_tools(cfg.toolsets[task.kind], TOOLS)
    r = ChatRenderer(tokenizer, tools, get_call_format(cfg.call_format), cfg.instructions)
    opening = r.opening(cfg.task_template.format(problem_statement=task.problem_statement))
    return len(EpisodeBuilder(tokenizer, opening, tools=r.tool_schemas()).segment)


@pytest.fixture(scope="module")
def summarised(tmp_path_factory):
    """Two episodes of the tiny random model through the real harness, with a context budget
    60 tokens above the prompt: each summarises at least once and goes on in a new window."""
    policy = load_policy("tiny-random")
    task = SimpleTask("calc", "Fix add() in pkg/calc.py.")
    cfg = EpisodeConfig(max_turns=5, max_tokens_per_turn=12, summary_max_tokens=8, seed=0, **SHORT)
    prompt = prompt_tokens(policy.tokenizer, task, cfg)
    cfg.context_budget = prompt + 60
    base = make_repo(tmp_path_factory.mktemp("repo"))
    boxes = [open_sandbox(base) for _ in range(2)]
    try:
        eps = run_episodes(policy, [(task, b) for b in boxes], cfg, max_workers=2)
    finally:
        for b in boxes:
            b.close()
    for ep in eps:
        segs = ep.trajectory.segments
        assert ep.error is None and ep.stats.summaries == len(segs) - 1 >= 1
        assert segs[-1].num_trainable > 0  # the window after the summary was acted in
    return policy, eps


def summary_mask(batch, episodes) -> torch.Tensor:
    """``[B, T]`` bool: the summary tokens, the last action of each window but an episode's
    last (a summary is sampled in the window it closes); batch rows in episode order."""
    mask = torch.zeros_like(batch.loss_mask)
    row = 0
    for ep in episodes:
        segs = ep.trajectory.segments
        for k, seg in enumerate(segs):
            if k < len(segs) - 1:
                _, start, end = [s for s in seg.provenance["spans"] if s[0] == "action"][-1]
                mask[row, start:end] = True
            row += 1
    return mask


def _grads(policy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])


def test_summary_tokens_get_the_episodes_advantage_and_gradient(summarised):
    policy, eps = summarised
    trajs = [ep.trajectory for ep in eps]
    batch = P.make_batch(GRPO, policy, None, trajs, [1.0, 0.0], [True, True], ["g", "g"])
    assert batch is not None and batch.size == sum(len(t.segments) for t in trajs)
    S = summary_mask(batch, eps)  # (B, T)
    assert S.any() and not (S & ~batch.loss_mask).any()  # summary tokens are trainable
    # GRPO over the two episodes (rewards 1, 0): +-0.7071 on every segment, summaries included
    rows = [k for k, ep in enumerate(eps) for _ in ep.trajectory.segments]
    expected = torch.tensor([0.7071 if k == 0 else -0.7071 for k in rows])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-4, rtol=0)

    # The trainer's loss on the summary tokens alone: with behaviour logprobs equal to the
    # trainer's (ratio 1, nothing clipped) its gradient is -(1 / |S|) sum_S A_row grad logp.
    t = batch.tokens
    with torch.no_grad():
        t.behavior_logprobs.copy_(forward(policy.model, t, temperature=1.0).logp * t.loss_mask)
    alg = AlgorithmConfig(old_logp="behaviour", entropy_coef=0.0)
    only = batch.rows(0, batch.size)
    only.tokens.loss_mask = S.float()
    policy.model.zero_grad()
    accumulate_gradients(policy.model, only, alg, micro_batch_size=8, temperature=1.0, max_len=12)
    got = _grads(policy)
    policy.model.zero_grad()
    logp = forward(policy.model, t, temperature=1.0).logp  # (B, T)
    (-(batch.advantages[:, None] * logp * S).sum() / S.sum()).backward()
    want = _grads(policy)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))

    # and the full batch's gradient changes when the summary tokens leave the loss
    policy.model.zero_grad()
    accumulate_gradients(policy.model, batch, alg, micro_batch_size=8, temperature=1.0, max_len=12)
    with_s = _grads(policy)
    no_s = batch.rows(0, batch.size)
    no_s.tokens.loss_mask = (batch.loss_mask & ~S).float()
    policy.model.zero_grad()
    accumulate_gradients(policy.model, no_s, alg, micro_batch_size=8, temperature=1.0, max_len=12)
    assert (with_s - _grads(policy)).abs().max() > 1e-3 * with_s.abs().max()


def test_a_training_step_on_summary_tokens_moves_them_with_the_reward(summarised):
    # One trainer step (AdamW) on the summary tokens alone: the rewarded episode's summary
    # becomes more likely relative to the unrewarded one's (the loss is
    # -(A / |S|) (sum logp(summary+) - sum logp(summary-)), A = 0.7071).
    policy, eps = summarised
    policy = load_policy("tiny-random")  # a fresh copy: the module's model is shared
    trajs = [ep.trajectory for ep in eps]
    batch = P.make_batch(GRPO, policy, None, trajs, [1.0, 0.0], [True, True], ["g", "g"])
    assert batch is not None
    S = summary_mask(batch, eps)
    sign = torch.tensor([1.0 if a > 0 else -1.0 for a in batch.advantages.tolist()])[:, None]

    def gap() -> float:
        with torch.no_grad():
            logp = forward(policy.model, batch.tokens, temperature=1.0).logp
        return float((sign * logp * S).sum())

    before = gap()
    only = batch.rows(0, batch.size)
    only.tokens.loss_mask = S.float()
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = load_config(TOY, ["algorithm.old_logp=behaviour", "algorithm.entropy_coef=0.0"])
    train_step(
        policy.model, opt, sched, only, cfg.algorithm, cfg.trainer, temperature=1.0, max_len=12
    )
    assert gap() > before


# ---------------------------------------------------------------- the repo-bugfix preset
def test_the_repo_bugfix_budget_makes_an_episode_that_reads_a_module_summarise(tmp_path):
    # The preset's own episode settings (rollout.* and tasks.options.episode) and its model's
    # tokenizer (SmolLM2's, from the shipped GGUF): an agent that reads one real-sized module
    # (a read_file observation is up to tools.max_observation_chars, ~8,000 characters) runs
    # the tests and submits must summarise once at the preset's max_context_tokens, and the
    # summary segment is trained with the episode's advantage.
    from transformers import AutoTokenizer

    from coderl.agent.parsing import CALL_FORMATS
    from coderl.agent.runner import run_episode
    from coderl.agent.scripted import ScriptedPolicy
    from coderl.envs.agent import AgentEnvironment

    cfg = load_config(CONFIGS / "repo-bugfix.yaml", ["model.name=smollm2-135m"])
    gguf = smollm2_gguf_path()  # raises with install instructions when missing
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    ep_cfg = AgentEnvironment(cfg, load=lambda split: []).episode_config(P.sampling_params(cfg, 0))
    base = make_repo(tmp_path)
    body = "".join(
        f'def scale_{i}(value, factor={i}):\n    """Return value times {i}."""\n'
        f"    return value * factor\n\n\n"
        for i in range(200)
    )
    (base / "pkg" / "scale.py").write_text(body)  # ~14,000 characters, a mid-sized module
    call = CALL_FORMATS[ep_cfg.call_format].format_call
    actions = iter(
        [
            call("read_file", {"path": "pkg/scale.py"}),
            call("read_file", {"path": "pkg/calc.py"}),
            call("run", {"command": "python3 -m pytest -q test_calc.py"}),
            call("submit", {}),
        ]
    )

    def script(prompt: str) -> str:
        if ep_cfg.summary_instruction in prompt[-len(ep_cfg.summary_instruction) - 80 :]:
            return "I read pkg/scale.py and pkg/calc.py; add() subtracts. Next: fix it."
        return next(actions)

    box = open_sandbox(base)
    try:
        ep = run_episode(ScriptedPolicy(tok, script), SimpleTask("calc", TASK_TEXT), box, ep_cfg)
    finally:
        box.close()
    assert ep.error is None and ep.stats.finish_reason == "submitted"
    assert ep.stats.summaries >= 1, (
        f"rollout.max_context_tokens={cfg.rollout.max_context_tokens} never filled: "
        f"{[len(s) for s in ep.trajectory.segments]} tokens"
    )
    segs = ep.trajectory.segments
    assert len(segs) == ep.stats.summaries + 1
    policy = SimpleNamespace(pad_token_id=tok.pad_token_id or 0, device="cpu")
    other = EpisodeRecord("calc", episode(1)).trajectory
    batch = P.make_batch(
        GRPO, policy, None, [ep.trajectory, other], [1.0, 0.0], [True] * 2, ["g"] * 2
    )
    assert batch is not None and batch.size == len(segs) + 1
    torch.testing.assert_close(
        batch.advantages[: len(segs)], torch.full((len(segs),), 0.7071), atol=1e-4, rtol=0
    )


def test_a_train_step_with_a_small_budget_summarises_and_trains_every_sampled_token(tmp_path):
    # `coderl train`'s step (PPO + GAE) on a HumanEval task with the tiny model and a context
    # budget 60 tokens above its prompt: the episodes summarise, and every token they sampled,
    # summaries included, is in the loss (trained_tokens counts the loss mask)
    from coderl.envs.registry import build_environment
    from coderl.policy.base import SamplingParams
    from coderl.policy.tiny import tiny_tokenizer
    from coderl.train.loop import setup_run, training_step

    episode_opts = (
        "tasks.options={episode: {call_format: xml, toolsets: {function: [write_file, submit]}, "
        'summary_max_tokens: 8, summary_instruction: "Summarise.", no_action_message: '
        '"Call a tool.", summary_template: "\\n{summary}", instructions: "Solve it, then submit."}}'
    )
    over = [
        *("model.name=tiny-random", "model.lora=false", "sft.enabled=false", f"run_dir={tmp_path}"),
        *("progress=false", "tensorboard=false", "eval.before_after=false"),
        *("tasks.tasks_per_step=1", "tasks.limit=1", "rollout.group_size=4"),
        *("rollout.max_turns=5", "rollout.max_new_tokens=12", "algorithm.advantage=gae"),
        # this test's own sampling, whatever the demo recipe draws and resamples
        *("tasks.sampler=uniform", "dynamic_sampling.mode=off", "engine.dtype=float32"),
        episode_opts,
    ]
    default = CONFIGS / "default.yaml"
    env = build_environment(load_config(default, over))
    task, ep_cfg = env.tasks("train")[0], env.episode_config(SamplingParams())
    prompt = prompt_tokens(tiny_tokenizer(), task, ep_cfg)  # the tiny-random model's tokenizer
    run = setup_run(load_config(default, [*over, f"rollout.max_context_tokens={prompt + 60}"]))
    m = training_step(run)
    assert m["summary/per_episode"] >= 1 and m["summary/episodes_with"] == 1.0
    assert m["episode/segments"] == m["summary/per_episode"] + 1
    assert m["trained_tokens"] == m["episode/sampled_tokens"] * m["episodes"] > 0
    assert m["value_loss"] > 0 and m["optimizer_steps"] == 1


def test_turns_after_a_summary_are_counted_as_going_on(summarised):
    """The policy's own summaries (tiny random model): the turns it took in windows a summary
    opened are the episode's turns less those of its first window (whose last action is the
    summary)."""
    _, eps = summarised
    for ep in eps:
        first = ep.trajectory.segments[0].provenance["spans"]
        first_turns = sum(s[0] == "action" for s in first) - 1
        assert ep.stats.turns_after_summary == ep.stats.turns - first_turns >= 1


def test_step_metrics_count_episodes_that_summarised_and_went_on():
    # 3 episodes: summarised and went on (resolved), summarised and ended there (not), none
    eps = [
        EpisodeRecord("t", episode(2), "submitted", summaries=1, turns_after_summary=2),
        EpisodeRecord("t", episode(2), "context", summaries=1),
        EpisodeRecord("t", episode(1), "submitted"),
    ]
    solved = GradeRecord(resolved=True, fraction_passed=1.0)
    cfg = load_config(TOY, ["reward.terms={tests: 1.0}", "reward.tests=resolved"])
    grades = FixedGrades([solved, GradeRecord(), GradeRecord()])
    s = P.score(grades, None, cfg, [SimpleNamespace(id="t")] * 3, ["t#0"] * 3, eps)
    m = P.step_metrics(s.infos, cfg)
    assert m["summary/episodes_with"] == pytest.approx(2 / 3)
    assert m["summary/episodes_continued"] == pytest.approx(1 / 3)
    assert m["summary/resolved_continued"] == 1.0 and m["summary/valid_continued"] == 1.0
    # each window of episode(): 2 prompt tokens, then 3 sampled: a call with a 2-token prompt
    assert m["kv/distinct_tokens"] == pytest.approx((10 + 10 + 5) / 3)
    assert m["kv/prompt_tokens"] == m["kv/prefill_tokens"] == pytest.approx((4 + 4 + 2) / 3)
