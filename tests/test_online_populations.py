"""Per-population adapters: routing by the request's population, per-population registry
pointers that survive a SIGKILL of another population's promotion, the population gate (own
suite and shared suite), and exploration traffic whose logged propensities give the update's
importance weights exactly (worked by hand on tiny-random)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console

from coderl.config import load_online_config
from coderl.config.online import SHARED, ExplorationConfig, GateConfig
from coderl.online.cycle import load_version, open_run, run_cycle, select_tracks
from coderl.online.cycle_report import print_report
from coderl.online.gate import run_population_gate
from coderl.online.heldout import EvalResult
from coderl.online.registry import Registry
from coderl.online.routing import Route, Router, refresh
from coderl.online.server import ChatRequest, InteractionServer
from coderl.online.store import Store
from coderl.online.suites import SuiteTask, keeps_house_style, passes, population_suite
from coderl.online.update import select_trainable, to_segment, update
from coderl.policy import LoraSpec, load_policy
from coderl.train.batch import build_batch

MESSAGES = [{"role": "user", "content": "Complete def add(a, b):"}]
WINDOWS = (
    "{accepted: 1, rejected: 1, edit_persisted: 1, follow_up: 1, tool_error: 1, latency_ms: 1}"
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _lora_policy(seed: int):
    """tiny-random with a LoRA adapter moved away from zero: each seed answers differently."""
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4), seed=0, reference=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g), alpha=0.5)
    return policy


def _sequence_logprobs(policy, prompt: list[int], completion: list[int], t: float) -> list[float]:
    """By hand: log_softmax(logits / t) of each completion token given its prefix."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0].float()  # (L, V)
    logp = torch.log_softmax(logits / t, -1)
    n = len(prompt)
    return [float(logp[n - 1 + i, tok]) for i, tok in enumerate(completion)]


# --- routing ---------------------------------------------------------------------------------


def test_router_unknown_population_gets_shared_and_refresh_moves_one_route(tmp_path):
    reg = Registry(tmp_path / "reg")
    reg.init_champion(reg.new_version(parent=None))
    router = Router(Route("shared-v0", 0))
    loads: list[tuple[str, int]] = []

    def load(pop: str, v: int) -> str:
        loads.append((pop, v))
        return f"{pop}-v{v}"

    assert refresh(router, reg, load) == [] and loads == []  # nothing moved
    v1 = reg.new_version(parent=0, info={"population": "org-a"})
    reg.promote(v1, {"promote": True}, "org-a")
    assert refresh(router, reg, load) == ["org-a"] and loads == [("org-a", v1)]
    assert (
        router.route("org-a").sampler == "org-a-v1" and router.route("org-a").adapter == "org-a@v1"
    )
    for unknown in ("org-b", "nobody", None, ""):
        assert router.route(unknown).adapter == "shared@v0"
    v2 = reg.new_version(parent=0)
    reg.promote(v2, {"promote": True})  # the shared champion moves; org-a keeps its own
    assert refresh(router, reg, load) == [SHARED]
    assert (
        router.route("org-a").adapter == "org-a@v1" and router.route("org-b").adapter == "shared@v2"
    )
    with pytest.raises(ValueError, match="shared route"):
        Router(Route("x", 0, "org-a"))


def test_an_adapter_is_never_served_to_another_population_and_routing_survives_a_promotion(
    tmp_path,
):
    """Three real adapters behind one server; each request's recorded logprobs are those of its
    population's adapter (recomputed by hand) and of no other; after org-a's promotion and a
    reload only org-a's route moved."""
    policies = {0: _lora_policy(1), 1: _lora_policy(2), 2: _lora_policy(3), 3: _lora_policy(4)}
    reg = Registry(tmp_path / "reg")
    reg.init_champion(reg.new_version(parent=None))  # v0 shared
    for pop in ("org-a", "org-b"):
        v = reg.new_version(parent=0, info={"population": pop})
        reg.promote(v, {"promote": True}, pop)  # org-a: v1, org-b: v2
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    router = Router(Route(policies[0], 0))
    srv = InteractionServer(
        policies[0],
        store,
        version=0,
        max_new_tokens=6,
        router=router,
        refresh=lambda r: refresh(r, reg, lambda pop, v: policies[v]),
    )
    assert srv.reload_routes() == ["org-a", "org-b"]

    def ask(population: str | None, seed: int) -> dict:
        body = srv.complete(
            ChatRequest(model="coderl", messages=MESSAGES, population=population, seed=seed)
        )
        [row] = store.interactions(ids=[body["id"]])
        assert body["adapter"] == row["adapter"]
        return row

    def served_by(row: dict) -> int:
        """The version whose weights give the recorded logprobs (and only that one)."""
        fits = [
            v
            for v, p in policies.items()
            if _sequence_logprobs(p, row["prompt_token_ids"], row["completion_token_ids"], 0.8)
            == pytest.approx(row["behaviour_logprobs"], abs=1e-4)
        ]
        assert len(fits) == 1, fits
        return fits[0]

    expected = {"org-a": 1, "org-b": 2, "org-c": 0, None: 0}
    for i, (pop, v) in enumerate(list(expected.items()) * 2):
        row = ask(pop, seed=i)
        assert row["adapter"] == f"{pop if v else SHARED}@v{v}" and row["policy_version"] == v
        assert row["population"] == (pop or "default")
        assert served_by(row) == v
    v3 = reg.new_version(parent=1, info={"population": "org-a"})
    reg.promote(v3, {"promote": True}, "org-a")
    assert srv.reload_routes() == ["org-a"]
    expected["org-a"] = 3
    for i, (pop, v) in enumerate(expected.items()):
        row = ask(pop, seed=100 + i)
        assert row["policy_version"] == v and served_by(row) == v
    # across everything served: no row of one population carries another population's adapter
    for row in store.interactions():
        label = row["adapter"].split("@")[0]
        assert label in (SHARED, row["population"])


def test_build_server_routes_each_population_with_its_own_champion(tmp_path):
    """``coderl serve``'s wiring (torch engine): own champions get their route at start-up."""
    from coderl.cli.serve import build_server

    cfg = load_online_config(
        "configs/online-demo.yaml",
        [f"run_dir={tmp_path}", "model.lora=true", "online.populations=[{name: org-a}]"],
    )
    store, registry = open_run(cfg)
    v1 = registry.new_version(parent=0, info={"population": "org-a"})
    _lora_policy(7).save(registry.version_dir(v1))
    registry.promote(v1, {"promote": True}, "org-a")
    srv = build_server(cfg, store, registry, 0)
    assert {p: r.adapter for p, r in srv.router.routes().items()} == {
        SHARED: "shared@v0",
        "org-a": "org-a@v1",
    }
    assert srv.router.route("org-b").adapter == "shared@v0"


# --- registry and gate per population ----------------------------------------------------------


def test_population_pointers_are_independent_and_lineages_follow_what_was_served(tmp_path):
    reg = Registry(tmp_path / "reg")
    reg.init_champion(reg.new_version(parent=None))  # 0
    v1 = reg.new_version(parent=0)
    reg.promote(v1, {})  # shared 1
    assert reg.served("org-a") == 1 and reg.promoted("org-a") == [0, 1]
    v2 = reg.new_version(parent=1, info={"population": "org-a"})
    reg.promote(v2, {}, "org-a")
    v3 = reg.new_version(parent=1)
    reg.promote(v3, {})  # shared moves on after org-a has its own: not org-a's lineage
    assert reg.promoted("org-a") == [0, 1, 2] and reg.promoted() == [0, 1, 3]
    assert (
        reg.served("org-a") == 2
        and reg.served("org-b") == 3
        and reg.own_champions() == {"org-a": 2}
    )
    reg.reject(reg.new_version(parent=2), {}, "org-a")
    assert reg.champion("org-a") == 2
    with pytest.raises(ValueError, match="population name"):
        reg.champion("../CHAMPION")


_CRASHER = """
import os, signal, sys
from coderl.online.registry import Registry
reg = Registry(sys.argv[1])
point = sys.argv[2]
real_replace, real_fsync = os.replace, os.fsync
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def replace(a, b):
    if str(b).endswith("populations/org-a"):
        if point == "before_swap":
            die()
        real_replace(a, b)
        if point == "after_swap":
            die()
    else:
        real_replace(a, b)
def fsync(fd):
    real_fsync(fd)
    if point == "tmp_written" and "populations/org-a.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
        die()
os.replace, os.fsync = replace, fsync
reg.promote(int(sys.argv[3]), {"promote": True}, "org-a")
"""


@pytest.mark.parametrize(
    "point,expected", [("tmp_written", 1), ("before_swap", 1), ("after_swap", 4)]
)
def test_sigkill_during_one_populations_promotion_leaves_every_other_pointer(
    tmp_path: Path, point: str, expected: int
) -> None:
    reg = Registry(tmp_path / "reg")
    reg.init_champion(reg.new_version(parent=None))  # shared 0
    for pop in ("org-a", "org-b", "org-c"):  # 1, 2, 3
        reg.promote(reg.new_version(parent=0, info={"population": pop}), {}, pop)
    v4 = reg.new_version(parent=1, info={"population": "org-a"})
    before = {p.name: p.read_bytes() for p in (tmp_path / "reg" / "populations").iterdir()}
    shared = (tmp_path / "reg" / "CHAMPION").read_bytes()
    r = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(tmp_path / "reg"), point, str(v4)],
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert r.returncode == -9  # really killed mid-promotion
    reg2 = Registry(tmp_path / "reg")  # reopen: a stale temporary file is removed
    after = {p.name: p.read_bytes() for p in (tmp_path / "reg" / "populations").iterdir()}
    assert sorted(after) == ["org-a", "org-b", "org-c"]
    assert {k: v for k, v in after.items() if k != "org-a"} == {
        k: v for k, v in before.items() if k != "org-a"
    }
    assert (tmp_path / "reg" / "CHAMPION").read_bytes() == shared
    assert reg2.champion("org-a") == expected and reg2.promoted("org-a")[-1] == expected
    assert reg2.own_champions() == {"org-a": expected, "org-b": 2, "org-c": 3}


def test_candidate_better_on_its_population_but_breaking_the_shared_suite_is_rejected():
    cfg = GateConfig(margins={"pass@1": 0.2})
    n = 20
    own = {"pass@1": ([1.0] * n, [0.0] * n)}  # a clear win for its organisation
    broken = {"pass@1": ([0.0] * n, [1.0] * n)}
    kept = {"pass@1": ([1.0] * n, [1.0] * n)}
    rep = run_population_gate(cfg, own, broken, None, [])
    assert not rep.promote
    assert [c.metric for c in rep.comparisons] == ["pass@1", "shared/pass@1"]
    assert rep.comparisons[0].passed and not rep.comparisons[1].passed
    assert rep.reasons[0].startswith("shared suite: held-out pass@1: candidate 0.000")
    assert run_population_gate(cfg, own, kept, None, []).promote
    # the shared margin is its own setting
    strict = cfg.model_copy(update={"shared_margins": {"pass@1": 0.0}})
    assert not run_population_gate(strict, own, kept, None, []).promote


def _cfg(tmp: Path, *extra: str):
    return load_online_config(
        "configs/online-demo.yaml",
        [
            f"run_dir={tmp}",
            "online.serve.max_new_tokens=6",
            f"online.reward.windows_s={WINDOWS}",
            "online.min_batch=4",
            "trainer.steps=1",
            "online.populations=[{name: org-a, min_events: 4}, {name: org-b, min_events: 50}]",
            *extra,
        ],
    )


def _serve_traffic(cfg, counts: dict[str, int], **server_kw) -> InteractionServer:
    store, registry = open_run(cfg)
    policy = load_version(cfg, registry, 0)
    srv = InteractionServer(policy, store, version=0, max_new_tokens=6, **server_kw)
    i = 0
    for pop, n in counts.items():
        for _ in range(n):
            srv.complete(ChatRequest(model="coderl", messages=MESSAGES, population=pop, seed=i))
            i += 1
    return srv


def test_a_populations_cycle_that_breaks_the_shared_suite_leaves_every_pointer(tmp_path):
    """org-a has enough traffic for its own track; its candidate wins its own suite but loses
    the shared one: rejected, org-a still served the shared champion; org-b (below min_events)
    and an unconfigured population train the shared adapter."""
    cfg = _cfg(tmp_path)
    _serve_traffic(cfg, {"org-a": 5, "org-b": 2, "other": 2})
    _, registry = open_run(cfg)

    def scripted(suite_wins_for_candidate: bool):
        def ev(policy) -> EvalResult:
            name = str(policy.policy.name)  # the engine over the version's policy
            is_candidate = not name.endswith("/0") and "versions/" in name
            good = is_candidate == suite_wins_for_candidate
            return EvalResult(
                {"pass@1": [float(good)] * 20}, {"n": 20.0}, [str(i) for i in range(20)]
            )

        return ev

    later = time.time() + 5
    rep = run_cycle(
        cfg,
        evaluator=scripted(False),  # the shared suite: every candidate breaks it
        evaluators={"org-a": scripted(True)},  # org-a's own suite: its candidate wins
        clock=lambda: later,
        log=lambda s: None,
    )
    a = rep["populations"]["org-a"]
    assert a["trainable"] == a["batch"]["size"] == 5 and a["decision"] == "rejected"
    assert any(r.startswith("shared suite:") for r in a["gate"]["reasons"])
    assert a["gate"]["comparisons"][0]["passed"]  # it did win its own suite
    assert registry.own_champions() == {} and registry.served("org-a") == 0
    assert registry.meta(a["candidate"])["population"] == "org-a"
    # the shared track trained on org-b's and the unconfigured population's traffic only
    assert rep["trainable"] == 4 and rep["decision"] == "rejected" and registry.champion() == 0
    assert "org-b" not in rep["populations"]
    out = StringIO()
    print_report(rep, Console(file=out, width=200))
    assert "populations (own adapters)" in out.getvalue() and "shared/pass@1" in out.getvalue()


def test_tracks_split_by_min_events_and_own_champion(tmp_path):
    cfg = _cfg(tmp_path)
    srv = _serve_traffic(cfg, {"org-a": 3, "org-b": 2})
    store, registry = open_run(cfg)
    rows = store.interactions()
    rewards = {r["interaction_id"]: {"status": "scored"} for r in rows}
    tracks = select_tracks(cfg, registry, rows, rewards)
    assert set(tracks) == {SHARED} and len(tracks[SHARED].kept) == 5  # org-a below min_events
    v1 = registry.new_version(parent=0, info={"population": "org-b"})
    registry.promote(v1, {}, "org-b")  # org-b now has its own champion: its own track
    tracks = select_tracks(cfg, registry, rows, rewards)
    assert {k: len(s.kept) for k, s in tracks.items()} == {SHARED: 3, "org-b": 2}
    assert srv.router.route("org-b").version == 0  # this server was never told to reload


# --- house styles ------------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both (online grading is sandboxed)",
)
def test_house_styles_are_static_checks_of_the_replys_code():
    typed = "def add(a: int, b: int) -> int:\n    return a + b\n"
    untyped = "def add(a, b):\n    return a + b\n"
    assert keeps_house_style("type_hints", typed) and not keeps_house_style("type_hints", untyped)
    assert not keeps_house_style("no_print", "def f():\n    print(1)\n")
    assert keeps_house_style("docstrings", 'def f():\n    """doc"""\n')
    assert not keeps_house_style("type_hints", "def (:")  # does not parse: breaks the style
    assert keeps_house_style(None, untyped)
    with pytest.raises(ValueError, match="unknown house style"):
        keeps_house_style("tabs", typed)
    task = SuiteTask(
        "t/add",
        'def add(a, b):\n    """a + b"""\n',
        "def check(f):\n    assert f(2, 3) == 5\n",
        "add",
        "    return a + b\n",
    )
    [styled] = population_suite("heldout", house_style="type_hints", tasks=[task])
    graded = [passes(task, untyped), passes(styled, untyped), passes(styled, typed)]
    assert graded == [True, False, True]  # passing tests alone does not pass the house style
    with pytest.raises(ValueError, match="matches no task"):
        population_suite("heldout", task_filter="^nope", tasks=[task])


# --- exploration -------------------------------------------------------------------------------


def test_exploration_traffic_logs_the_propensities_the_update_uses(tmp_path):
    """A share of requests is sampled at the exploration temperature; the logged logprobs are
    those of that tempered distribution (recomputed by hand), the selection keeps them, and the
    update's importance weights, its ``iw_mean``/``iw_max`` and the Kish ESS equal the ones
    computed by hand from the tiny model's logits."""
    explore = ExplorationConfig(share=0.5, temperature=1.6, seed=3)
    cfg = _cfg(tmp_path, "online.exploration={share: 0.5, temperature: 1.6, seed: 3}")
    srv = _serve_traffic(cfg, {"org-x": 12}, exploration=explore)
    rows = srv.store.interactions()
    flagged = [r for r in rows if r["exploration"]]
    assert 0 < len(flagged) < len(rows)  # a share, not all or nothing
    policy = srv.policy
    for r in rows:
        t = 1.6 if r["exploration"] else 0.8
        assert r["temperature"] == t
        by_hand = _sequence_logprobs(policy, r["prompt_token_ids"], r["completion_token_ids"], t)
        assert r["behaviour_logprobs"] == pytest.approx(by_hand, abs=1e-4)
    rewards = {r["interaction_id"]: {"status": "scored"} for r in rows}
    held = select_trainable(rows, rewards, allowed_versions={0}, temperature=0.8)
    assert held.excluded == {"other_temperature": len(flagged)}  # without the exploration flag
    sel = select_trainable(
        rows, rewards, allowed_versions={0}, temperature=0.8, exploration_temperature=1.6
    )
    assert len(sel.kept) == len(rows) and not sel.excluded
    # by hand: w_t = min(pi_0.8(a_t) / mu(a_t), cap) with mu the logged behaviour logprob
    cap = cfg.algorithm.importance.cap
    weights = []
    for r in sel.kept:
        train = _sequence_logprobs(policy, r["prompt_token_ids"], r["completion_token_ids"], 0.8)
        w = [min(math.exp(a - b), cap) for a, b in zip(train, r["behaviour_logprobs"], strict=True)]
        weights.append(w)
    flat = [x for w in weights for x in w]
    seq = [math.exp(sum(math.log(x) for x in w) / len(w)) for w in weights]
    kish = sum(seq) ** 2 / sum(x * x for x in seq)
    if not any(
        x != 1.0 for w, r in zip(weights, sel.kept, strict=True) if r["exploration"] for x in w
    ):
        pytest.fail("exploration rows should carry importance weights away from 1")
    frozen = load_version(cfg, open_run(cfg)[1], 0)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(sel.kept))])
    trainer = cfg.trainer.model_copy(update={"micro_batch_size": len(sel.kept)})
    m = update(
        policy, frozen, sel.kept, adv, algorithm=cfg.algorithm, trainer=trainer,
        temperature=0.8, max_len=6,
    )  # fmt: skip
    assert m["iw_mean"] == pytest.approx(sum(flat) / len(flat), rel=1e-4)
    assert m["iw_max"] == pytest.approx(max(flat), rel=1e-4)
    assert m["ess_seqs"] == pytest.approx(kish, rel=1e-4)
    assert m["exploration_share"] == pytest.approx(len(flagged) / len(rows))
    # the segments the update builds carry exactly the logged propensities
    batch = build_batch([to_segment(r) for r in sel.kept], adv.tolist(), policy.pad_token_id)
    logged = batch.tokens.behavior_logprobs[batch.loss_mask.bool()].tolist()
    assert logged == pytest.approx([x for r in sel.kept for x in r["behaviour_logprobs"]])


def test_a_request_with_its_own_temperature_is_never_explored(tmp_path):
    cfg = _cfg(tmp_path)
    store, registry = open_run(cfg)
    srv = InteractionServer(
        load_version(cfg, registry, 0), store, version=0, max_new_tokens=4,
        exploration=ExplorationConfig(share=0.99, temperature=1.5),
    )  # fmt: skip
    for i in range(4):
        srv.complete(ChatRequest(model="coderl", messages=MESSAGES, temperature=0.7, seed=i))
    assert {(r["temperature"], r["exploration"]) for r in store.interactions()} == {(0.7, False)}
    with pytest.raises(ValueError, match="equals the serving temperature"):
        InteractionServer(
            srv.policy, store, version=0, exploration=ExplorationConfig(share=0.1, temperature=0.8)
        )


def test_the_cycle_report_states_the_exploration_share_and_the_ess(tmp_path):
    cfg = _cfg(tmp_path, "online.exploration={share: 0.5, temperature: 1.6, seed: 3}")
    srv = _serve_traffic(cfg, {"org-x": 8}, exploration=cfg.online.exploration)
    flagged = sum(r["exploration"] for r in srv.store.interactions())

    def scripted(policy) -> EvalResult:
        return EvalResult({"pass@1": [1.0] * 20}, {"n": 20.0}, [str(i) for i in range(20)])

    later = time.time() + 5
    rep = run_cycle(cfg, evaluator=scripted, clock=lambda: later, log=lambda s: None)
    x = rep["exploration"]
    assert rep["trainable"] == 8 and "other_temperature" not in rep["excluded"]
    assert x["share"] == 0.5 and x["temperature"] == 1.6
    assert x["traffic_share"] == x["batch_share"] == flagged / 8
    assert x["ess_seqs"] == rep["train"]["ess_seqs"] and 0 < x["ess_seqs_frac"] <= 1 + 1e-6
    out = StringIO()
    print_report(rep, Console(file=out, width=200))
    assert f"traffic {flagged / 8:.3f}" in out.getvalue() and "Kish ESS" in out.getvalue()


def test_simulated_clients_keep_their_populations_tasks_and_house_style():
    """A configured population's simulated clients draw tasks of its filter only, and an edit
    whose tests would pass but which breaks the house style is not kept (the outcome events of
    the populations differ in what an own adapter can learn)."""
    from coderl.config.online import PopulationConfig, SimulateConfig
    from coderl.online.simulate import SimulatedPopulation
    from coderl.online.suites import diff_keeps_house_style, humaneval
    from coderl.tasks.patches import make_diff

    tasks = humaneval("train", limit=12)
    keep = tasks[3].task_id
    pops = [PopulationConfig(name="org-0", task_filter=f"^{keep}$", house_style="type_hints")]
    sim = SimulatedPopulation(
        "http://127.0.0.1:9/v1",
        SimulateConfig(clients=2, populations=2),
        tasks=tasks,
        populations=pops,
    )
    draws = [sim._draw() for _ in range(40)]
    assert {p for p, _ in draws} == {"org-0", "org-1"}
    assert {t.task_id for p, t in draws if p == "org-0"} == {keep}
    assert all(t.style == "type_hints" for p, t in draws if p == "org-0")
    assert len({t.task_id for p, t in draws if p == "org-1"}) > 1  # unconfigured: any task
    assert all(t.style is None for p, t in draws if p == "org-1")

    task = tasks[3].task
    [(rel, old)] = task.workspace_files.items()
    typed = "def f(x: int) -> int:\n    return x\n"
    untyped = "def f(x):\n    return x\n"
    assert diff_keeps_house_style(task, make_diff(rel, old, typed), "type_hints")
    assert not diff_keeps_house_style(task, make_diff(rel, old, untyped), "type_hints")
    assert diff_keeps_house_style(task, make_diff(rel, old, untyped), None)
    assert not diff_keeps_house_style(task, "--- a/nope\n+++ b/nope\n@@ garbage", "type_hints")
