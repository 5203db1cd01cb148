"""The real trainer and environment of :mod:`coderl.train` behind the async seams.

- :class:`EnvSampler` (a :class:`Sampler`): its own policy copy plus the configured environment;
  one job = ``rollout.group_size`` episodes of one task through ``env.rollout`` (the harness),
  graded by ``env.grade`` and rewarded by :func:`coderl.rewards.compute_rewards`. Weights are
  picked up between turns by wrapping the policy: every ``generate`` call (one turn of the
  group's episodes) first asks for newer weights when ``weight_sync="turn"``.
- :class:`TrainLearner` (a :class:`Learner`): :func:`coderl.train.loop.make_batch` (advantages by
  group) and :func:`coderl.train.step.train_step`, whose importance weights
  (``algorithm.importance``, ``algorithm.old_logp="trainer"``) correct for staleness with the
  stored behaviour logprobs (AReaL's decoupled objective, Fu et al. 2025, Eq. 5).
- :func:`train_async`: ``coderl train-async``, the async counterpart of ``coderl train`` writing
  the same ``metrics.jsonl``, TensorBoard logs and checkpoints (plus the task ledger).

Not supported yet (they raise): the KL reward term (it needs reference logprobs on the worker)
and dynamic sampling (zero-variance group filtering) of the synchronous loop.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from coderl.asyncrl.buffer import TaskStream
from coderl.asyncrl.config import AsyncConfig
from coderl.asyncrl.loop import AsyncRunner
from coderl.asyncrl.types import BetweenTurns, Episode, Group, Job, Weights
from coderl.config import Config, apply_override, build_config, dump_config
from coderl.policy.base import Completion, SamplingParams
from coderl.rewards import RewardResult, RewardSample, compute_rewards
from coderl.train.checkpoint import (
    ensure_new_run,
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    save_checkpoint,
    trainable_state,
)
from coderl.train.env import EpisodeRecord, build_environment
from coderl.train.loop import build_policy, make_batch, setup_run
from coderl.train.metrics import MetricsLogger
from coderl.train.step import train_step


def check_supported(cfg: Config) -> None:
    """Raises ValueError for settings of the synchronous loop that the async one lacks."""
    if "kl" in cfg.reward.terms and cfg.reward.kl_coef > 0:
        raise ValueError("reward.terms.kl is not supported by train-async; use algorithm.kl.coef")
    if cfg.dynamic_sampling.mode != "off":
        raise ValueError("dynamic_sampling is not supported by train-async; set it to 'off'")


def task_stream(tasks: list[Any], seed: int) -> TaskStream:
    """Index -> ``(task.id, task)``: each epoch a permutation seeded by (seed, epoch), the order
    recipe of :class:`coderl.train.loop.TaskSampler`.

    Raises:
        ValueError: ``tasks`` is empty.
    """
    if not tasks:
        raise ValueError("the training split holds no tasks")
    orders: dict[int, list[int]] = {}

    def at(i: int) -> tuple[str, Any]:
        epoch, pos = divmod(i, len(tasks))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(tasks)).tolist()
        task = tasks[orders[epoch][pos]]
        return task.id, task

    return at


class _TurnSyncPolicy:
    """The worker's policy as the harness sees it: each ``generate`` (one turn) first calls
    ``between_turns``, which loads newer weights when turn-level sync is on."""

    def __init__(self, policy: Any, between_turns: BetweenTurns) -> None:
        self._policy, self._between_turns = policy, between_turns

    @property
    def version(self) -> int:
        return int(self._policy.version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self._between_turns()
        out: list[Completion] = self._policy.generate(prompts, params)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


class EnvSampler:
    """Rollout side on the configured policy and environment (one per worker)."""

    def __init__(self, cfg: Config) -> None:
        check_supported(cfg)
        self.cfg = cfg
        self.env = build_environment(cfg)
        self.policy = build_policy(cfg)

    def load_weights(self, version: int, weights: Weights) -> None:
        load_trainable(self.policy.model, weights)
        self.policy.version = version

    def rollout(self, job: Job, between_turns: BetweenTurns) -> list[Episode]:
        cfg, G = self.cfg, self.cfg.rollout.group_size
        r = cfg.rollout
        params = SamplingParams(r.temperature, r.top_p, r.max_new_tokens, seed=job.seed)
        records = self.env.rollout(
            _TurnSyncPolicy(self.policy, between_turns), [job.task], params, G
        )
        grades = self.env.grade([job.task] * G, records)
        budget, ease = self.env.token_budget(), self.env.ease(job.task)
        samples = [
            RewardSample(
                task_id=ep.task_id,
                resolved=g.resolved,
                fraction_passed=g.fraction_passed,
                grading_error=g.grading_error,
                sampled_tokens=sum(s.num_trainable for s in ep.trajectory.segments),
                token_budget=budget,
                broken_tool_calls=ep.broken_tool_calls,
                ease=ease,
            )
            for ep, g in zip(records, grades, strict=True)
        ]
        rewards = compute_rewards(samples, cfg.reward)
        return [
            Episode(
                ep.task_id,
                ep.trajectory,
                total,
                {"valid": ok, "resolved": g.resolved, "turns": ep.turns, "breakdown": b},
            )
            for ep, g, total, ok, b in zip(
                records, grades, rewards.totals, rewards.valid, rewards.breakdown, strict=True
            )
        ]


class TrainLearner:
    """Trainer side: the synchronous loop's batch building and trainer step on async groups."""

    def __init__(self, cfg: Config) -> None:
        check_supported(cfg)
        self.run = setup_run(cfg)

    @property
    def version(self) -> int:
        return int(self.run.policy.version)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step; every group keeps its own advantage baseline (the same task may
        appear twice in an async batch, from different epochs)."""
        run = self.run
        eps = [(g, ep) for g in groups for ep in g.episodes]
        records = [EpisodeRecord(f"{ep.task_id}#{g.job.index}", ep.trajectory) for g, ep in eps]
        valid = [bool(ep.info.get("valid", True)) for _, ep in eps]
        totals = [ep.reward for _, ep in eps]
        rewards = RewardResult(totals, valid, [{} for _ in eps])
        batch = make_batch(run, records, rewards)
        metrics: dict[str, float] = {"optimizer_steps": 0.0}
        if batch is not None:
            metrics = train_step(
                run.policy.model,
                run.optimizer,
                run.scheduler,
                batch,
                run.cfg.algorithm,
                run.cfg.trainer,
                temperature=run.cfg.rollout.temperature,
                max_len=run.env.token_budget(),
                value_head=run.value_head,
            )
        ok = [t for t, v in zip(totals, valid, strict=True) if v]
        metrics["reward/mean"] = float(np.mean(ok)) if ok else math.nan
        metrics["resolved_rate"] = float(np.mean([bool(ep.info.get("resolved")) for _, ep in eps]))
        run.policy.bump_version()  # a step with no valid episode still advances the version
        run.step += 1
        return metrics

    def weights(self) -> Weights:
        return trainable_state(self.run.policy.model)

    def state_dict(self) -> dict[str, Any]:
        run = self.run
        return {
            "trainable": trainable_state(run.policy.model),
            "optimizer": copy.deepcopy(run.optimizer.state_dict()),
            "scheduler": copy.deepcopy(run.scheduler.state_dict()),
            "value_head": copy.deepcopy(run.value_head.state_dict()) if run.value_head else None,
            "version": run.policy.version,
            "step": run.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = self.run
        load_trainable(run.policy.model, state["trainable"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        if run.value_head is not None:
            run.value_head.load_state_dict(state["value_head"])
        run.policy.version, run.step = int(state["version"]), int(state["step"])


def load_configs(path: str | None, overrides: list[str]) -> tuple[Config, AsyncConfig]:
    """The training config plus its ``async`` section, from a YAML preset and ``key=value``
    overrides (``async.max_staleness=1`` goes to the async section).

    Raises:
        ValueError (ConfigError): a missing file, unknown keys or bad values in either part.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        tree = yaml.safe_load(p.read_text()) or {}
    async_tree = dict(tree.pop("async", None) or {})
    for ov in overrides:
        if ov.startswith("async."):
            apply_override(async_tree, ov.removeprefix("async."))
        else:
            apply_override(tree, ov)
    return build_config(tree), AsyncConfig.from_dict(async_tree)


def train_async(cfg: Config, acfg: AsyncConfig, *, resume: bool = False) -> dict[str, Any]:
    """Train ``cfg.trainer.steps`` steps asynchronously; logs like ``coderl train`` and writes
    checkpoints every ``trainer.checkpoint_every`` steps with the task ledger in ``state.json``.
    Returns the run summary (staleness histogram, dropped groups, idle fractions...).

    Raises:
        ValueError: unsupported settings (see :func:`check_supported`).
        FileNotFoundError: ``resume`` without a complete checkpoint.
        FileExistsError: not ``resume`` and ``cfg.run_dir`` holds a previous run's checkpoints.
    """
    run_dir = Path(cfg.run_dir)
    if not resume:
        ensure_new_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg) + yaml.safe_dump({"async": vars(acfg)}))
    learner = TrainLearner(cfg)
    run = learner.run
    tasks = task_stream(run.env.tasks(cfg.tasks.train_split)[: cfg.tasks.limit], cfg.seed)

    def on_step(runner: AsyncRunner, metrics: dict[str, float]) -> None:
        summary = runner.summary()
        extra = {f"async/{k}": float(v) for k, v in summary.items() if not isinstance(v, dict)}
        logger.log(run.step, {**metrics, **extra})
        if run.step % cfg.trainer.checkpoint_every == 0 or run.step == cfg.trainer.steps:
            save_checkpoint(
                cfg.run_dir,
                run.step,
                model=run.policy.model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                value_head=run.value_head,
                state={"version": run.policy.version, "ledger": runner.ledger.state_dict()},
                keep=cfg.trainer.keep_checkpoints,
            )

    runner = AsyncRunner(acfg, learner, _SamplerFactory(cfg), tasks, on_step=on_step)
    if resume:
        state = load_checkpoint(
            latest_checkpoint(cfg.run_dir),
            model=run.policy.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            value_head=run.value_head,
        )
        run.step, run.policy.version = state["step"], state["version"]
        if "ledger" not in state:
            raise ValueError(
                f"{cfg.run_dir} was written by the synchronous `coderl train` (its checkpoint has "
                "no task ledger); continue it with `coderl train --resume`, or start train-async "
                "in another run_dir"
            )
        runner.ledger.load_state_dict(state["ledger"])
    logger = MetricsLogger(run_dir, resume_step=run.step, tensorboard=cfg.tensorboard)
    with runner:
        summary = runner.run(cfg.trainer.steps)
    logger.close()
    return summary


class _SamplerFactory:
    """Picklable ``() -> EnvSampler`` for process and Ray workers."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def __call__(self) -> EnvSampler:
        return EnvSampler(self.cfg)
