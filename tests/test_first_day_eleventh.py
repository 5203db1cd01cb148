"""A user's first day (issue 48), eleventh pass: a tool set that misses the tasks' kind is
refused before the model loads; a missing built environment is named before the model loads
and logged in one line per task during rollouts; imported instances whose gold patch does not
apply are dropped; the online loop reports progress; a step with every group dropped still logs
what its graded rollouts measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import coderl.online.cycle
import coderl.train.run
from coderl.cli import main

ROOT = Path(__file__).parent.parent
REPAIR = str(ROOT / "configs" / "repair.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false"]


pytestmark = pytest.mark.usefixtures("one_torch_thread_each")  # conftest: tests set threads


class ModelLoads(RuntimeError):
    """Raised where a command loads its model: a refusal must come before it."""


def _stop_at_model(*args, **kwargs):
    raise ModelLoads()


# --- 1. a tool set without the tasks' kind: one line before the model loads ---------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["train", REPAIR, "model.name=tiny-random", "sft.enabled=false", *FAST],
        ["demo", "--config", REPAIR, "model.name=tiny-random", "sft.enabled=false", *FAST],
    ],
    ids=lambda argv: argv[0],
)
def test_repo_tasks_with_a_function_only_tool_set_are_refused(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    assert main([*argv, "tasks.source=repo", f"run_dir={tmp_path / 'run'}"]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err
    assert "tasks.options.episode.toolsets has no tool set for this source's 'repo'" in err[0]
    assert "tasks.options.episode.toolsets.repo=[read_file, search" in err[0]


def test_a_tool_set_naming_an_unknown_tool_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    argv = ["train", REPAIR, "model.name=tiny-random", "sft.enabled=false", *FAST]
    overrides = ["tasks.options.episode.toolsets.function=[write_fiel, submit]"]
    assert main([*argv, *overrides, f"run_dir={tmp_path / 'run'}"]) != 0
    err = capsys.readouterr().err
    assert "tasks.options.episode.toolsets.function: unknown tools ['write_fiel']" in err


def test_eval_of_repo_tasks_with_a_function_only_tool_set_is_refused(tmp_path, monkeypatch):
    from coderl.cli.eval import _check_split
    from coderl.config import ConfigError, load_config

    cfg = load_config(REPAIR, ["tasks.source=repo", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="toolsets has no tool set for this source's 'repo'"):
        _check_split(cfg, "repo:heldout", "heldout")


def test_simulated_agent_traffic_with_a_tool_set_without_function_tasks_is_refused(tmp_path):
    from coderl.cli.online import agent_episode_config
    from coderl.config import ConfigError, load_online_config

    cfg = load_online_config(
        str(ROOT / "configs" / "online-demo.yaml"),
        [f"run_dir={tmp_path}", "online.simulate.episode.toolsets={repo: [read_file, submit]}"],
    )
    key = "online.simulate.episode.toolsets has no tool set for this source's 'function' tasks"
    with pytest.raises(ConfigError, match=key):
        agent_episode_config(cfg)


# --- 2. environments not built: one line before the model loads, one line per masked task -------

BUGFIX = str(ROOT / "configs" / "repo-bugfix.yaml")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CODERL_CACHE", str(tmp_path / "emptycache"))
    return tmp_path / "emptycache"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", BUGFIX, "model.name=tiny-random", "sft.enabled=false", *FAST],
        ["sft", BUGFIX, "model.name=tiny-random", "sft.cache=false", "sft.limit=4"],
    ],
    ids=lambda argv: argv[0],
)
def test_unbuilt_environments_are_refused_before_the_model_loads(
    argv, tmp_path, empty_cache, monkeypatch, capsys
):
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    assert main([*argv, f"run_dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err
    assert "need environments that are not built in" in err[0] and str(empty_cache) in err[0]
    assert "`coderl tasks build-env " in err[0] and "boltons==25.0.0" in err[0], err[0]


def test_eval_of_unbuilt_environments_is_refused_before_the_model_loads(tmp_path, empty_cache):
    from coderl.cli.eval import _check_split
    from coderl.config import load_config

    cfg = load_config(BUGFIX, ["eval.tasks=2", f"run_dir={tmp_path}"])
    with pytest.raises(ValueError, match="2 repository tasks need environments that are not built"):
        _check_split(cfg, None, cfg.tasks.heldout_split)


def test_a_masked_episode_of_an_unbuilt_environment_logs_one_line(tmp_path, empty_cache, caplog):
    import logging

    from coderl.config import load_config
    from coderl.envs import build_environment
    from coderl.policy import SamplingParams

    env = build_environment(load_config(BUGFIX, [f"run_dir={tmp_path}"]))
    tasks = env.tasks("train")[:2]
    caplog.set_level(logging.DEBUG, logger="coderl")
    records = env.rollout(None, tasks, SamplingParams(), 2)  # no sandbox starts: no model call
    assert [r.failure for r in records] == ["infra"] * 4
    masked = [r for r in caplog.records if "could not start" in r.getMessage()]
    assert len(masked) == 4 and not any(r.exc_info for r in masked)
    assert [r.levelno for r in masked].count(logging.WARNING) == len({t.env_id for t in tasks})
    assert "no built environment matches" in masked[0].getMessage()


# --- 3. imported instances whose gold patch cannot work are dropped, one line each --------------


def _mini_cache(tmp_path: Path, monkeypatch) -> Path:
    """A cache holding one environment record over the mini repository of test_tasks_swebench."""
    from test_tasks_swebench import fake_env, make_repo

    cache = tmp_path / "cache"
    env = fake_env(make_repo(tmp_path / "repo"))
    (cache / "envs" / env.env_id).mkdir(parents=True)
    env.save(cache / "envs" / env.env_id / "env.json")
    monkeypatch.setenv("CODERL_CACHE", str(cache))
    return cache


def test_import_drops_instances_whose_gold_patch_or_tests_cannot_work(
    tmp_path, monkeypatch, capsys
):
    from test_tasks_swebench import BUGGY, FIXED, instance, write_jsonl

    from coderl.tasks.patches import make_diff
    from coderl.tasks.spec import load_tasks

    _mini_cache(tmp_path, monkeypatch)
    rows = [
        instance(),  # the gold patch applies to the snapshot: kept
        instance(instance_id="mini__solved", patch=make_diff("mini/calc.py", FIXED, BUGGY)),
        instance(instance_id="mini__nofile", FAIL_TO_PASS='["tests/test_nope.py::test_add"]'),
    ]
    out = tmp_path / "tasks.jsonl"
    argv = ["tasks", "import", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out", str(out)]
    assert main([*argv, "--env", "mini-local-000000000000"]) == 0
    said = capsys.readouterr().out
    assert "dropped mini__solved: the gold patch is already in the environment's snapshot" in said
    assert "dropped mini__nofile: FAIL_TO_PASS names tests in files the environment" in said
    assert "1 tasks (swebench) -> " in said and ", 2 dropped" in said
    assert f"coderl tasks validate {out}" in said
    assert [t.id for t in load_tasks(out)] == ["mini__mini-1"]


def test_import_says_when_the_environment_is_not_built(tmp_path, monkeypatch, capsys):
    from test_tasks_swebench import instance, write_jsonl

    _mini_cache(tmp_path, monkeypatch)
    row = instance(coderl={"env_id": "mini-local-ffffffffffff"})  # named, not built
    out = tmp_path / "tasks.jsonl"
    assert (
        main(["tasks", "import", str(write_jsonl(tmp_path / "in.jsonl", [row])), "--out", str(out)])
        == 0
    )
    said = capsys.readouterr().out
    assert "not checked: environments ['mini-local-ffffffffffff'] are not built" in said


def test_import_drops_an_instance_that_reuses_a_shipped_task_id(tmp_path, monkeypatch, capsys):
    from test_tasks_swebench import instance, write_jsonl

    from coderl.tasks.repos import task_files
    from coderl.tasks.spec import load_tasks

    shipped = load_tasks(task_files()[0])[0]
    _mini_cache(tmp_path, monkeypatch)
    rows = [instance(), instance(instance_id=shipped.id)]
    out = tmp_path / "tasks.jsonl"
    argv = ["tasks", "import", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out", str(out)]
    assert main([*argv, "--env", "mini-local-000000000000"]) == 0
    said = capsys.readouterr().out
    assert (
        f"dropped {shipped.id}: the id of a shipped task" in said and "another instance_id" in said
    )


def test_a_task_under_a_shipped_id_is_told_to_take_another_id():
    from coderl.grading.twincheck import TWIN_CHECK, TwinRecordError, load, twin_policy
    from coderl.tasks.repos import task_files
    from coderl.tasks.spec import load_tasks

    recorded = load(TWIN_CHECK)
    shipped = next(t for p in task_files() for t in load_tasks(p) if t.id in recorded)
    other = shipped.model_copy(update={"gold_patch": shipped.gold_patch + "\n"})
    with pytest.raises(TwinRecordError) as e:
        twin_policy(other)
    said = str(e.value)
    assert "needs an id no shipped task has" in said
    assert f"coderl tasks twin-check FILE --ids {shipped.id}" in said


# --- 4. coderl online run: progress of its train and gate phases; the traffic's broken calls ---


def test_the_online_update_shows_its_steps(capsys):
    from coderl.config import AlgorithmConfig, TrainerConfig
    from coderl.online.update import update
    from coderl.policy.base import SamplingParams
    from coderl.policy.local import LocalPolicy
    from coderl.policy.tiny import tiny_random

    torch.manual_seed(0)
    model, tok = tiny_random(0)
    policy = LocalPolicy(model, tok, reference=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = policy.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    rows = [
        {"interaction_id": f"i{i}", "prompt_token_ids": p, "completion_token_ids": o.token_ids,
         "behaviour_logprobs": o.logprobs, "policy_version": 0, "exploration": False}
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]  # fmt: skip
    trainer = TrainerConfig(steps=2, lr=1e-3, micro_batch_size=2)
    update(policy, policy, rows, torch.tensor([1.0, -1.0]), algorithm=AlgorithmConfig(),
           trainer=trainer, temperature=1.0, max_len=4, progress=True)  # fmt: skip
    err = capsys.readouterr().err
    assert "online train 1/2 elapsed " in err and "online train 2/2 elapsed " in err, err
    assert " eta " in err and "2 interactions, loss " in err


def test_the_gate_evaluation_shows_its_tasks(tmp_path, capsys):
    from coderl.config import load_online_config
    from coderl.online.heldout import EnvEvaluator
    from tests.online_scripts import solver

    cfg = load_online_config(
        str(ROOT / "configs" / "online-demo.yaml"),
        [f"run_dir={tmp_path}", "online.eval.limit=2", "online.eval.samples=2",
         "rollout.max_new_tokens=2048", "eval.batch_episodes=2"],
    )  # fmt: skip
    ev = EnvEvaluator(cfg)
    ev(solver(cfg, ev.tasks))
    err = capsys.readouterr().err
    assert "gate held-out (2 samples/task) 1/2 elapsed " in err, err
    assert "gate held-out (2 samples/task) 2/2 elapsed " in err and "resolved " in err


def test_the_traffic_line_does_not_call_its_count_what_the_monitors_call_broken_calls():
    from coderl.online.simulate import SimStats

    line = SimStats(requests=24, broken_calls=1).line()
    assert "broken" not in line and "1 tool_error events (calls the clients could not use)" in line


# --- 5. a step whose every group was dropped logs what its graded rollouts measured -------------


def test_a_step_with_every_group_dropped_logs_what_its_rollouts_measured(
    tmp_path, monkeypatch, capsys
):
    from coderl.envs.base import GradeRecord
    from coderl.envs.toy import ToyEnvironment
    from coderl.metrics import read_jsonl
    from coderl.train.run import step_status

    def all_resolved(self, tasks, episodes):
        return [GradeRecord(resolved=True, fraction_passed=1.0) for _ in episodes]

    monkeypatch.setattr(ToyEnvironment, "grade", all_resolved)
    toy = str(ROOT / "configs" / "toy.yaml")
    argv = ["train", toy, *FAST, "trainer.steps=1", "rollout.group_size=2", "--no-report"]
    argv += [
        "rollout.max_new_tokens=2",
        "dynamic_sampling.mode=drop",
        f"run_dir={tmp_path / 'run'}",
    ]
    assert main(argv) == 0
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["optimizer_steps"] == 0.0 and row["episodes"] == 0.0  # nothing trained
    n = row["dynamic/dropped_groups"] * 2
    assert row["measured_episodes"] == n > 0
    assert row["resolved_rate"] == 1.0 and row["reward/mean"] is not None
    assert row["reward/tests"] == 1.0
    said = step_status(row)
    assert said.endswith(
        f"(no update): reward {row['reward/mean']:.3f} resolved 100% of {n:.0f} episodes"
    )
