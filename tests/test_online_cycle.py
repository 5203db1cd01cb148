"""The online loop end to end on tiny-random: simulated clients -> serve -> events -> rewards ->
near-on-policy update -> held-out gate -> promote or reject."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from coderl.cli import build_parser
from coderl.config import ConfigError, load_online_config
from coderl.endpoint.http import BackgroundServer
from coderl.online.cycle import heldout_evaluator, load_version, open_run, run_cycle
from coderl.online.heldout import EvalResult
from coderl.online.monitors import SUSPECTED_HACK_RATE
from coderl.online.server import InteractionServer
from coderl.online.simulate import SimulatedPopulation
from coderl.online.suites import SuiteTask
from coderl.online.update import effective_sample_size, select_trainable

# real tasks with hidden tests, short enough for a tiny model's context on 2 busy cores
TASKS = [
    SuiteTask(
        "t/add",
        'def add(a, b):\n    """a + b"""\n',
        "def check(f):\n    assert f(2, 3) == 5\n",
        "add",
        "    return a + b\n",
    ),
    SuiteTask(
        "t/neg",
        'def neg(x):\n    """-x"""\n',
        "def check(f):\n    assert f(4) == -4\n",
        "neg",
        "    return -x\n",
    ),
    SuiteTask(
        "t/dbl",
        'def dbl(x):\n    """2 * x"""\n',
        "def check(f):\n    assert f(4) == 8\n",
        "dbl",
        "    return 2 * x\n",
    ),
]
WINDOWS = (
    "{accepted: 1, rejected: 1, edit_persisted: 1, follow_up: 1, tool_error: 1, latency_ms: 1}"
)


def _cfg(run_dir: Path, *extra: str):
    return load_online_config(
        "configs/online-demo.yaml",
        [
            f"run_dir={run_dir}",
            "online.serve.max_new_tokens=6",
            "online.eval.limit=2",
            "online.gate.margins={pass@1: 0.6}",  # 2 tied tasks: the paired bound is -0.57
            f"online.reward.windows_s={WINDOWS}",
            "online.min_batch=4",
            "trainer.steps=1",
            "online.simulate.drop_rate=0.25",
            *extra,
        ],
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # a 1M-parameter model gains nothing from intra-op threads; on busy cores they cost ~5x
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory):
    cfg = _cfg(tmp_path_factory.mktemp("online"))
    store, registry = open_run(cfg)
    server = InteractionServer(load_version(cfg, registry, 0), store, version=0, max_new_tokens=6)
    bg = BackgroundServer(server.app())
    sim = SimulatedPopulation(bg.base_url, cfg.online.simulate, tasks=TASKS)
    stats = sim.run(10)
    bg.stop()
    later = time.time() + 5  # every 1-second join window has closed
    rep = run_cycle(
        cfg,
        clock=lambda: later,
        log=lambda s: None,
    )
    return cfg, stats, rep


def test_cycle_trains_near_on_policy_and_decides_through_the_gate(loop) -> None:
    cfg, stats, rep = loop
    assert stats.requests == 10
    fin = rep["finalize"]
    # every interaction is finalised: scored, or censored when its edit's events were dropped
    assert fin["scored"] + fin["censored"] == 10 and fin["pending"] == 0
    assert rep["trainable"] == fin["scored"] == rep["batch"]["size"]
    assert rep["decision"] in ("promoted", "rejected")
    t = rep["train"]
    # <= 1 up to float32 rounding (all-equal weights give exactly 1 in exact arithmetic)
    assert 0 < t["ess_tokens_frac"] <= 1 + 1e-6 and 0 < t["ess_seqs_frac"] <= 1 + 1e-6
    assert {"iw_max", "train_reward_mean"} <= set(t)
    assert "clip_frac_high" not in t  # one epoch on its own forward: the ratio is exactly 1
    assert "kl" not in t  # trainer.steps=1: the only step's KL is to itself, not a reading
    assert rep["gate"]["comparisons"][0]["n"] == 2  # online.eval.limit
    store, registry = open_run(cfg)
    # the cycle saved the running baselines its advantages moved: one count per trained reward
    seen = sum(store.baseline(f"org-{i}")[1] for i in range(cfg.online.simulate.populations))
    assert seen == rep["batch"]["size"]
    expected = rep["candidate"] if rep["decision"] == "promoted" else 0
    assert registry.champion() == expected == rep["champion_after"]
    assert registry.lineage(rep["candidate"]) == [rep["candidate"], 0]
    assert registry.meta(rep["candidate"])["gate_report"]["promote"] == (expected != 0)
    line = (Path(cfg.run_dir) / "cycles.jsonl").read_text().splitlines()[-1]
    assert json.loads(line)["decision"] == rep["decision"]


def test_claimed_interactions_are_not_trained_twice(loop) -> None:
    cfg, _, _ = loop
    rep = run_cycle(
        cfg,
        clock=lambda: time.time() + 5,
        log=lambda s: None,
    )
    assert rep["decision"] == "waiting" and rep["trainable"] == 0


def test_candidate_worse_on_heldout_is_rejected_and_champion_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    store, registry = open_run(cfg)
    server = InteractionServer(load_version(cfg, registry, 0), store, version=0, max_new_tokens=6)
    bg = BackgroundServer(server.app())
    SimulatedPopulation(
        bg.base_url, cfg.online.simulate.model_copy(update={"drop_rate": 0.0}), tasks=TASKS
    ).run(4)
    bg.stop()

    def scripted_eval(policy) -> EvalResult:  # the champion (v0) solves all; candidates none
        name = str(policy.policy.name)  # the engine over the version's policy
        is_candidate = "versions/" in name and not name.endswith("/0")
        score = 0.0 if is_candidate else 1.0
        behaviour = {"n": 10.0, SUSPECTED_HACK_RATE: 0.5 if is_candidate else 0.0}
        return EvalResult({"pass@1": [score] * 10}, behaviour, [f"t{i}" for i in range(10)])

    def crash(*a, **k):
        raise RuntimeError("trainer died")

    monkeypatch.setattr("coderl.online.cycle.update", crash)
    with pytest.raises(RuntimeError, match="trainer died"):
        run_cycle(cfg, evaluator=scripted_eval, clock=lambda: time.time() + 5, log=lambda s: None)
    # a failed update moves no running baseline (the cycle saves them only after training)
    assert [store.baseline(f"org-{i}") for i in range(2)] == [(0.0, 0), (0.0, 0)]
    monkeypatch.undo()  # the failed cycle released its claim: the same traffic trains now
    rep = run_cycle(cfg, evaluator=scripted_eval, clock=lambda: time.time() + 5, log=lambda s: None)
    assert rep["decision"] == "rejected" and rep["champion_after"] == 0
    assert rep["gate"]["reasons"][0].startswith(
        "held-out pass@1: candidate 0.000 vs champion 1.000"
    )
    # the evaluator's suspected-hack rates reach the gate: 0 -> 0.5 is an alarm of its own
    assert any(
        a.startswith("alarm: suspected_hack_rate rise 0.000 -> 0.500")
        for a in rep["gate"]["alarms"]
    )
    assert open_run(cfg)[1].champion() == 0


def test_selection_counts_every_exclusion_by_reason() -> None:
    def row(i, **kw):
        base = {
            "interaction_id": f"i{i}",
            "policy_version": 1,
            "temperature": 0.8,
            "top_p": 1.0,
            "behaviour_logprobs": [-1.0],
            "completion_token_ids": [5],
        }
        return base | kw

    rows = [
        row(0),
        row(1, policy_version=0),
        row(2, temperature=0.0),
        row(3, temperature=1.0),
        row(4, top_p=0.9),
        row(5, behaviour_logprobs=None),
        row(6),
        row(7),
    ]
    rewards = {f"i{i}": {"status": "scored"} for i in range(7)}
    rewards["i6"] = {"status": "censored"}
    sel = select_trainable(rows, rewards, allowed_versions={1, 2}, temperature=0.8)
    assert [r["interaction_id"] for r in sel.kept] == ["i0"]
    assert sel.excluded == {
        "stale_version": 1,
        "greedy": 1,
        "other_temperature": 1,
        "top_p": 1,
        "missing_logprobs": 1,
        "censored": 1,
        "unscored": 1,
    }


def test_effective_sample_size_hand_worked() -> None:
    # token weights [1, 1, 2] (+ one masked): ESS = (1+1+2)^2 / (1+1+4) = 16/6 = 2.6667 of 3
    w = torch.tensor([[1.0, 1.0, 0.0], [2.0, 5.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    e = effective_sample_size(w, m)
    assert e["ess_tokens"] == pytest.approx(16 / 6) and e["ess_tokens_frac"] == pytest.approx(
        16 / 18
    )
    # sequence weights: geometric means 1 and 2 -> ESS 9/5 = 1.8 of 2
    assert e["ess_seqs"] == pytest.approx(1.8)


def test_group_normalised_advantage_config_is_rejected_with_explanation() -> None:
    with pytest.raises(ConfigError, match="one sample per context"):
        load_online_config("configs/online-demo.yaml", ["online.advantage=grpo"])
    with pytest.raises(ConfigError, match="algorithm.advantage is not used online"):
        load_online_config("configs/online-demo.yaml", ["algorithm.advantage=rloo"])
    with pytest.raises(ConfigError, match="unknown key 'online.nope'"):
        load_online_config("configs/online-demo.yaml", ["online.nope=1"])


def test_demo_preset_and_cli_instantiate() -> None:
    cfg = load_online_config("configs/online-demo.yaml")
    assert cfg.online.simulate.enabled and cfg.online.serve.temperature > 0
    args = build_parser().parse_args(["online", "cycle", "configs/online-demo.yaml", "cycles=1"])
    assert args.overrides == ["cycles=1"]
    args = build_parser().parse_args(["serve", "configs/online-demo.yaml"])
    assert args.func.__module__ == "coderl.cli.serve"


def test_online_suites_are_the_offline_humaneval_split() -> None:
    from coderl.online.suites import humaneval
    from coderl.tasks.humaneval import humaneval_tasks

    traffic = {t.task_id for t in humaneval("train")}
    gated = {
        t.id
        for t in heldout_evaluator(
            load_online_config("configs/online-demo.yaml", ["online.eval.limit=null"])
        ).tasks
    }
    assert not traffic & gated and len(traffic | gated) == 164
    assert gated == {t.id for t in humaneval_tasks("heldout")} and len(gated) == 64
    assert traffic == {t.id for t in humaneval_tasks("train")}
    default_traffic = SimulatedPopulation.__dataclass_fields__["tasks"].default_factory()
    assert {t.task_id for t in default_traffic} == traffic


def test_online_sections_live_in_the_one_config_tree(tmp_path: Path) -> None:
    from coderl.cli.serve import build_server
    from coderl.endpoint.calls import harness_format

    cfg = load_online_config("configs/online-demo.yaml")
    assert harness_format(cfg) == ("xml", False)  # the run's harness format (the demo's)
    server = build_server(cfg, *open_run(cfg.model_copy(update={"run_dir": str(tmp_path)})), 0)
    assert (server.call_format, server.template_tools) == ("xml", False)  # what `serve` runs
    assert harness_format(load_online_config(None)) == ("hermes", True)  # harness defaults
    over = load_online_config("configs/online-demo.yaml", ["online.serve.call_format=hermes"])
    assert harness_format(over)[0] == "hermes"
    with pytest.raises(ConfigError, match=r"online.serve.call_format: unknown tool-call format"):
        load_online_config(None, ["online.serve.call_format=json"])
    with pytest.raises(ConfigError, match=r"^online: min_batch=9 > max_batch=4$"):
        load_online_config(None, ["online.min_batch=9", "online.max_batch=4"])
    with pytest.raises(ConfigError, match=r"online.gate.alpha: must be less than 0.5"):
        load_online_config(None, ["online.gate.alpha=0.7"])


def test_a_port_in_use_is_a_one_line_error_naming_the_key():
    # `coderl online run` on a port another process holds printed an OSError traceback
    import socket

    from fastapi import FastAPI

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(
            ValueError, match=f"online.serve.host/port: cannot listen on 127.0.0.1:{port}"
        ):
            BackgroundServer(FastAPI(), "127.0.0.1", port)


def test_the_report_times_each_phase_and_gives_rewards_and_heldout_with_cis(loop) -> None:
    from coderl.cli.online import cycle_time_summary
    from coderl.online.cycle_report import phase_split, phase_totals

    cfg, stats, rep = loop
    for phase in ("finalize", "train", "gate", "promote"):
        assert rep[f"{phase}_s"] >= 0
    assert rep["eval_s"] <= rep["gate_s"]
    assert sum(rep[f"{p}_s"] for p in ("finalize", "train", "gate", "promote")) <= rep["cycle_s"]
    assert phase_split(rep).startswith("finalize ") and "collect" not in phase_split(rep)
    pops = rep["population_rewards"]
    assert set(pops) <= {"org-0", "org-1"}
    # single-turn traffic: one turn per episode, every trained row counted once
    assert sum(p["turns"] for p in pops.values()) == rep["trainable"]
    assert sum(p["n"] for p in pops.values()) == rep["trainable"]
    for p in pops.values():
        assert p["lo"] <= p["mean"] <= p["hi"]
    [cmp] = rep["gate"]["comparisons"]
    held = rep["heldout"]["pass@1"]
    assert held["candidate"]["mean"] == pytest.approx(cmp["candidate_mean"])
    assert held["champion"]["mean"] == pytest.approx(cmp["champion_mean"])
    assert held["champion"]["n"] == 2  # online.eval.limit
    reports = [{**rep, "collect_s": 4.0, "total_s": rep["cycle_s"] + 4.0}, {**rep, "total_s": 1.0}]
    line = cycle_time_summary(reports)
    assert line.startswith("cycle time: median ") and "over 2 cycles" in line
    assert "collect 2.0" in line  # the median of 4.0 and a cycle that collected nothing
    # a population track's phases count in its cycle's; a cycle whose tracks all waited is
    # left out of the second median
    pop = {"train_s": 30.0, "gate_s": 20.0, "decision": "promoted"}
    waited = {"collect_s": 5.0, "finalize_s": 0.0, "decision": "waiting", "total_s": 5.0}
    with_pop = {**waited, "populations": {"org-0": pop}, "total_s": 55.0}
    assert phase_totals(with_pop) == {"collect": 5.0, "finalize": 0.0, "train": 30.0, "gate": 20.0}
    line = cycle_time_summary([waited, with_pop, {**with_pop, "total_s": 65.0}])
    assert line.startswith("cycle time: median 55.0 s (collect 5.0 / finalize 0.0 / train 30.0")
    assert "over 3 cycles; median 60.0 s" in line and "over the 2 that trained" in line


def test_the_smollm2_preset_serves_agent_traffic_through_vllm() -> None:
    from coderl.cli.online import agent_episode_config

    cfg = load_online_config("configs/online-smollm2.yaml")
    assert cfg.model.name == "smollm2-135m" and cfg.model.lora and cfg.engine.kind == "vllm"
    sim = cfg.online.simulate
    assert sim.enabled and sim.agent and sim.populations >= 2 and cfg.online.cycles >= 3
    ec = agent_episode_config(cfg)
    assert (ec.call_format, ec.template_tools) == ("xml", False)  # the served format
    assert ec.context_budget == sim.episode["context_budget"] < cfg.engine.max_model_len
    over = load_online_config("configs/online-smollm2.yaml", ["online.serve.call_format=hermes"])
    assert agent_episode_config(over).call_format == "hermes"  # the client follows the server


def test_an_sft_warm_start_is_version_zero_and_a_killed_one_is_redone(tmp_path: Path) -> None:
    from coderl.online.cycle import WARM_START_DONE

    over = ["model.lora=true", "sft.enabled=true", "sft.limit=2", "sft.batch_size=2"]
    cfg = _cfg(tmp_path, *over)
    _, registry = open_run(cfg)
    assert registry.champion() == 0 and registry.versions() == [0]
    meta = registry.meta(0)
    assert not meta["base_only"] and meta["warm_start"]["sft"]["limit"] == 2
    d = registry.version_dir(0)
    assert (d / WARM_START_DONE).exists() and (d / "adapter_config.json").exists()
    warm = load_version(cfg, registry, 0)
    lora_b = [p for n, p in warm.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(
        bool(p.detach().abs().sum() > 0) for p in lora_b
    )  # B starts at 0: SFT moved it

    # killed after version 0 was allocated, before its checkpoint: the next run trains it again
    killed = tmp_path / "killed"
    kcfg = _cfg(killed, *over)
    from coderl.online.registry import Registry

    reg = Registry(killed / "registry")
    reg.new_version(parent=None, info={"base": "tiny-random", "base_only": False, "warm_start": {}})
    reg.update_meta(0, warm_start={"sft": {}})
    _, reg = open_run(kcfg)
    assert reg.champion() == 0 and (reg.version_dir(0) / WARM_START_DONE).exists()
    sd = load_version(kcfg, reg, 0).model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in warm.model.state_dict().items())  # same seed


def test_without_sft_version_zero_is_the_base_model(tmp_path: Path) -> None:
    _, registry = open_run(_cfg(tmp_path))
    assert registry.meta(0)["base_only"] and "warm_start" not in registry.meta(0)
