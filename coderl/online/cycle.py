"""``coderl online cycle`` / ``run``: claim -> train -> evaluate -> promote or reject.

One cycle, top to bottom (:func:`run_cycle`):

1. finalize rewards under the config's spec version (windows closed; censored excluded);
2. select trainable interactions (last K promoted versions, exact logprobs...) and claim them as
   one batch (one spec version); too few -> the cycle waits and claims nothing;
3. single-sample advantages, then the near-on-policy update of a copy of the champion with KL to
   the champion (:mod:`coderl.online.update`); the candidate is saved as a new registry version;
4. held-out evaluation of candidate and champion (paired) and behaviour checks, plus the live
   monitors' alarms and, when ``reward.terms`` names a learned grader, the gameability probes on
   the candidate's held-out replies (:func:`probe_learned`) -> the gate
   (:mod:`coderl.online.gate`);
5. promote (atomic champion pointer swap) or reject with the reasons; the report (timings,
   exclusions by reason, ESS, KL, monitors, gate) is appended to ``run_dir/cycles.jsonl``.

The report times each phase in seconds: ``finalize_s`` (rewards, selection, claim), ``train_s``,
``gate_s`` (held-out evaluation of both policies, alarms, probes, the gate; ``eval_s`` is its
evaluation part) and ``promote_s``; a driver that collects traffic first adds ``collect_s``
(:func:`run_cycle`'s ``extra``). It also gives the trainable reward per population, one value
per episode (its turns share it), and the held-out metrics of both policies, each as a mean
with its percentile-bootstrap 95% CI (:func:`coderl.stats.estimate`; the unit is the episode,
or the task).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from coderl.config import Config
from coderl.graders.probes import probe_gate, run_probes
from coderl.graders.terms import configured_learned, learned_grader
from coderl.online.baselines import advantages
from coderl.online.calls import harness_format
from coderl.online.gate import run_gate
from coderl.online.monitors import SUSPECTED_HACK_RATE, check_alarms, monitor_snapshot
from coderl.online.registry import Registry
from coderl.online.rewards import finalize
from coderl.online.simulate import Evaluator, HeldoutEvaluator
from coderl.online.store import Store
from coderl.online.update import select_trainable, update
from coderl.policy import LoraSpec, load_policy
from coderl.rewards.hacks import reply_detector
from coderl.stats import estimate

PHASES = ("collect", "finalize", "train", "gate", "promote")
"""The phases of a cycle, as ``{phase}_s`` fields of its report."""


def database_url(cfg: Config) -> str:
    """``online.database``, else SQLite at ``run_dir/online.db``."""
    return cfg.online.database or f"sqlite:///{Path(cfg.run_dir) / 'online.db'}"


def load_version(cfg: Config, registry: Registry, version: int) -> Any:
    """The policy of a registry version (version 0 is the base model)."""
    m = cfg.model
    lora = LoraSpec(rank=m.lora_r, alpha=m.lora_alpha, dropout=m.lora_dropout) if m.lora else None
    if registry.meta(version).get("base_only"):
        return load_policy(m.name, lora=lora, seed=m.seed, reference=False)
    d = registry.version_dir(version)
    if m.lora:
        return load_policy(m.name, adapter=d, seed=m.seed, reference=False)
    return load_policy(d, reference=False)


def open_run(cfg: Config) -> tuple[Store, Registry]:
    """Open (or create) the store and registry; the base model becomes champion version 0."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    store, registry = Store(database_url(cfg)), Registry(Path(cfg.run_dir) / "registry")
    if registry.champion() is None:
        v0 = (
            registry.versions()[0]
            if registry.versions()
            else registry.new_version(parent=None, info={"base": cfg.model.name, "base_only": True})
        )
        registry.init_champion(v0)
    champ = registry.champion()
    assert champ is not None
    known = {v["version"]: v for v in store.policy_versions()}
    if known.get(champ, {}).get("status") != "champion":  # mirror the pointer in the database
        for v, row in known.items():
            if row["status"] == "champion" and v != champ:
                store.set_version_status(v, "retired", now=time.time())
        store.add_policy_version(
            champ,
            str(registry.version_dir(champ)),
            parent=registry.meta(champ).get("parent"),
            status="champion",
            now=time.time(),
        )
    return store, registry


def heldout_evaluator(cfg: Config) -> HeldoutEvaluator:
    """The held-out evaluator of ``online.eval``, in the served call format, with the hack
    detectors of :mod:`coderl.rewards.hacks` on every reply (:func:`reply_detector`), so the
    gate compares the champion's and the candidate's ``suspected_hack_rate``."""
    call_format, template_tools = harness_format(cfg)
    ev = HeldoutEvaluator(
        cfg.online.eval,
        sandbox=cfg.online.sandbox,
        call_format=call_format,
        template_tools=template_tools,
    )
    ev.hack_detector = reply_detector({t.task_id: t.task for t in ev.tasks})
    return ev


def probe_learned(
    cfg: Config, views: list[Any], graders: dict[str, Any] | None = None
) -> tuple[dict[str, tuple[bool, str]], dict[str, Any]]:
    """The gameability probes of every learned term in ``cfg.reward.terms`` on the first
    ``graders.probe_episodes`` held-out views with a diff: ``({term: probe_gate(results)},
    {term: [ProbeResult as dict]})``, both empty without a learned term or without a view that
    has a diff (nothing to probe: the check is then not run). Run every cycle
    (``graders.probe_every`` schedules training only).

    Args:
        graders: term -> grader (``score(views)``); default: the process's grader of the term
            (:func:`coderl.graders.terms.learned_grader`).
    """
    g = cfg.graders
    chosen = [v for v in views if v.diff.strip()][: g.probe_episodes]
    checks: dict[str, tuple[bool, str]] = {}
    results: dict[str, Any] = {}
    for name in configured_learned(cfg.reward) if chosen else []:
        grader = (graders or {}).get(name) or learned_grader(name, cfg.reward)
        res = run_probes(grader, chosen, g.probes, max_shift=g.max_shift)
        checks[name], results[name] = probe_gate(res), [asdict(r) for r in res]
    return checks, results


def production_alarms(
    cfg: Config, store: Store, registry: Registry, now: float
) -> tuple[list[Any], dict[str, Any]]:
    """Alarms comparing the champion's live traffic with its predecessor's, and the snapshot."""
    kl = {v: registry.meta(v).get("train", {}).get("kl", float("nan")) for v in registry.versions()}
    snap = monitor_snapshot(
        store,
        cfg.online.reward.version,
        window_s=cfg.online.monitors.window_s,
        now=now,
        orphan_window_s=cfg.online.reward.orphan_window_s,
        kl_by_version=kl,
    )
    promoted = registry.promoted()
    alarms: list[Any] = []
    if len(promoted) >= 2:
        ref, cur = snap["by_version"].get(promoted[-2]), snap["by_version"].get(promoted[-1])
        if ref and cur:
            alarms = check_alarms(
                ref, cur, cfg.online.monitors.rules, min_samples=cfg.online.monitors.min_samples
            )
    return alarms, snap


def _train(
    cfg: Config,
    store: Store,
    registry: Registry,
    rows: list[dict[str, Any]],
    rewards: dict[str, dict[str, Any]],
    champion: int,
) -> tuple[int, dict[str, float]]:
    r = torch.tensor([rewards[x["interaction_id"]]["reward"] for x in rows])
    segments = [x["population"] for x in rows]
    state = {s: store.baseline(s) for s in set(segments)}
    adv, new_state = advantages(
        cfg.online.advantage, r, segments, state, alpha=cfg.online.baseline_alpha
    )
    policy = load_version(cfg, registry, champion)
    frozen = load_version(cfg, registry, champion)
    metrics = update(
        policy,
        frozen,
        rows,
        adv,
        algorithm=cfg.algorithm,
        trainer=cfg.trainer,
        temperature=cfg.online.serve.temperature,
        max_len=cfg.online.serve.max_new_tokens,
    )
    metrics["train_reward_mean"] = float(r.mean())
    metrics["advantage_abs_mean"] = float(adv.abs().mean())
    version = registry.new_version(parent=champion, info={"base": cfg.model.name, "train": metrics})
    policy.save(registry.version_dir(version))
    for s, (value, count) in new_state.items():  # only a finished update moves the baselines
        store.set_baseline(s, value, count)
    return version, metrics


def _ci(values: list[float]) -> dict[str, float]:
    e = estimate(values)
    return {"n": len(values), "mean": e.mean, "lo": e.lo, "hi": e.hi}


def population_rewards(
    rows: list[dict[str, Any]], rewards: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Per population: ``{"n": episodes, "turns", "mean", "lo", "hi"}`` of the reward, one value
    per episode (every turn of an episode carries the episode's reward)."""
    per_episode: dict[str, dict[str, float]] = {}
    turns: dict[str, int] = {}
    for r in rows:
        pop = r["population"]
        per_episode.setdefault(pop, {})[r["episode_id"]] = rewards[r["interaction_id"]]["reward"]
        turns[pop] = turns.get(pop, 0) + 1
    return {p: {**_ci(list(v.values())), "turns": turns[p]} for p, v in sorted(per_episode.items())}


def run_cycle(
    cfg: Config,
    *,
    evaluator: Evaluator | None = None,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = print,
    graders: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One claim -> train -> evaluate -> promote/reject cycle (see the module docstring);
    ``graders`` overrides the learned graders the probes test (see :func:`probe_learned`);
    ``extra`` is merged into the report (what the driver measured, e.g. ``collect_s``).

    Returns:
        the cycle report (also appended to ``run_dir/cycles.jsonl``); ``decision`` is
        ``promoted``, ``rejected`` or ``waiting`` (not enough trainable data).
    """
    t0 = time.perf_counter()
    store, registry = open_run(cfg)
    now = clock()
    champion = registry.champion()
    assert champion is not None
    rep: dict[str, Any] = {
        "started_at": now,
        "champion_before": champion,
        "spec_version": cfg.online.reward.version,
        **(extra or {}),
    }
    rep["finalize"] = asdict(finalize(store, cfg.online.reward, now=now))
    ids = store.unclaimed_scored(cfg.online.reward.version)
    rows = store.interactions(ids=ids) if ids else []
    rewards = store.rewards(cfg.online.reward.version, ids=ids)
    allowed = set(registry.promoted()[-cfg.online.last_k_versions :])
    sel = select_trainable(
        rows, rewards, allowed_versions=allowed, temperature=cfg.online.serve.temperature
    )
    rep["excluded"] = dict(sel.excluded) | {"censored": rep["finalize"]["censored"]}
    rep["trainable"] = len(sel.kept)
    rep["populations"] = population_rewards(sel.kept, rewards)
    if len(sel.kept) < cfg.online.min_batch:
        rep["finalize_s"] = time.perf_counter() - t0
        rep["decision"] = "waiting"
        log(f"waiting: {len(sel.kept)} trainable interactions < min_batch {cfg.online.min_batch}")
        return _finish(cfg, store, rep, t0)
    kept = sel.kept[: cfg.online.max_batch]
    batch_id, claimed = store.claim_batch(
        cfg.online.reward.version,
        [r["interaction_id"] for r in kept],
        claimed_by=f"cycle@{now:.0f}",
        now=now,
    )
    kept = [r for r in kept if r["interaction_id"] in set(claimed)]
    rep["batch"] = {"batch_id": batch_id, "size": len(kept)}
    rep["finalize_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    try:
        candidate, metrics = _train(cfg, store, registry, kept, rewards, champion)
    except BaseException:
        store.release_batch(batch_id)  # a failed update loses no data: the batch is unclaimed
        raise
    rep["train"], rep["train_s"], rep["candidate"] = metrics, time.perf_counter() - t, candidate
    store.add_policy_version(
        candidate,
        str(registry.version_dir(candidate)),
        parent=champion,
        status="candidate",
        now=now,
    )
    t_gate = t = time.perf_counter()
    ev = evaluator or heldout_evaluator(cfg)
    cand_eval = ev(load_version(cfg, registry, candidate))
    champ_eval = ev(load_version(cfg, registry, champion))
    rep["eval_s"] = time.perf_counter() - t
    alarms, snap = production_alarms(cfg, store, registry, now)
    heldout = {k: (cand_eval.scores[k], champ_eval.scores[k]) for k in cand_eval.scores}
    behaviour = (champ_eval.behaviour, cand_eval.behaviour)
    hacks = tuple(b.get(SUSPECTED_HACK_RATE) for b in behaviour)
    hack_rates = None if None in hacks else (float(hacks[0]), float(hacks[1]))  # type: ignore[arg-type]
    probes, rep["probes"] = probe_learned(cfg, cand_eval.views, graders)
    gate = run_gate(cfg.online.gate, heldout, behaviour, alarms, hack_rates, probes or None)
    rep["gate"], rep["monitors"] = gate.to_dict(), snap
    rep["heldout"] = {
        k: {"candidate": _ci(cand), "champion": _ci(champ)} for k, (cand, champ) in heldout.items()
    }
    rep["gate_s"] = time.perf_counter() - t_gate
    t = time.perf_counter()
    if gate.promote:
        registry.promote(candidate, gate.to_dict())
        store.set_version_status(champion, "retired", now=now)
        store.set_version_status(candidate, "champion", now=now)
        rep["decision"] = "promoted"
    else:
        registry.reject(candidate, gate.to_dict())
        store.set_version_status(candidate, "rejected", now=now)
        rep["decision"] = "rejected"
    rep["champion_after"] = registry.champion()
    rep["promote_s"] = time.perf_counter() - t
    return _finish(cfg, store, rep, t0)


def _finish(cfg: Config, store: Store, rep: dict[str, Any], t0: float) -> dict[str, Any]:
    rep["cycle_s"] = time.perf_counter() - t0
    rep["rejected_events"] = store.rejected_counts()
    rep["duplicate_events"] = store.counter("duplicate_events")
    with open(Path(cfg.run_dir) / "cycles.jsonl", "a") as f:
        f.write(json.dumps(rep, default=str) + "\n")
    store.close()
    return rep


def _fmt_ci(e: dict[str, float]) -> str:
    return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def phase_split(rep: dict[str, Any]) -> str:
    """``collect 12.3 / finalize 0.1 / ...``: the phases a report timed, in seconds."""
    return " / ".join(f"{p} {rep[f'{p}_s']:.1f}" for p in PHASES if f"{p}_s" in rep)


def print_report(rep: dict[str, Any], console: Console | None = None) -> None:
    """A cycle report as rich tables: decision, timings, exclusions, gate, monitors."""
    console = console or Console()
    t = Table(title=f"online cycle: {rep['decision']}", show_header=False)
    for k in ("champion_before", "candidate", "champion_after", "trainable", "cycle_s"):
        if k in rep:
            v = rep[k]
            t.add_row(k, f"{v:.2f}" if isinstance(v, float) else str(v))
    t.add_row("phases (s)", phase_split(rep))
    t.add_row("excluded", json.dumps(rep.get("excluded", {})))
    t.add_row("finalize", json.dumps({k: v for k, v in rep["finalize"].items() if v}))
    t.add_row(
        "rejected / duplicate events",
        f"{json.dumps(rep['rejected_events'])} / {rep['duplicate_events']}",
    )
    for k in (
        "train_reward_mean",
        "kl",
        "ess_tokens_frac",
        "ess_seqs_frac",
        "clip_frac_high",
        "iw_max",
    ):
        if k in rep.get("train", {}):
            t.add_row(f"train {k}", f"{rep['train'][k]:.4f}")
    for c in rep.get("gate", {}).get("comparisons", []):
        t.add_row(
            f"held-out {c['metric']}",
            f"cand {c['candidate_mean']:.3f} vs champ "
            f"{c['champion_mean']:.3f} (lower {c['lower_bound']:.3f}, margin {c['margin']})",
        )
    for metric, pols in rep.get("heldout", {}).items():
        t.add_row(
            f"held-out {metric} (95% CI)",
            ", ".join(f"{p} {_fmt_ci(e)}" for p, e in pols.items())
            + f" over {pols['champion']['n']} tasks",
        )
    for pop, e in rep.get("populations", {}).items():
        t.add_row(
            f"reward {pop} (95% CI)", f"{_fmt_ci(e)} over {e['n']} episodes, {e['turns']} turns"
        )
    for r in rep.get("gate", {}).get("reasons", []):
        t.add_row("reason", r)
    console.print(t)
    mon = rep.get("monitors", {}).get("by_version", {})
    if mon:
        cols = [(v, p, m) for v, pops in mon.items() for p, m in pops.items()]
        mt = Table(title="monitors per version/population (trailing window)")
        mt.add_column("metric")
        for v, p, _ in cols:
            mt.add_column(f"v{v}/{p}")
        names = sorted({k for _, _, m in cols for k in m}, key=lambda k: (k.startswith("r"), k))
        for k in names:
            mt.add_row(k, *[f"{m.get(k, float('nan')):.3g}" for _, _, m in cols])
        console.print(mt)
        console.print(f"orphaned share of events: {rep['monitors']['orphaned_share']:.3f}")
