"""``coderl train``: the synchronous, on-policy recipe over :mod:`coderl.train.pipeline`.

One step, top to bottom (:func:`training_step`)::

    tasks    = run.sampler.take(tasks_per_step)              # coderl.train.sampling; exact on resume
    episodes = env.rollout(engine, tasks, params, G)         # seed rollout_seed(seed, step, round)
                                                             # (vineppo: rollout_branched)
    graded   = pipeline.grade(...)                           # grade, attribute failures
                                                             # (rollout_round; split rollouts: this
                                                             # rank's groups, then gathered)
    scored   = pipeline.rescore(graded)                      # rewards
    run.sampler.observe(tasks, scored.infos)                 # pool: pass-rate estimates
    (dynamic sampling: drop or resample zero-variance groups, counted)
    turn_adv = branching.turn_credit(...)                    # vineppo: grade the continuations
    batch    = pipeline.make_batch(...)                      # advantages over valid members
    metrics  = optimize(run, batch)                          # algorithm-blind train_step; one optimizer step
    advance_version(run, metrics)                            # updated: new version, engine.sync
                                                             # (vllm: adapter loaded, canary)
    pipeline.observe_step(run.observers, ...)                # registered: audit, probes, criteria

Everything a resumed run needs is in the checkpoint (:mod:`coderl.train.run`); sampling seeds
derive from (run seed, step), so a resumed run samples exactly what the uninterrupted one would
have (with ``engine.kind=vllm`` too: its requests are seeded). ``coderl train-async`` with
``async.max_staleness=0`` reproduces this loop exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from coderl.agent.branch import BranchSpec
from coderl.config import Config, anchored, dump_config
from coderl.metrics import (
    MetricsLogger,
    add_cpu_since,
    check_step_measured,
    cpu_clock,
    run_logger,
)
from coderl.progress import PhaseProgress
from coderl.rundir import ensure_new_run, run_lock
from coderl.train import pipeline as P
from coderl.train.branching import turn_credit
from coderl.train.heldout import log_eval_with_alarm, log_extra_evals, without_heldout_evals
from coderl.train.interrupt import (
    AgreedStop,
    StepInterrupted,
    StepSnapshot,
    deferred_interrupts,
)
from coderl.train.run import (
    SFT_WEIGHTS,
    Run,
    UpdateCount,
    advance_version,
    build_policy,
    close_run,
    full_weights,
    load_sft_weights,
    optimize,
    run_eval,
    save,
    setup_run,
    step_status,
)
from coderl.train.signal import prepass, rollout_metrics

# the recipe's own functions, and the run pieces it composes (their home: coderl.train.run)
__all__ = ["Run", "build_policy", "collect", "run_eval", "setup_run", "train", "training_step"]


def collect(run: Run, step: int) -> tuple[P.Scored, dict[str, float], list[dict[str, Any]]]:
    """Sample tasks, roll out G episodes each, grade and reward them, and feed the outcomes back
    to the sampler (round by round: a resample round draws from the updated pool); with dynamic
    sampling, drop (or replace) groups whose rewards have zero variance. Returns the kept
    episodes, rescored together, timing, dynamic-sampling and sampling stats
    (:func:`coderl.train.signal.rollout_metrics`, over every group rolled out), and the infos
    of every graded episode of every round, before any drop (what the step measured)."""
    cfg = run.cfg
    kept: P.Scored | None = None
    stats = {"time/rollout": 0.0, "time/grading": 0.0, "dynamic/zero_variance_groups": 0.0}
    stats["dynamic/dropped_groups"] = stats["dynamic/resampled_groups"] = 0.0
    dynamic = cfg.dynamic_sampling.mode
    rounds = 1 + (cfg.dynamic_sampling.max_resample if dynamic == "resample" else 0)
    wanted = cfg.tasks.tasks_per_step
    rolled_tasks: list[Any] = []  # every round's episodes, before any drop
    rolled_keys: list[str] = []
    rolled_infos: list[dict[str, Any]] = []
    run.sampler.step = step  # the mix schedule reads the step
    for rnd in range(rounds):
        drawn = run.sampler.take(wanted)
        stats["dynamic/resampled_groups"] += len(drawn) if rnd else 0
        graded = rollout_round(run, drawn, P.rollout_seed(cfg.seed, step, rnd), stats)
        scored = P.rescore(graded, cfg)
        if split_rollouts(run):  # each rank rewarded the whole round itself: they must agree
            from coderl.train.distributed import check_same_on_ranks

            rewards = repr((scored.rewards.totals, scored.rewards.valid))
            check_same_on_ranks(rewards, "the round's rewards (a reward term that timed out?)")
        run.sampler.observe(scored.tasks, scored.infos)
        rolled_tasks += scored.tasks
        rolled_keys += scored.keys
        rolled_infos += scored.infos
        stats["time/grading"] += scored.grading_s
        flat = P.zero_variance_groups(scored.keys, scored.rewards)
        stats["dynamic/zero_variance_groups"] += len(flat)
        keep = [i for i, k in enumerate(scored.keys) if dynamic == "off" or k not in flat]
        if dynamic != "off":
            stats["dynamic/dropped_groups"] += len(flat)
        part = P.select(scored, keep)
        kept = part if kept is None else concat([kept, part])
        wanted = len(flat)
        if dynamic != "resample" or wanted == 0:
            break
    assert kept is not None
    check_step_measured(step + 1, rolled_infos)  # step: from 0 here, from 1 for users
    stats.update(rollout_metrics(run.sampler, rolled_tasks, rolled_keys, rolled_infos))
    # rewards of the kept samples, recomputed together (group pass rates are per group)
    return P.rescore(kept, cfg), stats, rolled_infos


def group_seed(round_seed: int, group: int) -> int:
    """Sampling seed of group ``group`` (its index in the round) rolled out alone (split
    rollouts, :func:`rollout_round`): the same whichever rank rolls it out. The stride is beyond
    any ``rollout_seed`` step and :data:`coderl.envs.mix.SEED_STRIDE` offset."""
    return round_seed + group * 1_000_000_007


def concat(parts: Sequence[P.Scored]) -> P.Scored:
    """The episodes of ``parts`` one after another (rewards not recomputed: call
    :func:`coderl.train.pipeline.rescore`); ``grading_s`` is the longest part's (parts graded
    side by side: the ranks of a sharded run), the observers are the first part's."""
    out = P.select(parts[0], list(range(len(parts[0].episodes))))
    for part in parts[1:]:
        for name in ("episodes", "keys", "samples", "failures", "grades", "flags", "tasks"):
            getattr(out, name).extend(getattr(part, name))
    out.grading_s = max(p.grading_s for p in parts)
    return out


def split_rollouts(run: Run) -> bool:
    """Whether this is a sharded run whose ranks split the rollouts
    (``trainer.distributed.split_rollouts``)."""
    return run.sharded is not None and run.cfg.trainer.distributed.split_rollouts


def rollout_round(
    run: Run, drawn: list[tuple[int, Any]], seed: int, stats: dict[str, float]
) -> P.Scored:
    """One round's episodes, ``G`` per drawn ``(position, task)``, graded but not yet rewarded
    (:func:`coderl.train.pipeline.grade`), task-major in ``drawn`` order; adds the rollout time
    to ``stats["time/rollout"]``, the CPU seconds of the rollout and of the grading to
    ``stats["cpu_s/rollout"]``, ``["cpu_s/grading"]`` and their ``_children`` keys
    (:func:`coderl.metrics.add_cpu_since`) and, with the torch sampler, the deltas of its
    engine's counters (:attr:`coderl.policy.engine.TorchEngine.prefill_stats`: tokens
    prefilled, reused from the prefix cache, asked for, decoded, and the positions they
    attended) to ``stats["engine/<counter>"]`` (measured totals).

    One process, or a sharded run with replicated rollouts: one ``env.rollout`` call seeded
    ``seed``. Split rollouts: this rank rolls out and grades only its contiguous share of the
    groups (:func:`coderl.train.distributed.rank_share`; a group never splits), each group its
    own call seeded :func:`group_seed` (so an episode does not depend on the world size), then
    every rank gathers every share in rank order, which is ``drawn`` order.
    ``stats["dist/episodes_this_rank"]`` counts the episodes this rank rolled out in the step.
    """
    cfg, G = run.cfg, run.cfg.rollout.group_size
    split = split_rollouts(run)
    if split:
        from coderl.train import distributed

        lo, hi = distributed.rank_share(len(drawn))
    else:
        lo, hi = 0, len(drawn)
    mine = drawn[lo:hi]
    counters = getattr(run.engine, "prefill_counters", None)  # the torch sampler's; vLLM: none
    before = counters() if counters is not None else {}
    t0 = time.perf_counter()
    clock = cpu_clock()
    if split:
        episodes = [
            ep
            for j, (_, task) in enumerate(mine, start=lo)
            for ep in rollout(run, [task], P.sampling_params(cfg, group_seed(seed, j)))
        ]
    else:
        episodes = rollout(run, [t for _, t in mine], P.sampling_params(cfg, seed))
    stats["time/rollout"] += time.perf_counter() - t0
    add_cpu_since(stats, "rollout", clock)
    if counters is not None:  # what the engine prefilled and reused, measured (all episodes)
        for k, v in counters().items():
            stats[f"engine/{k}"] = stats.get(f"engine/{k}", 0.0) + float(v - before[k])
    owners = [t for _, t in mine for _ in range(G)]
    keys = [P.group_key(t.id, pos) for pos, t in mine for _ in range(G)]
    clock = cpu_clock()
    graded = P.grade(run.env, run.policy, cfg, owners, keys, episodes, run.observers)
    add_cpu_since(stats, "grading", clock)
    if not split:
        return graded
    stats["dist/episodes_this_rank"] = stats.get("dist/episodes_this_rank", 0.0) + len(episodes)
    shares = distributed.gather(replace(graded, tasks=[], observers=()))  # tasks: every rank has
    whole = concat(shares)
    whole.tasks, whole.observers = [t for _, t in drawn for _ in range(G)], graded.observers
    return whole


def rollout(run: Run, tasks: list[Any], params: Any) -> list[Any]:
    """``G`` episodes per task; with ``rollout.branch`` (``vineppo``) through the environment's
    ``rollout_branched`` (continuations forked at the chosen turn boundaries).

    Raises:
        ValueError: branching is configured and the environment cannot fork (no harness).
    """
    cfg, G = run.cfg, run.cfg.rollout.group_size
    assert run.engine is not None  # setup_run built it
    b = cfg.rollout.branch
    if b.k == 0:
        return run.env.rollout(run.engine, tasks, params, G)
    branched = getattr(run.env, "rollout_branched", None)
    if branched is None:
        raise ValueError(
            f"rollout.branch: tasks.source={cfg.tasks.source!r} has no branched rollouts "
            "(the agent-harness environments have: humaneval, fnrepair, repo)"
        )
    return branched(run.engine, tasks, params, G, BranchSpec(tuple(b.turns), b.every, b.k))


def training_step(run: Run) -> dict[str, float]:
    """One step of the loop (see the module docstring); returns its metrics."""
    cfg = run.cfg
    with full_weights(run):  # sharded: weights gathered; every rank ends with the whole batch
        scored, metrics, measured = collect(run, run.step)
        turn_adv = None
        if cfg.algorithm.advantage == "vineppo":  # grade the continuations: per-turn values
            turn_adv, branch_metrics = turn_credit(run.env, run.policy, cfg, scored)
            metrics.update(branch_metrics)
        metrics.update(P.step_metrics(scored.infos, cfg, measured))
        for k, v in scored.rewards.counts.items():
            metrics[f"reward/{k}"] = float(v)
        t0 = time.perf_counter()
        clock = cpu_clock()
        batch = P.make_batch(
            cfg,
            run.policy,
            run.value_head,
            [ep.trajectory for ep in scored.episodes],
            scored.rewards.totals,
            scored.rewards.valid,
            scored.keys,
            turn_adv,
        )
    step = run.step
    try:
        with deferred_interrupts():  # the update and the step count: whole, or not begun
            _update(run, batch, scored, metrics, t0, clock)
    except KeyboardInterrupt as stop:  # held through the update: the step is complete
        if run.step == step:
            raise
        raise StepInterrupted(metrics) from stop
    return metrics


def _update(
    run: Run, batch: Any, scored: P.Scored, metrics: dict[str, float], t0: float, clock: Any
) -> None:
    """The second half of :func:`training_step`: the optimizer step, the new version, the step
    count and the observers; adds to ``metrics`` (``t0``, ``clock``: when training began)."""
    metrics.update(optimize(run, batch))
    metrics["time/train"] = time.perf_counter() - t0
    add_cpu_since(metrics, "train", clock)
    t0 = time.perf_counter()
    metrics.update(advance_version(run, metrics))  # a version per update, synced before rollouts
    metrics["time/sync"] = time.perf_counter() - t0
    sampled = metrics["episode/sampled_tokens"] * metrics["episodes"]
    metrics["tokens_per_s/rollout"] = sampled / max(metrics["time/rollout"], 1e-9)
    metrics["tokens_per_s/train"] = metrics.get("trained_tokens", 0.0) / max(
        metrics["time/train"], 1e-9
    )
    metrics["policy_version"] = float(run.policy.version)
    run.step += 1
    metrics.update(P.observe_step(run.observers, run.cfg, run.step, scored.infos))


def train(cfg: Config, *, resume: bool = False, observers: Sequence[P.StepObserver] = ()) -> Path:
    """Run (or, with ``resume``, continue) training as configured; returns the run directory.
    ``observers`` watch every step (``coderl train`` registers
    :func:`coderl.eval.observers.default_observers`: the audit log, probes, criteria metrics).

    Writes ``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``, ``tb/`` and ``checkpoints/`` under
    ``cfg.run_dir``.

    Raises:
        FileExistsError: not ``resume`` and ``cfg.run_dir`` holds a previous run's checkpoints
            or logs; or another process is writing to ``cfg.run_dir``
            (:class:`coderl.rundir.RunDirBusy`).
        FileNotFoundError: ``resume`` and there is no complete checkpoint.
    """
    run_dir = Path(cfg.run_dir)
    with run_lock(run_dir, "coderl train"):  # one writer at a time
        if not resume:  # a resumed run's config.yaml changes only through coderl.train.resume
            ensure_new_run(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)  # torchrun ranks > 0 take no lock
            (run_dir / "config.yaml").write_text(dump_config(anchored(cfg)))
        run = setup_run(cfg, resume=resume, load_sft=False)
        run.observers = list(observers) if _rank(run) == 0 else []  # one audit log per run
        try:
            _train(run, resume)
        finally:
            close_run(run)  # a vLLM server coderl started stops, whatever happened
    return run_dir


def _rank(run: Run) -> int:
    """This process's rank in a sharded run (0 in a single-process one)."""
    if run.sharded is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def _train(run: Run, resume: bool) -> None:
    without_heldout_evals(run)
    cfg = run.cfg
    if (rank := _rank(run)) > 0:  # a sharded run's other ranks log their own view aside
        logger = MetricsLogger(
            Path(cfg.run_dir) / "ranks" / f"rank-{rank}", resume_step=run.step, tensorboard=False
        )
    else:
        logger = run_logger(cfg, run.step)
    if run.step == 0 and not resume:
        warm = Path(cfg.run_dir) / SFT_WEIGHTS
        if cfg.eval.before_after and cfg.eval.before_sft and cfg.sft.enabled and warm.is_file():
            base = run_eval(run, samples=cfg.eval.base_samples)  # the model before SFT
            logger.log_eval(0, {**base, "phase": "base"})
        sft = load_sft_weights(run)
        if cfg.eval.before_after:
            phase = "sft" if sft else "start"
            logger.log_eval(0, {**run_eval(run), "phase": phase})
            log_extra_evals(run, logger, 0, phase)  # eval.extra_splits, beside it
        with full_weights(run):  # sharded: every rank runs the whole pre-pass
            prepass(run)  # tasks.pool.prepass_samples: seed the pool's estimates (0: nothing)
    updates = UpdateCount(run.step)
    saved = run.step  # the newest checkpoint's step (0: none yet)
    bar = PhaseProgress("train", cfg.trainer.steps, completed=run.step, enabled=cfg.progress)
    with bar, AgreedStop(run.sharded is not None) as stop:  # sharded: ranks stop together
        while run.step < cfg.trainer.steps:
            before, metrics, logged = StepSnapshot.of(run), None, False
            try:
                metrics = training_step(run)
                updates.saw(metrics)
                bar.advance(status=step_status(metrics))
                last = run.step == cfg.trainer.steps
                if (cfg.eval.every and run.step % cfg.eval.every == 0 and not last) or (
                    last and cfg.eval.before_after
                ):
                    metrics.update(log_eval_with_alarm(logger, run.step, run_eval(run)))
                if last and cfg.eval.before_after:
                    log_extra_evals(run, logger, run.step)
                with deferred_interrupts():  # a step's line and checkpoint are written whole
                    logger.log(run.step, metrics)
                    logged = True
                    if run.step % cfg.trainer.checkpoint_every == 0 or last:
                        save(run)
                        saved = run.step
                if not last:
                    stop.check()
            except KeyboardInterrupt as held:  # Ctrl-C, SIGTERM
                metrics = metrics if metrics is not None else getattr(held, "metrics", None)
                unlogged = None if logged else metrics
                _keep_completed(run, logger, before, unlogged, saved, agreed=stop.agreed)
                raise
    logger.close()
    if rank == 0:
        updates.warn(run.step)


def _keep_completed(
    run: Run,
    logger: MetricsLogger,
    before: StepSnapshot,
    metrics: dict[str, float] | None,
    saved: int,
    *,
    agreed: bool = False,
) -> None:
    """Ctrl-C or SIGTERM in a step: checkpoint the last completed step unless it is the newest
    checkpoint (``saved``). A step interrupted before its update (rollouts, grading) is
    abandoned: the checkpoint holds the sampler as it was before it (``before``); one
    interrupted after its update (in an evaluation, whose record is then missing) is complete:
    its ``metrics`` are logged (None: logged already), then it is saved. A sharded run saves
    only where its ranks ``agreed`` to stop at a step's end (a checkpoint is a collective:
    :class:`coderl.train.interrupt.AgreedStop`)."""
    if run.sharded is not None and not agreed:
        return
    with deferred_interrupts():
        done = run.step > before.step
        if done and metrics is not None:
            logger.log(run.step, metrics)
        logger.close()
        if run.step > saved:
            save(run, **({} if done else before.state()))
