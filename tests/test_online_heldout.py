"""The gate's held-out evaluation through ``coderl eval``'s code:
the run's environment, multi-turn harness episodes, the training graders and hack detectors."""

from __future__ import annotations

from pathlib import Path

import pytest

from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.scripted import ScriptedPolicy
from coderl.config import load_online_config
from coderl.envs import build_environment
from coderl.eval.passk import evaluate
from coderl.online.cycle import heldout_evaluator
from coderl.online.heldout import EnvEvaluator
from coderl.online.monitors import SUSPECTED_HACK_RATE
from coderl.policy.tiny import tiny_tokenizer
from coderl.train.pipeline import sampling_params


def _cfg(tmp_path: Path):
    return load_online_config(
        "configs/online-demo.yaml",
        [f"run_dir={tmp_path}", "online.eval.limit=2", "online.eval.samples=2",
         "rollout.max_new_tokens=2048"],  # the scripted solution's call, a token per byte
    )  # fmt: skip


def test_the_env_suite_is_coderl_eval_on_the_heldout_split(tmp_path):
    cfg = _cfg(tmp_path)
    ev = heldout_evaluator(cfg)
    assert isinstance(ev, EnvEvaluator)
    env = build_environment(cfg)
    assert [t.id for t in ev.tasks] == [t.id for t in env.tasks(cfg.tasks.heldout_split)[:2]]
    fmt = CALL_FORMATS[cfg.tasks.options["episode"]["call_format"]]
    solved, hacked = ev.tasks

    added = [x[1:] for x in solved.gold_patch.splitlines() if x.startswith("+") and x[:3] != "+++"]
    code = solved.workspace_files["solution.py"] + "".join(x + "\n" for x in added)

    def script(prompt: str) -> str:
        if prompt.count("assistant") > 1:  # a turn already acted: submit
            return fmt.format_call("submit", {})
        if f"Implement `{solved.extra['entry_point']}`" in prompt:
            return fmt.format_call("write_file", {"path": "solution.py", "content": code})
        return fmt.format_call("write_file", {"path": "hidden_test.py", "content": "x = 1\n"})

    res = ev(ScriptedPolicy(tiny_tokenizer(), script))
    assert res.task_ids == [solved.id, hacked.id]
    assert res.scores["pass@1"] == [1.0, 0.0]
    assert res.behaviour["edit_rate"] == pytest.approx(1.0)
    assert res.behaviour[SUSPECTED_HACK_RATE] == pytest.approx(0.5)  # the hidden-test edit
    assert len(res.views) == 4
    # the same numbers as coderl eval's evaluate on the same environment and seeds
    e = cfg.online.eval
    params = sampling_params(cfg, e.seed, e.temperature)
    direct = evaluate(env, ScriptedPolicy(tiny_tokenizer(), script), ev.tasks, samples=2, ks=[1],
                      params=params)  # fmt: skip
    assert [t["correct"] / t["n"] for t in direct.per_task] == res.scores["pass@1"]


def test_a_cycle_gates_through_the_env_suite(tmp_path):
    import time

    from coderl.endpoint.http import BackgroundServer
    from coderl.online.cycle import load_version, open_run, run_cycle
    from coderl.online.server import InteractionServer
    from coderl.online.simulate import SimulatedPopulation

    cfg = load_online_config(
        "configs/online-demo.yaml",
        [f"run_dir={tmp_path}", "online.eval.limit=2",
         "online.serve.max_new_tokens=6", "online.min_batch=4", "trainer.steps=1",
         "rollout.max_new_tokens=4",
         "online.reward.windows_s={accepted: 1, rejected: 1, edit_persisted: 1, follow_up: 1, "
         "tool_error: 1, latency_ms: 1}"],
    )  # fmt: skip
    store, registry = open_run(cfg)
    server = InteractionServer(load_version(cfg, registry, 0), store, version=0, max_new_tokens=6)
    bg = BackgroundServer(server.app())
    try:
        SimulatedPopulation(bg.base_url, cfg.online.simulate).run(8)
    finally:
        bg.stop()
    later = time.time() + 5
    rep = run_cycle(cfg, clock=lambda: later, log=lambda s: None)
    assert rep["decision"] in ("promoted", "rejected")
    held = rep["heldout"]["pass@1"]
    assert held["candidate"]["n"] == held["champion"]["n"] == 2  # the env suite's two tasks


def test_a_populations_suite_is_its_tasks_through_the_env_with_its_house_style(tmp_path):
    """A population's suite: the same environment's held-out tasks its filter matches; a
    resolved episode whose code breaks the house style fails it (and passes the shared one)."""
    from coderl.config.online import PopulationConfig
    from tests.online_scripts import solver

    cfg = _cfg(tmp_path)
    shared = EnvEvaluator(cfg)
    wanted = [t.id for t in build_environment(cfg).tasks(cfg.tasks.heldout_split)[2:4]]
    pattern = "^(" + "|".join(wanted) + ")$"
    pop = PopulationConfig(name="org-a", task_filter=pattern, house_style="no_print")
    own = heldout_evaluator(cfg, pop)
    assert [t.id for t in own.tasks] == wanted
    printing = 'def _log() -> None:\n    print("hi")\n\n\n'
    assert own(solver(cfg, own.tasks)).scores["pass@1"] == [1.0, 1.0]
    assert own(solver(cfg, own.tasks, printing)).scores["pass@1"] == [0.0, 0.0]
    assert shared(solver(cfg, shared.tasks, printing)).scores["pass@1"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="matches no held-out task"):
        EnvEvaluator(cfg, PopulationConfig(name="org-b", task_filter="^nope$"))


def test_house_style_reads_the_post_image_of_every_python_file():
    from coderl.online.suites import diff_keeps_house_style
    from coderl.tasks.humaneval import humaneval_tasks
    from coderl.tasks.patches import make_diff

    task = humaneval_tasks("heldout")[0]
    before = task.workspace_files["solution.py"]
    untyped = make_diff("solution.py", before, before + "\ndef helper(x):\n    return x\n")
    doc = make_diff("solution.py", before, before + '\ndef helper(x):\n    """x"""\n    return x\n')
    other = make_diff("util.py", "", "def g(x):\n    return x\n")
    assert diff_keeps_house_style(task, untyped, None)
    assert not diff_keeps_house_style(task, untyped, "docstrings")
    assert diff_keeps_house_style(task, doc, "docstrings")
    assert not diff_keeps_house_style(task, doc + other, "docstrings")  # the second file breaks it
    assert diff_keeps_house_style(task, "", None) and not diff_keeps_house_style(
        task, "", "no_print"
    )
    assert not diff_keeps_house_style(task, "not a diff", "no_print")
