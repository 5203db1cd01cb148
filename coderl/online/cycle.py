"""``coderl online cycle`` / ``run``: claim -> train -> evaluate -> promote or reject.

One cycle, top to bottom (:func:`run_cycle`):

1. finalize rewards under the config's spec version (windows closed; censored excluded);
2. select trainable interactions (last K promoted versions, exact logprobs...) and claim them as
   one batch (one spec version); too few -> the cycle waits and claims nothing;
3. single-sample advantages, then the near-on-policy update of a copy of the champion with KL to
   the champion (:mod:`coderl.online.update`); the candidate is saved as a new registry version;
4. held-out evaluation of candidate and champion (paired; also the best earlier champion of the
   track when it is not the current one, :func:`best_earlier`) and behaviour checks, plus the live
   monitors' alarms and, when ``reward.terms`` names a learned grader, the gameability probes on
   the candidate's held-out replies (:func:`probe_learned`) -> the gate
   (:mod:`coderl.online.gate`);
5. promote (atomic champion pointer swap) or reject with the reasons; the report (timings,
   exclusions by reason, ESS, exploration share, KL, monitors, gate) is appended to
   ``run_dir/cycles.jsonl``.

Populations (``online.populations``): steps 2-5 run once per training track
(:func:`select_tracks`). A configured population with an own champion, or with at least
``min_events`` trainable interactions, is its own track: its traffic alone trains a candidate
from the version it is served (its champion, else the shared one), which must pass the gate on
its own held-out suite against that version and stay non-inferior on the shared suite against
the shared champion (:func:`coderl.online.gate.run_population_gate`), judged by the live
monitors of its own traffic, and is promoted to its own pointer. Everything else (populations
below ``min_events``, unconfigured ones) trains the shared adapter as without populations. The
top-level report is the shared track's; ``populations`` holds each population's.

The report times each phase in seconds: ``finalize_s`` (rewards, selection, claim), ``train_s``,
``gate_s`` (held-out evaluation of both policies, alarms, probes, the gate; ``eval_s`` is its
evaluation part) and ``promote_s``; a driver that collects traffic first adds ``collect_s``
(:func:`run_cycle`'s ``extra``). It also gives the trainable reward per population
(``population_rewards``), one value per episode (its turns share it), and the held-out metrics of both policies, each as a mean
with its percentile-bootstrap 95% CI (:func:`coderl.stats.estimate`; the unit is the episode,
or the task).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from coderl.config import Config, anchored, dump_config
from coderl.config.online import SHARED, PopulationConfig
from coderl.graders.probes import probe_gate, run_probes
from coderl.metrics import reported
from coderl.online.baselines import advantages
from coderl.online.gate import run_gate, run_population_gate
from coderl.online.heldout import EnvEvaluator, EvalResult, Evaluator
from coderl.online.monitors import SUSPECTED_HACK_RATE, check_alarms, monitor_snapshot
from coderl.online.registry import Registry
from coderl.online.rewards import finalize
from coderl.online.runfiles import RUN_CONFIG, SAVE_DONE
from coderl.online.store import Store
from coderl.online.update import Selection, select_trainable, update
from coderl.policy import LoraSpec, load_policy
from coderl.policy.rollout import build_engine
from coderl.rewards.learned import configured_learned, learned_grader
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


def load_version_into(
    model: torch.nn.Module, cfg: Config, registry: Registry, version: int
) -> None:
    """Copy registry ``version``'s weights, as :func:`load_version` loads them for serving, into
    the trainable parameters of ``model`` (a policy built from ``cfg``:
    :func:`coderl.train.run.build_policy`); ``coderl eval`` and ``coderl export`` of an online
    run. The version's policy is loaded beside ``model`` for the copy (twice the weights'
    memory for a moment).

    Raises:
        ValueError: the version's trainable weights do not match ``model``'s (another LoRA
            shape than ``cfg.model`` says: :func:`coderl.train.checkpoint.check_trainable`).
    """
    from coderl.train.checkpoint import load_trainable, trainable_state

    load_trainable(model, trainable_state(load_version(cfg, registry, version).model))


WARM_START_DONE = SAVE_DONE
"""The file :meth:`coderl.policy.LocalPolicy.save` writes last: a version directory holding it
holds a complete checkpoint."""


def first_version(cfg: Config, registry: Registry) -> int:
    """Version 0: the base model, or with ``sft.enabled`` the SFT warm start of
    :func:`coderl.train.sft.run_sft` (oracle episodes of ``tasks``' training split in the
    run's harness), saved as a LoRA adapter (or full weights) in its version directory.

    A run killed during the warm start left a version 0 without its checkpoint
    (:data:`WARM_START_DONE` missing): the next call trains it again, from the same seeds.
    """
    if not registry.versions():
        info: dict[str, Any] = {"base": cfg.model.name, "base_only": not cfg.sft.enabled}
        if cfg.sft.enabled:
            info["warm_start"] = {"sft": cfg.sft.model_dump(), "tasks": cfg.tasks.source}
        registry.new_version(parent=None, info=info)
    v0 = registry.versions()[0]
    d = registry.version_dir(v0)
    if registry.meta(v0).get("warm_start") and not (d / WARM_START_DONE).exists():
        from coderl.train.run import build_policy
        from coderl.train.sft import run_sft

        print(
            "version 0: training the SFT warm start first (sft.enabled; the endpoint opens "
            "after it)",
            file=sys.stderr,
            flush=True,
        )
        policy = build_policy(cfg)  # seeded LoRA initialisation, as `coderl sft` builds it
        t0 = time.perf_counter()
        run_sft(cfg, policy)
        policy.save(d)
        registry.update_meta(v0, warm_start_s=time.perf_counter() - t0)
    return v0


def open_run(cfg: Config) -> tuple[Store, Registry]:
    """Open (or create) the store and registry; version 0 (:func:`first_version`: the base
    model or its SFT warm start) becomes the first champion. The first call records the config
    in ``registry/config.yaml`` (:mod:`coderl.online.runfiles`: what ``coderl export`` and
    ``coderl eval`` load a version with)."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    store, registry = Store(database_url(cfg)), Registry(Path(cfg.run_dir) / "registry")
    if not (registry.root / RUN_CONFIG).is_file():  # what coderl export / eval load versions by
        (registry.root / RUN_CONFIG).write_text(dump_config(anchored(cfg)))
    if registry.champion() is None:
        v0 = first_version(cfg, registry)
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


def heldout_evaluator(cfg: Config, population: PopulationConfig | None = None) -> EnvEvaluator:
    """The held-out suite of ``population`` (None: the shared one): the run's environment
    evaluated by ``coderl eval``'s code (:class:`coderl.online.heldout.EnvEvaluator`)."""
    return EnvEvaluator(cfg, population)


def evaluate_version(cfg: Config, registry: Registry, version: int, ev: Evaluator) -> EvalResult:
    """``ev`` of a registry version sampled through ``engine.kind``'s engine (a vLLM server is
    started for it and stopped after, as ``coderl eval`` does)."""
    engine = build_engine(cfg, load_version(cfg, registry, version), training=False)
    try:
        return ev(engine)
    finally:
        engine.close()


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
            (:func:`coderl.rewards.learned.learned_grader`).
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
    cfg: Config, store: Store, registry: Registry, now: float, population: str = SHARED
) -> tuple[list[Any], dict[str, Any]]:
    """Alarms comparing the champion's live traffic with its predecessor's, and the snapshot;
    for a ``population``, on that population's traffic alone, between the last two versions it
    was served."""
    trained = {v: registry.meta(v).get("train", {}) for v in registry.versions()}
    kl = {v: t["kl"] for v, t in trained.items() if "kl" in t}  # absent where not measured
    snap = monitor_snapshot(
        store,
        cfg.online.reward.version,
        window_s=cfg.online.monitors.window_s,
        now=now,
        orphan_window_s=cfg.online.reward.orphan_window_s,
        kl_by_version=kl,
    )
    promoted = registry.promoted(population)
    alarms: list[Any] = []
    if len(promoted) >= 2:
        ref, cur = snap["by_version"].get(promoted[-2]), snap["by_version"].get(promoted[-1])
        if population != SHARED:
            ref = {population: ref[population]} if ref and population in ref else None
            cur = {population: cur[population]} if cur and population in cur else None
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
    population: str = SHARED,
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
        progress=cfg.progress,
    )
    metrics["train_reward_mean"] = float(r.mean())
    metrics["advantage_abs_mean"] = float(adv.abs().mean())
    info = {"base": cfg.model.name, "train": metrics, "population": population}
    version = registry.new_version(parent=champion, info=info)
    policy.save(registry.version_dir(version))
    for s, (value, count) in new_state.items():  # only a finished update moves the baselines
        store.set_baseline(s, value, count)
    return version, metrics


def select_tracks(
    cfg: Config,
    registry: Registry,
    rows: list[dict[str, Any]],
    rewards: dict[str, dict[str, Any]],
) -> dict[str, Selection]:
    """Training track -> its selection (see the module docstring): each configured population
    with an own champion or at least ``min_events`` trainable rows, and :data:`SHARED` for the
    rest; each track is held to the last ``last_k_versions`` versions its traffic was served
    (:meth:`coderl.online.registry.Registry.promoted`)."""
    o = cfg.online
    explore_t = o.exploration.temperature if o.exploration.share > 0 else None

    def select(track: str, part: list[dict[str, Any]]) -> Selection:
        allowed = set(registry.promoted(track)[-o.last_k_versions :])
        return select_trainable(
            part,
            rewards,
            allowed_versions=allowed,
            temperature=o.serve.temperature,
            exploration_temperature=explore_t,
        )

    configured = {p.name: p for p in o.populations}
    own = registry.own_champions()
    tracks: dict[str, Selection] = {}
    shared_rows = [r for r in rows if r["population"] not in configured]
    for name, pop in configured.items():
        part = [r for r in rows if r["population"] == name]
        sel = select(name, part)
        if name in own or len(sel.kept) >= pop.min_events:
            tracks[name] = sel
        else:
            shared_rows += part
    shared_ids = {r["interaction_id"] for r in shared_rows}
    return {SHARED: select(SHARED, [r for r in rows if r["interaction_id"] in shared_ids])} | tracks


class _Suites:
    """Held-out results per (suite, version), each evaluated at most once per cycle."""

    def __init__(self, cfg: Config, registry: Registry, given: dict[str, Evaluator | None]) -> None:
        self.cfg, self.registry, self.given = cfg, registry, given
        self._cache: dict[tuple[str, int], EvalResult] = {}
        self.seconds = 0.0

    def __call__(self, suite: str, version: int) -> EvalResult:
        if (suite, version) not in self._cache:
            t = time.perf_counter()
            ev = self.given.get(suite)
            if ev is None:
                pop = next((p for p in self.cfg.online.populations if p.name == suite), None)
                ev = self.given[suite] = heldout_evaluator(self.cfg, pop)
            self._cache[suite, version] = evaluate_version(self.cfg, self.registry, version, ev)
            self.seconds += time.perf_counter() - t
        return self._cache[suite, version]


def best_earlier(registry: Registry, track: str, parent: int, metrics: list[str]) -> int | None:
    """The earlier champion of ``track`` (served to it before ``parent``) with the highest sum of
    held-out means over the gated ``metrics`` recorded on the track's suite, when it beats
    ``parent``'s; a version never measured on that suite is taken first (it cannot be ruled
    out). None: ``parent`` is the best (or the only) champion."""
    pop = None if track == SHARED else track

    def recorded(v: int) -> float:
        means = registry.meta(v).get("heldout_mean", {}).get(track, {})
        if not all(m in means for m in metrics):
            return math.inf
        return sum(means[m] for m in metrics)

    earlier = [v for v in registry.promoted(pop) if v != parent]
    if not earlier:
        return None
    best = max(earlier, key=recorded)
    return best if recorded(best) > recorded(parent) or recorded(best) == math.inf else None


def record_means(registry: Registry, track: str, results: dict[int, EvalResult]) -> None:
    """Keep each evaluated version's held-out means on ``track``'s suite in its metadata (what
    :func:`best_earlier` ranks champions by)."""
    for v, res in results.items():
        means = {k: sum(x) / len(x) for k, x in res.scores.items() if x}
        known = registry.meta(v).get("heldout_mean", {})
        registry.update_meta(v, heldout_mean=known | {track: means})


def _heldout(cand: EvalResult, champ: EvalResult) -> dict[str, tuple[list[float], list[float]]]:
    return {k: (cand.scores[k], champ.scores[k]) for k in cand.scores}


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
    evaluators: dict[str, Evaluator] | None = None,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = print,
    graders: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One claim -> train -> evaluate -> promote/reject cycle per training track (see the
    module docstring); ``graders`` overrides the learned graders the probes test (see
    :func:`probe_learned`); ``extra`` is merged into the report (what the driver
    measured, e.g. ``collect_s``).

    Args:
        evaluator: the shared held-out suite (default: :func:`heldout_evaluator`).
        evaluators: population -> its held-out suite (default: its :func:`heldout_evaluator`).

    Returns:
        the cycle report (also appended to ``run_dir/cycles.jsonl``): the shared track's, with
        ``decision`` ``promoted``, ``rejected`` or ``waiting`` (not enough trainable data), the
        ``exploration`` share of the traffic considered, and, with populations configured,
        ``populations``: population -> its track's report.
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
    x = cfg.online.exploration
    rep["exploration"] = {
        "share": x.share,
        "temperature": x.temperature,
        # None: no interaction to count over (the report says "no traffic", never 0.000)
        "traffic_share": sum(bool(r["exploration"]) for r in rows) / len(rows) if rows else None,
    }
    suites = _Suites(cfg, registry, {SHARED: evaluator, **(evaluators or {})})
    tracks = select_tracks(cfg, registry, rows, rewards)
    kept = [r for sel in tracks.values() for r in sel.kept]
    rep["population_rewards"] = population_rewards(kept, rewards)
    selected_s = time.perf_counter() - t0  # finalize + selection, shared by the tracks
    results = {
        track: _run_track(cfg, store, registry, track, sel, rewards, suites, now, log, graders)
        for track, sel in tracks.items()
    }
    shared = results.pop(SHARED)
    rep |= shared | {"exploration": rep["exploration"] | shared.get("exploration", {})}
    rep["finalize_s"] = selected_s + shared.get("finalize_s", 0.0)
    rep["excluded"] = rep["excluded"] | {"censored": rep["finalize"]["censored"]}
    if suites.seconds:
        rep["eval_s"] = suites.seconds
    if cfg.online.populations:
        rep["populations"] = results
    return _finish(cfg, store, rep, t0)


def _run_track(
    cfg: Config,
    store: Store,
    registry: Registry,
    track: str,
    sel: Selection,
    rewards: dict[str, dict[str, Any]],
    suites: _Suites,
    now: float,
    log: Callable[[str], None],
    graders: dict[str, Any] | None,
) -> dict[str, Any]:
    """Claim, train, gate and promote or reject one track; its report (``finalize_s`` here is
    the claim's time; :func:`run_cycle` adds the shared rewards and selection)."""
    t0 = time.perf_counter()
    pop = None if track == SHARED else track
    rep: dict[str, Any] = {"excluded": dict(sel.excluded), "trainable": len(sel.kept)}
    if len(sel.kept) < cfg.online.min_batch:
        rep["finalize_s"] = time.perf_counter() - t0
        rep["decision"] = "waiting"
        where = "" if pop is None else f"{pop}: "
        log(f"{where}waiting: {len(sel.kept)} trainable interactions < min_batch "
            f"{cfg.online.min_batch}")  # fmt: skip
        return rep
    parent, shared_champion = registry.served(pop), registry.champion()
    assert shared_champion is not None
    rep["champion_before"] = parent
    batch_id, kept = _claim(cfg, store, sel, track, now)
    rep["batch"] = {"batch_id": batch_id, "size": len(kept)}
    rep["finalize_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    try:
        candidate, metrics = _train(cfg, store, registry, kept, rewards, parent, track)
    except BaseException:
        store.release_batch(batch_id)  # a failed update loses no data: the batch is unclaimed
        raise
    rep["train"], rep["train_s"], rep["candidate"] = metrics, time.perf_counter() - t, candidate
    rep["exploration"] = {"batch_share": metrics["exploration_share"]} | {
        k: metrics[k] for k in ("ess_seqs", "ess_seqs_frac", "ess_tokens")
    }
    store.add_policy_version(
        candidate, str(registry.version_dir(candidate)), parent=parent, status="candidate", now=now
    )
    t_gate = time.perf_counter()
    cand_eval, champ_eval = suites(track, candidate), suites(track, parent)
    alarms, snap = production_alarms(cfg, store, registry, now, track)
    heldout = _heldout(cand_eval, champ_eval)
    g = cfg.online.gate
    best_v = best_earlier(registry, track, parent, sorted(g.margins))
    evaluated = {candidate: cand_eval, parent: champ_eval}
    best = None
    if best_v is not None:
        evaluated[best_v] = suites(track, best_v)
        best = _heldout(cand_eval, evaluated[best_v])
        rep["best_earlier_champion"] = best_v
    record_means(registry, track, evaluated)
    behaviour = (champ_eval.behaviour, cand_eval.behaviour)
    hacks = tuple(b.get(SUSPECTED_HACK_RATE) for b in behaviour)
    hack_rates = None if None in hacks else (float(hacks[0]), float(hacks[1]))  # type: ignore[arg-type]
    probes, rep["probes"] = probe_learned(cfg, cand_eval.views, graders)
    if pop is None:
        gate = run_gate(g, heldout, behaviour, alarms, hack_rates, probes or None, best)
    else:
        shared = _heldout(suites(SHARED, candidate), suites(SHARED, shared_champion))
        gate = run_population_gate(g, heldout, shared, behaviour,
                                   alarms, hack_rates, probes or None, best)  # fmt: skip
    rep["gate"], rep["monitors"] = gate.to_dict(), snap
    rep["heldout"] = {
        k: {"candidate": _ci(cand), "champion": _ci(champ)} for k, (cand, champ) in heldout.items()
    }
    rep["gate_s"] = time.perf_counter() - t_gate
    t = time.perf_counter()
    rep["decision"] = _decide(store, registry, gate, candidate, (parent, shared_champion), pop, now)
    rep["champion_after"] = registry.served(pop)
    rep["promote_s"] = time.perf_counter() - t
    return rep


def _claim(
    cfg: Config, store: Store, sel: Selection, track: str, now: float
) -> tuple[str, list[dict[str, Any]]]:
    """Claim up to ``max_batch`` of the track's trainable rows: ``(batch_id, the rows this
    cycle got)`` (a row another claimant holds is left out)."""
    kept = sel.kept[: cfg.online.max_batch]
    batch_id, claimed = store.claim_batch(
        cfg.online.reward.version,
        [r["interaction_id"] for r in kept],
        claimed_by=f"cycle@{now:.0f}/{track}",
        now=now,
    )
    return batch_id, [r for r in kept if r["interaction_id"] in set(claimed)]


def _decide(
    store: Store,
    registry: Registry,
    gate: Any,
    candidate: int,
    parents: tuple[int, int],
    pop: str | None,
    now: float,
) -> str:
    """Promote ``candidate`` or reject it, as ``gate`` says; the decision. ``parents`` is
    ``(the version it was trained from, the shared champion)``: promotion retires the first,
    unless a population's first adapter grew from the shared champion (which stays)."""
    parent, shared_champion = parents
    if not gate.promote:
        registry.reject(candidate, gate.to_dict(), pop)
        store.set_version_status(candidate, "rejected", now=now)
        return "rejected"
    registry.promote(candidate, gate.to_dict(), pop)
    if pop is None or parent != shared_champion:  # a population's first: the shared stays
        store.set_version_status(parent, "retired", now=now)
    store.set_version_status(candidate, "champion" if pop is None else "pop_champion", now=now)
    return "promoted"


def _finish(cfg: Config, store: Store, rep: dict[str, Any], t0: float) -> dict[str, Any]:
    rep["cycle_s"] = time.perf_counter() - t0
    rep["rejected_events"] = store.rejected_counts()
    rep["duplicate_events"] = store.counter("duplicate_events")
    with open(Path(cfg.run_dir) / "cycles.jsonl", "a") as f:
        f.write(json.dumps(reported(rep), default=str) + "\n")
    store.close()
    return rep
