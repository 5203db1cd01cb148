"""``coderl train``: the synchronous, on-policy reference loop.

One step, top to bottom (:func:`training_step`)::

    tasks     = sampler.next(tasks_per_step)                 # data cursor, exact on resume
    episodes  = env.rollout(policy, tasks, G)                # harness in sandboxes, concurrently
    grades    = env.grade(tasks, episodes)                   # hidden tests
    rewards   = compute_rewards(...)                         # per-term breakdown, crash masking
    (dynamic sampling: drop or resample zero-variance groups, counted)
    advantages = GROUP_ESTIMATORS[...] or GAE(value head)    # grouped by task
    metrics   = train_step(...)                              # algorithm-blind; one optimizer step
    policy.bump_version()                                    # new weights version

Everything a resumed run needs is in the checkpoint (:mod:`coderl.train.checkpoint`); sampling
seeds derive from (run seed, step), so a resumed run samples exactly what the uninterrupted one
would have.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from coderl.config import Config, dump_config
from coderl.policy.base import SamplingParams
from coderl.policy.loading import load_policy
from coderl.policy.local import LocalPolicy, LoraSpec
from coderl.rewards import RewardResult, RewardSample, compute_rewards
from coderl.train.advantages import episode_advantages, gae_advantages
from coderl.train.batch import StepBatch, build_batch
from coderl.train.checkpoint import (
    ensure_new_run,
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    save_checkpoint,
)
from coderl.train.env import Environment, EpisodeRecord, GradeRecord, build_environment
from coderl.train.metrics import MetricsLogger, progress_bar
from coderl.train.optim import build_optimizer
from coderl.train.sft import SFT_WEIGHTS
from coderl.train.step import forward, train_step

EVAL_SEED_OFFSET = 1_000_003


class TaskSampler:
    """An endless stream of a split's tasks: each epoch a fresh permutation seeded by
    (seed, epoch). ``position`` (tasks handed out so far) is the whole data cursor."""

    def __init__(self, tasks: list[Any], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the training split holds no tasks")
        self.tasks, self.seed, self.position = tasks, seed, position

    def _order(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks)).tolist()

    def next(self, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.tasks))
            out.append(self.tasks[self._order(epoch)[i]])
            self.position += 1
        return out


def build_policy(cfg: Config) -> LocalPolicy:
    """The policy of ``cfg.model``: LoRA adapters (reference = adapter disabled) or full
    fine-tuning (reference = a frozen copy)."""
    m = cfg.model
    lora = LoraSpec(rank=m.lora_r, alpha=m.lora_alpha, dropout=m.lora_dropout) if m.lora else None
    torch.manual_seed(m.seed)  # LoRA initialisation
    return load_policy(m.name, lora=lora, seed=m.seed)


@dataclass
class Run:
    """Everything a training run holds between steps."""

    cfg: Config
    env: Environment
    policy: LocalPolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: TaskSampler
    value_head: nn.Module | None = None
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def setup_run(cfg: Config, *, resume: bool = False, load_sft: bool = True) -> Run:
    """Build policy, environment, optimizer and data cursor; restore them from the latest
    checkpoint of ``cfg.run_dir`` when ``resume``.

    Raises:
        FileNotFoundError: ``resume`` and the run has no complete checkpoint.
    """
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    env = build_environment(cfg)
    policy = build_policy(cfg)
    groups: list[dict[str, Any]] = [{"params": policy.trainable_parameters()}]
    value_head = None
    if cfg.algorithm.advantage == "gae":
        torch.manual_seed(cfg.seed)
        value_head = nn.Linear(policy.model.config.hidden_size, 1)
        groups.append({"params": list(value_head.parameters()), "lr": cfg.algorithm.value_lr})
    optimizer, scheduler = build_optimizer(groups, cfg.trainer)
    run = Run(
        cfg,
        env,
        policy,
        optimizer,
        scheduler,
        TaskSampler(env.tasks(cfg.tasks.train_split)[: cfg.tasks.limit], cfg.seed),
        value_head,
    )
    if load_sft and not resume:
        load_sft_weights(run)  # start RL from the SFT warm start
    if resume:
        ckpt = latest_checkpoint(cfg.run_dir)
        state = load_checkpoint(
            ckpt,
            model=policy.model,
            optimizer=optimizer,
            scheduler=scheduler,
            value_head=value_head,
        )
        run.step, run.sampler.position, policy.version = (
            state["step"],
            state["cursor"],
            state["version"],
        )
    return run


def _sampling(cfg: Config, seed: int, temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    t = r.temperature if temperature is None else temperature
    return SamplingParams(temperature=t, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)


def _reward_samples(
    run: Run, tasks: list[Any], episodes: list[EpisodeRecord], grades: list[GradeRecord]
) -> list[RewardSample]:
    budget = run.env.token_budget()
    out = []
    for task, ep, g in zip(tasks, episodes, grades, strict=True):
        out.append(
            RewardSample(
                task_id=ep.task_id,
                resolved=g.resolved,
                fraction_passed=g.fraction_passed,
                # a harness failure (finish_reason "error") is infrastructure, not the policy
                grading_error=g.grading_error
                or (f"episode error: {ep.finish_reason}" if ep.finish_reason == "error" else None),
                sampled_tokens=sum(s.num_trainable for s in ep.trajectory.segments),
                token_budget=budget,
                broken_tool_calls=ep.broken_tool_calls,
                ease=run.env.ease(task),
            )
        )
    return out


@torch.no_grad()
def _reference_logprobs(run: Run, batch: StepBatch) -> torch.Tensor:
    mbs, t = run.cfg.trainer.micro_batch_size, run.cfg.rollout.temperature
    parts = [
        run.policy.reference_logprobs(batch.rows(i, i + mbs).tokens, t)
        for i in range(0, batch.size, mbs)
    ]
    return torch.cat(parts)


def _fill_kl_k1(run: Run, episodes: list[EpisodeRecord], samples: list[RewardSample]) -> None:
    """k1 = sum over sampled tokens of (behaviour logp - reference logp), per episode."""
    segs = [(i, s) for i, ep in enumerate(episodes) for s in ep.trajectory.segments]
    batch = build_batch([s for _, s in segs], [0.0] * len(segs), run.policy.pad_token_id)
    ref = _reference_logprobs(run, batch)
    k1 = ((batch.tokens.behavior_logprobs - ref) * batch.tokens.loss_mask).sum(-1)  # (B,)
    for (i, _), v in zip(segs, k1.tolist(), strict=True):
        samples[i].kl_k1 += v


def _zero_variance_groups(episodes: list[EpisodeRecord], rewards: RewardResult) -> set[str]:
    by_task: dict[str, list[float]] = {}
    for ep, r, ok in zip(episodes, rewards.totals, rewards.valid, strict=True):
        if ok:
            by_task.setdefault(ep.task_id, []).append(r)
    return {t for t, rs in by_task.items() if len(rs) < 2 or max(rs) - min(rs) < 1e-12}


def collect(
    run: Run, step: int
) -> tuple[list[EpisodeRecord], list[RewardSample], RewardResult, dict[str, float]]:
    """Sample tasks, roll out G episodes each, grade, compute rewards; with dynamic sampling,
    drop (or replace) groups whose rewards have zero variance."""
    cfg, G = run.cfg, run.cfg.rollout.group_size
    eps_out: list[EpisodeRecord] = []
    samples_out: list[RewardSample] = []
    stats = {"time/rollout": 0.0, "time/grading": 0.0, "dynamic/zero_variance_groups": 0.0}
    stats["dynamic/dropped_groups"] = 0.0
    rounds = 1 + (
        cfg.dynamic_sampling.max_resample if cfg.dynamic_sampling.mode == "resample" else 0
    )
    wanted = cfg.tasks.tasks_per_step
    for rnd in range(rounds):
        tasks = run.sampler.next(wanted)
        t0 = time.perf_counter()
        seed = cfg.seed * 7919 + step * 101 + rnd
        episodes = run.env.rollout(run.policy, tasks, _sampling(cfg, seed), G)
        t1 = time.perf_counter()
        owners = [t for t in tasks for _ in range(G)]
        grades = run.env.grade(owners, episodes)
        samples = _reward_samples(run, owners, episodes, grades)
        if "kl" in cfg.reward.terms and cfg.reward.kl_coef > 0:
            _fill_kl_k1(run, episodes, samples)
        stats["time/rollout"] += t1 - t0
        stats["time/grading"] += time.perf_counter() - t1
        rewards = compute_rewards(samples, cfg.reward)
        flat = _zero_variance_groups(episodes, rewards)
        stats["dynamic/zero_variance_groups"] += len(flat)
        keep = [
            i
            for i, ep in enumerate(episodes)
            if cfg.dynamic_sampling.mode == "off" or ep.task_id not in flat
        ]
        if cfg.dynamic_sampling.mode != "off":
            stats["dynamic/dropped_groups"] += len(flat)
        eps_out += [episodes[i] for i in keep]
        samples_out += [samples[i] for i in keep]
        wanted = len(flat)
        if cfg.dynamic_sampling.mode != "resample" or wanted == 0:
            break
    # rewards of the kept samples, recomputed together (group pass rates are per task)
    rewards = (
        compute_rewards(samples_out, cfg.reward) if samples_out else RewardResult([], [], [], {})
    )
    return eps_out, samples_out, rewards, stats


def make_batch(run: Run, episodes: list[EpisodeRecord], rewards: RewardResult) -> StepBatch | None:
    """Advantages (grouped by task) and the token batch of every valid episode's segments."""
    cfg = run.cfg
    keep = [i for i, ok in enumerate(rewards.valid) if ok]
    if not keep:
        return None
    segs, adv, seg_reward = [], [], []
    if cfg.algorithm.advantage != "gae":
        ids = {t: j for j, t in enumerate(sorted({episodes[i].task_id for i in keep}))}
        a = episode_advantages(
            cfg.algorithm.advantage,
            [rewards.totals[i] for i in keep],
            [ids[episodes[i].task_id] for i in keep],
            [True] * len(keep),
        )
    for j, i in enumerate(keep):
        for k, s in enumerate(episodes[i].trajectory.segments):
            last = k == len(episodes[i].trajectory.segments) - 1
            segs.append(s)
            adv.append(float(a[j]) if cfg.algorithm.advantage != "gae" else 0.0)
            seg_reward.append(rewards.totals[i] if last else 0.0)
    batch = build_batch(segs, adv, run.policy.pad_token_id)
    if cfg.algorithm.kl.coef > 0:
        batch.ref_logp = _reference_logprobs(run, batch)
    if cfg.algorithm.advantage == "gae":
        assert run.value_head is not None
        with torch.no_grad():
            values = torch.cat(
                [
                    forward(
                        run.policy.model,
                        batch.rows(i, i + cfg.trainer.micro_batch_size).tokens,
                        temperature=cfg.rollout.temperature,
                        value_head=run.value_head,
                    ).values
                    for i in range(0, batch.size, cfg.trainer.micro_batch_size)
                ]
            )
        values = values * batch.loss_mask
        batch.advantages, batch.returns = gae_advantages(
            torch.tensor(seg_reward),
            values,
            batch.loss_mask,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
        )
        batch.old_values = values
    return batch


def _episode_metrics(
    episodes: list[EpisodeRecord], rewards: RewardResult, cfg: Config
) -> dict[str, float]:
    n = max(len(episodes), 1)
    valid = [r for r, ok in zip(rewards.totals, rewards.valid, strict=True) if ok]
    m: dict[str, float] = {
        "reward/mean": float(np.mean(valid)) if valid else math.nan,
        "reward/std": float(np.std(valid)) if valid else math.nan,
        "episodes": float(len(episodes)),
        "episode/sampled_tokens": sum(
            sum(s.num_trainable for s in e.trajectory.segments) for e in episodes
        )
        / n,
        "episode/truncated_rate": sum(e.truncated for e in episodes) / n,
        "episode/turns": sum(e.turns for e in episodes) / n,
        "episode/segments": sum(len(e.trajectory.segments) for e in episodes) / n,
        "episode/broken_tool_calls": sum(e.broken_tool_calls for e in episodes) / n,
        "episode/no_action_turns": sum(e.no_action_turns for e in episodes) / n,
        "episode/summaries": sum(e.summaries for e in episodes) / n,
    }
    for name in cfg.reward.terms:
        vals = [b[name] for b, ok in zip(rewards.breakdown, rewards.valid, strict=True) if ok]
        m[f"reward/{name}"] = float(np.mean(vals)) if vals else math.nan
    for k, v in rewards.counts.items():
        m[f"reward/{k}"] = float(v)
    return m


def training_step(run: Run) -> dict[str, float]:
    """One step of the loop (see the module docstring); returns its metrics."""
    cfg, step = run.cfg, run.step
    episodes, samples, rewards, metrics = collect(run, step)
    metrics.update(_episode_metrics(episodes, rewards, cfg))
    solved = [x.resolved for x, ok in zip(samples, rewards.valid, strict=True) if ok]
    metrics["resolved_rate"] = float(np.mean(solved)) if solved else math.nan
    t0 = time.perf_counter()
    batch = make_batch(run, episodes, rewards)
    if batch is None:
        metrics.update(optimizer_steps=0.0, sequences=0.0, trained_tokens=0.0)
    else:
        adv = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[batch.loss_mask]
        metrics.update(
            {
                "advantage/mean": float(adv.mean()),
                "advantage/std": float(adv.std()) if adv.numel() > 1 else 0.0,
                "advantage/abs_max": float(adv.abs().max()),
                "advantage/zero_frac": float((adv == 0).float().mean()),
            }
        )
        metrics.update(
            train_step(
                run.policy.model,
                run.optimizer,
                run.scheduler,
                batch,
                cfg.algorithm,
                cfg.trainer,
                temperature=cfg.rollout.temperature,
                max_len=run.env.token_budget(),
                value_head=run.value_head,
            )
        )
        run.policy.bump_version()
    metrics["time/train"] = time.perf_counter() - t0
    sampled = metrics["episode/sampled_tokens"] * metrics["episodes"]
    metrics["tokens_per_s/rollout"] = sampled / max(metrics["time/rollout"], 1e-9)
    metrics["tokens_per_s/train"] = metrics.get("trained_tokens", 0.0) / max(
        metrics["time/train"], 1e-9
    )
    metrics["policy_version"] = float(run.policy.version)
    run.step += 1
    return metrics


def load_sft_weights(run: Run) -> bool:
    """Load the SFT warm start (``RUN_DIR/sft/trainable.safetensors``) into the policy when SFT
    is enabled and its weights exist; returns whether it did."""
    sft = Path(run.cfg.run_dir) / SFT_WEIGHTS
    if not (run.cfg.sft.enabled and sft.is_file()):
        return False
    load_trainable(run.policy.model, load_file(str(sft)))
    return True


def run_eval(run: Run, split: str | None = None) -> dict[str, Any]:
    """Held-out evaluation with the eval config (same seeds every time: before/after pairs)."""
    from coderl.eval.passk import evaluate

    cfg = run.cfg
    tasks = run.env.tasks(split or cfg.tasks.heldout_split)[: cfg.eval.tasks]
    params = _sampling(cfg, cfg.seed + EVAL_SEED_OFFSET, cfg.eval.temperature)
    res = evaluate(
        run.env,
        run.policy,
        tasks,
        samples=cfg.eval.samples,
        ks=cfg.eval.k,
        params=params,
        tasks_per_batch=max(1, cfg.eval.batch_episodes // cfg.eval.samples),
    )
    return res.to_dict()


def _checkpoint(run: Run) -> Path:
    return save_checkpoint(
        run.cfg.run_dir,
        run.step,
        model=run.policy.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        value_head=run.value_head,
        state={"cursor": run.sampler.position, "version": run.policy.version},
        keep=run.cfg.trainer.keep_checkpoints,
    )


def train(cfg: Config, *, resume: bool = False) -> Path:
    """Run (or, with ``resume``, continue) training as configured; returns the run directory.

    Writes ``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``, ``tb/`` and ``checkpoints/`` under
    ``cfg.run_dir``.

    Raises:
        FileExistsError: not ``resume`` and ``cfg.run_dir`` holds a previous run's checkpoints.
        FileNotFoundError: ``resume`` and there is no complete checkpoint.
    """
    run_dir = Path(cfg.run_dir)
    if not resume:
        ensure_new_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    run = setup_run(cfg, resume=resume, load_sft=False)
    logger = MetricsLogger(run_dir, resume_step=run.step, tensorboard=cfg.tensorboard)
    if run.step == 0 and not resume:
        warm = Path(cfg.run_dir) / SFT_WEIGHTS
        if cfg.eval.before_after and cfg.eval.before_sft and cfg.sft.enabled and warm.is_file():
            logger.log_eval(0, {**run_eval(run), "phase": "base"})  # the model before SFT
        sft = load_sft_weights(run)
        if cfg.eval.before_after:
            logger.log_eval(0, {**run_eval(run), "phase": "sft" if sft else "start"})
    with progress_bar(cfg.progress) as bar:
        job = bar.add_task("train", total=cfg.trainer.steps, completed=run.step, status="")
        while run.step < cfg.trainer.steps:
            metrics = training_step(run)
            logger.log(run.step, metrics)
            status = f"reward {metrics['reward/mean']:.3f}"
            bar.update(job, advance=1, status=status)
            last = run.step == cfg.trainer.steps
            if (cfg.eval.every and run.step % cfg.eval.every == 0 and not last) or (
                last and cfg.eval.before_after
            ):
                logger.log_eval(run.step, run_eval(run))
            if run.step % cfg.trainer.checkpoint_every == 0 or last:
                _checkpoint(run)
    logger.close()
    return run_dir
