"""The gate's held-out evaluation through ``coderl eval``'s code (``online.eval.suite: env``):
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
from coderl.policy.base import SamplingParams
from coderl.policy.tiny import tiny_tokenizer


def _cfg(tmp_path: Path):
    return load_online_config(
        "configs/online-demo.yaml",
        [f"run_dir={tmp_path}", "online.eval.suite=env", "online.eval.limit=2",
         "online.eval.samples=2", "rollout.max_new_tokens=2048",
         "rollout.max_context_tokens=16384"],  # the tiny tokenizer spends a token per byte
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
    params = SamplingParams(temperature=e.temperature, max_new_tokens=e.max_new_tokens, seed=e.seed)
    direct = evaluate(env, ScriptedPolicy(tiny_tokenizer(), script), ev.tasks, samples=2, ks=[1],
                      params=params)  # fmt: skip
    assert [t["correct"] / t["n"] for t in direct.per_task] == res.scores["pass@1"]


def test_a_cycle_gates_through_the_env_suite(tmp_path):
    import time

    from coderl.online.cycle import load_version, open_run, run_cycle
    from coderl.online.server import BackgroundServer, InteractionServer
    from coderl.online.simulate import SimulatedPopulation

    cfg = load_online_config(
        "configs/online-demo.yaml",
        [f"run_dir={tmp_path}", "online.eval.suite=env", "online.eval.limit=2",
         "online.serve.max_new_tokens=6", "online.min_batch=4", "trainer.steps=1",
         "rollout.max_new_tokens=4", "rollout.max_turns=2", "rollout.max_context_tokens=16384",
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
