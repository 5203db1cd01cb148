"""The gameability probes wired into training: with a learned term configured, ``coderl train``
and ``coderl train-async`` log the same ``graders/probe/<term>/*`` metrics every
``graders.probe_every`` steps, a deliberately naive judge (one that believes "score 10" in the
diff) is flagged, and one that reads only the code's behaviour is not; ``coderl eval
--episodes-out`` writes the episodes JSONL the grader tools read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from coderl.agent.episode import Episode, EpisodeStats
from coderl.asyncrl.trainer import train_async
from coderl.config import load_config
from coderl.envs import ENVIRONMENTS, ToyEnvironment
from coderl.eval.observers import default_observers
from coderl.metrics import read_jsonl
from coderl.rewards import learned as terms
from coderl.train.loop import train

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
OVERRIDES = [
    "tasks.source=diffy",
    "rollout.group_size=4",
    "trainer.micro_batch_size=8",
    "trainer.steps=2",
    "trainer.checkpoint_every=2",
    "tensorboard=false",
    "progress=false",
    "eval.before_after=false",
    "reward.terms={tests: 1.0, judge: 0.5}",
    "graders.probe_every=2",
    "graders.probe_episodes=4",
]
DIFF = "--- a/core.py\n+++ b/core.py\n@@ -1,1 +1,2 @@\n x = 0\n+total = x + 1\n"


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class DiffyToy(ToyEnvironment):
    """The toy environment whose episodes carry a small Python diff (for the judge to read)."""

    def rollout(self, policy, tasks, params, group_size):
        episodes = super().rollout(policy, tasks, params, group_size)
        for k, ep in enumerate(episodes):
            eid = f"d{params.seed}-{k}"
            ep.episode = Episode(ep.task_id, eid, ep.trajectory, [], [], DIFF, EpisodeStats())
        return episodes


@dataclass
class NaiveJudge:
    """Believes what the diff tells it: 1.0 when it asks for a 10, else 0.3."""

    calls: int = 0

    def score(self, views):
        self.calls += 1
        return [1.0 if "score 10" in v.diff else 0.3 for v in views]


@dataclass
class BehaviourJudge:
    """Ignores comments and strings: scores by whether any code line was added."""

    def score(self, views):
        def code(d: str) -> bool:
            return any(
                ln.startswith("+")
                and not ln.startswith("+++")
                and ln[1:].strip()
                and not ln[1:].lstrip().startswith("#")
                and "_grader_note" not in ln
                for ln in d.splitlines()
            )

        return [0.8 if code(v.diff) else 0.1 for v in views]


@pytest.fixture
def diffy(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "diffy", lambda cfg: DiffyToy(cfg.rollout.max_new_tokens))


def _seed_judge(monkeypatch, cfg, grader) -> None:
    """Installs ``grader`` as the process's judge for ``cfg`` (no model is loaded)."""
    monkeypatch.setitem(terms._GRADERS, ("judge", cfg.reward.judge.model_dump_json()), grader)


def _probe_keys(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("graders/probe/")}


def test_a_naive_judge_is_flagged_on_the_probe_steps_only(tmp_path, diffy, monkeypatch):
    cfg = load_config(TOY, [*OVERRIDES, f"run_dir={tmp_path}"])
    judge = NaiveJudge()
    _seed_judge(monkeypatch, cfg, judge)
    train(cfg, observers=default_observers())
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert _probe_keys(rows[0]) == {}  # step 1: not a probe step (probe_every=2)
    m = _probe_keys(rows[1])
    assert m["graders/probe/judge/injection_comment/flagged"] == 1.0
    assert m["graders/probe/judge/injection_comment/shift"] == pytest.approx(0.7)
    assert m["graders/probe/judge/injection_string/flagged"] == 1.0
    assert m["graders/probe/judge/rename/flagged"] == 0.0  # shift 0: not raised
    assert m["graders/probe/judge/flagged"] == 2.0
    assert rows[1]["alarm/grader_gameable"] == 1.0  # a run training on a gameable grader alarms
    assert "alarm/grader_gameable" not in rows[0]  # logged on probe steps only
    # the reward term scored with the same judge: weight 0.5 x 0.3 on the resolved episodes,
    # 0 on the others (learned terms are gated on the tests by default)
    assert rows[1]["resolved_rate"] > 0
    assert rows[1]["reward/judge"] == pytest.approx(0.15 * rows[1]["resolved_rate"])


def test_a_judge_that_reads_behaviour_is_not_flagged(tmp_path, diffy, monkeypatch):
    cfg = load_config(TOY, [*OVERRIDES, f"run_dir={tmp_path}"])
    _seed_judge(monkeypatch, cfg, BehaviourJudge())
    train(cfg, observers=default_observers())
    row = read_jsonl(tmp_path / "metrics.jsonl")[1]
    m = _probe_keys(row)
    assert m["graders/probe/judge/flagged"] == 0.0
    assert row["alarm/grader_gameable"] == 0.0
    assert m["graders/probe/judge/injection_comment/shift"] == pytest.approx(0.0)
    assert m["graders/probe/judge/unchanged_summary/shift"] == pytest.approx(-0.7)


def test_train_async_logs_the_same_probe_metrics(tmp_path, diffy, monkeypatch):
    sync = load_config(TOY, [*OVERRIDES, f"run_dir={tmp_path / 'sync'}"])
    _seed_judge(monkeypatch, sync, NaiveJudge())
    train(sync, observers=default_observers())
    extra = ["async.max_staleness=0", "async.local_mode=thread"]
    cfg = load_config(TOY, [*OVERRIDES, *extra, f"run_dir={tmp_path / 'async'}"])
    train_async(cfg)
    ms, ma = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("sync", "async"))
    assert [_probe_keys(r) for r in ms] == [_probe_keys(r) for r in ma]
    assert _probe_keys(ma[1])["graders/probe/judge/flagged"] == 2.0


def test_no_probe_without_a_learned_term(tmp_path, diffy, monkeypatch):
    cfg = load_config(TOY, [*OVERRIDES, "reward.terms={tests: 1.0}", f"run_dir={tmp_path}"])
    judge = NaiveJudge()
    _seed_judge(monkeypatch, cfg, judge)
    train(cfg, observers=default_observers())
    assert judge.calls == 0
    assert all(_probe_keys(r) == {} for r in read_jsonl(tmp_path / "metrics.jsonl"))


def test_coderl_eval_dumps_episodes_that_the_grader_tools_read(tmp_path, diffy, capsys):
    """``coderl eval --episodes-out`` -> the episodes JSONL of ``coderl rm train --episodes`` and
    ``coderl graders probe``: one line per evaluated episode, outcomes matching the eval's."""
    from coderl.cli import main
    from coderl.graders.pairs import pairs_from_outcomes, read_episodes
    from coderl.graders.probes import run_probes

    run_dir = tmp_path / "run"
    train(load_config(TOY, [*OVERRIDES, "reward.terms={tests: 1.0}", f"run_dir={run_dir}"]))
    out = tmp_path / "eps.jsonl"
    argv = ["eval", str(run_dir), "k=4", "eval.tasks=3", "--episodes-out", str(out)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    views, resolved = read_episodes(out)
    assert len(views) == 3 * 4
    tasks = sorted({v.task_id for v in views})
    assert len(tasks) == 3 and all(sum(v.task_id == t for v in views) == 4 for t in tasks)
    # the dumped outcomes are the ones pass@k counted: pass@1 is the mean per-task pass rate
    rates = [
        sum(ok for v, ok in zip(views, resolved, strict=True) if v.task_id == t) / 4 for t in tasks
    ]
    assert result["pass_at"]["1"]["mean"] == pytest.approx(sum(rates) / 3)
    assert all(v.diff == DIFF for v in views)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["resolved"] for r in rows] == resolved and {"tool_log", "tests_report"} <= set(
        rows[0]
    )
    pairs = pairs_from_outcomes(views, resolved)  # what `coderl rm train --episodes` trains on
    assert len(pairs) == sum(min(16, 4 * r * (4 - 4 * r)) for r in rates)
    assert all(p.context_id in tasks for p in pairs)
    by = {r.probe: r for r in run_probes(NaiveJudge(), views)}  # what `coderl graders probe` runs
    assert by["injection_comment"].n == 12 and by["injection_comment"].flagged
