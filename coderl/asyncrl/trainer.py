"""The real trainer and environment behind the async seams, all through
:mod:`coderl.train.pipeline` (the same reward samples, masks, advantages, batch and metrics as
``coderl train``) and :mod:`coderl.train.run` (the same task order, checkpoints and resume).

- :class:`EnvSampler` (a :class:`Sampler`): its own policy copy plus the configured environment;
  one rollout = ``rollout.group_size`` episodes of each of its jobs' tasks through ``env.rollout``
  (the harness), scored by :func:`coderl.train.pipeline.score` (grading, failure attribution,
  rewards). Weights are picked up between turns by wrapping the policy: every ``generate`` call
  (one turn of the rollout's episodes) first asks for newer weights when ``weight_sync="turn"``
  or ``inflight.enabled``, and with ``inflight.enabled`` again every ``inflight.chunk_tokens``
  decode steps inside the call (in-flight weight updates; torch engine only).
- :class:`TrainLearner` (a :class:`Learner`): :func:`coderl.train.pipeline.make_batch` (advantages
  by group, masked episodes left out) and :func:`coderl.train.step.train_step`, whose importance
  weights (``algorithm.importance``, ``algorithm.old_logp="trainer"``) correct for staleness with
  the stored behaviour logprobs (AReaL's decoupled objective, Fu et al. 2025, Eq. 5).
  Before the batch it feeds the groups' outcomes to the run's task sampler
  (:mod:`coderl.train.sampling`: a pool's pass-rate estimates) and logs
  :func:`coderl.train.signal.rollout_metrics`, as ``coderl train`` does after scoring.
- :func:`train_async`: ``coderl train-async``, writing the same ``metrics.jsonl``, TensorBoard logs
  and checkpoints as ``coderl train`` (plus the task ledger).

With ``engine.kind=vllm`` the learner owns the rollout engine (:attr:`coderl.train.run.Run.engine`,
one vLLM server) and syncs it after every step, before the new version is published; the workers
(``async.local_mode=thread``) sample through that one server, each holding the version it loaded
(:class:`coderl.policy.rollout.PinnedVersion`), so vLLM batches all workers' requests
continuously. Process and Ray workers cannot share it yet (the adapter of each version is known
only to the learner's client): those settings raise.

Not supported (it raises): dynamic sampling (zero-variance group filtering) of ``coderl train``.
With ``eval.before_after`` it starts and ends with ``coderl train``'s held-out evaluation (the
same code: :func:`coderl.train.run.run_eval` into ``eval.jsonl``, the end one with the collapse
check), and ``coderl train-async`` prints the same held-out summary; ``eval.every`` does not
apply (no evaluation between steps): evaluate its checkpoints with ``coderl eval``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from coderl.asyncrl.buffer import TaskStream
from coderl.asyncrl.loop import AsyncRunner
from coderl.asyncrl.types import BetweenTurns, Episode, Group, Job, Weights
from coderl.config import AsyncConfig, Config, anchored, dump_config, load_config
from coderl.envs import build_environment
from coderl.eval.observers import default_observers
from coderl.metrics import check_step_measured, run_logger
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.threads import use_threads
from coderl.progress import PhaseProgress
from coderl.rundir import ensure_new_run, run_lock
from coderl.train import pipeline as P
from coderl.train.checkpoint import load_trainable, trainable_state
from coderl.train.heldout import log_eval_with_alarm, log_extra_evals, without_heldout_evals
from coderl.train.interrupt import deferred_interrupts
from coderl.train.run import (
    Run,
    UpdateCount,
    advance_version,
    build_policy,
    close_run,
    optimize,
    restore,
    run_eval,
    save,
    setup_run,
    step_status,
    sync_engine,
)
from coderl.train.sampling import TaskSampler
from coderl.train.signal import prepass, rollout_metrics


def task_stream(tasks: list[Any], seed: int) -> TaskStream:
    """Index -> ``(task.id, task)``: the task order of ``coderl train``
    (:meth:`coderl.train.sampling.TaskSampler.at`).

    Raises:
        ValueError: ``tasks`` is empty.
    """
    return TaskSampler(tasks, seed).at


def check_supported(cfg: Config) -> None:
    """Raises ValueError for settings of ``coderl train`` that the async driver lacks."""
    if cfg.dynamic_sampling.mode != "off":
        raise ValueError("dynamic_sampling is not supported by train-async; set it to 'off'")
    a = cfg.async_
    if cfg.engine.kind == "vllm" and a.inflight.enabled:
        raise ValueError(
            "async.inflight.enabled with engine.kind=vllm: in-flight weight updates are "
            "implemented by the torch engine only; set engine.kind=torch or turn inflight off"
        )
    if cfg.engine.kind == "vllm" and (a.backend, a.local_mode) != ("local", "thread"):
        raise ValueError(
            f"engine.kind=vllm with async.backend={a.backend} (local_mode={a.local_mode}): the "
            "workers share the learner's vLLM server only as threads; set async.backend=local "
            "async.local_mode=thread, or engine.kind=torch for process or Ray workers"
        )
    if cfg.engine.kind == "vllm" and not cfg.model.lora:
        raise ValueError(
            "engine.kind=vllm with model.lora=false: a full-weight sync replaces the one set of "
            "weights the server holds, so workers cannot keep sampling the version they hold "
            "while the learner syncs the next; use model.lora=true, engine.kind=torch, or "
            "coderl train"
        )


def resolve(cfg: Config) -> AsyncConfig:
    """``cfg.async_`` with its defaults filled from the training config: ``groups_per_step`` and
    ``tasks_per_rollout`` default to ``tasks.tasks_per_step`` (one step = one rollout, seeded as
    ``coderl train`` seeds it)."""
    a, n = cfg.async_, cfg.tasks.tasks_per_step
    return a.model_copy(
        update={
            "groups_per_step": a.groups_per_step or n,
            "tasks_per_rollout": a.tasks_per_rollout or n,
        }
    )


class _TurnSyncPolicy:
    """The worker's sampler as the harness sees it: each ``generate`` (one turn) first calls
    ``between_turns``, which loads newer weights when turn-level sync (or in-flight updates)
    is on; with ``chunk_tokens > 0`` (``async.inflight``) it is also called between decode
    chunks of the turn (:meth:`coderl.policy.local.LocalPolicy.generate`). Anything else (the
    tokenizer) comes from the worker's policy."""

    def __init__(
        self, sampler: Any, policy: Any, between_turns: BetweenTurns, chunk_tokens: int = 0
    ) -> None:
        self._sampler, self._policy, self._between_turns = sampler, policy, between_turns
        self._chunk_tokens = chunk_tokens

    @property
    def version(self) -> int:
        return int(self._sampler.version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self._between_turns()
        if not self._chunk_tokens:
            out: list[Completion] = self._sampler.generate(prompts, params)
            return out
        return list(
            self._sampler.generate(
                prompts,
                params,
                between_chunks=self._between_turns,
                chunk_tokens=self._chunk_tokens,
            )
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


class EnvSampler:
    """Rollout side on the configured policy and environment (one per worker).

    Args:
        shared: with ``engine.kind=vllm``, the learner's engine
            (:class:`coderl.policy.rollout.VLLMRollout`): this worker samples through it and
            keeps its own policy copy only for the tokenizer and the reference (KL reward).
    """

    def __init__(self, cfg: Config, shared: Any = None) -> None:
        check_supported(cfg)
        if cfg.engine.kind == "vllm" and shared is None:
            raise ValueError("engine.kind=vllm: the worker needs the learner's engine (shared=)")
        self.cfg = cfg
        use_threads(cfg.threads)  # a process or Ray worker: its own process's threads
        self.env = build_environment(cfg)
        self.policy = build_policy(cfg)
        self.client = shared.pinned() if cfg.engine.kind == "vllm" else None

    def load_weights(self, version: int, weights: Weights) -> None:
        """Torch: copy ``weights`` into the worker's policy. vLLM: hold ``version`` on the
        shared server (the learner synced it before publishing); the weights are not needed."""
        if self.client is not None:
            self.policy.version = self.client.load(version)
            return
        load_trainable(self.policy.model, weights)
        self.policy.version = version

    def rollout(self, job: Job, between_turns: BetweenTurns) -> list[Episode]:
        return self.rollout_batch([job], between_turns)[0]

    def rollout_batch(self, jobs: list[Job], between_turns: BetweenTurns) -> list[list[Episode]]:
        """The jobs' groups from one ``env.rollout`` call seeded by ``jobs[0].seed``; each
        episode's ``info`` is :func:`coderl.train.pipeline.episode_info` (validity, failure kind,
        reward breakdown) and its ``reward`` the total (NaN where masked)."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        tasks = [j.task for j in jobs]
        params = P.sampling_params(cfg, jobs[0].seed)
        inflight = cfg.async_.inflight
        chunk = inflight.chunk_tokens if inflight.enabled else 0
        policy = _TurnSyncPolicy(self.client or self.policy, self.policy, between_turns, chunk)
        records = self.env.rollout(policy, tasks, params, G)
        owners = [t for t in tasks for _ in range(G)]
        keys = [P.group_key(j.task_id, j.index) for j in jobs for _ in range(G)]
        scored = P.score(self.env, self.policy, cfg, owners, keys, records, default_observers())
        episodes = [
            Episode(ep.task_id, ep.trajectory, total, info)
            for ep, total, info in zip(
                scored.episodes, scored.rewards.totals, scored.infos, strict=True
            )
        ]
        return [episodes[k * G : (k + 1) * G] for k in range(len(jobs))]


def _info(ep: Episode) -> dict[str, Any]:
    """The episode's pipeline info; a sampler that gives none gets the minimal one, by the
    pipeline's rule: masked when its reward is not finite, its info says ``valid: False``, or it
    failed for an infra reason (``failure="infra"`` or ``finish_reason="error"``)."""
    if "breakdown" in ep.info:
        return ep.info
    info = ep.info
    failure = info.get("failure") or ("infra" if info.get("finish_reason") == "error" else None)
    valid = bool(info.get("valid", True)) and math.isfinite(ep.reward) and failure != "infra"
    return {
        "valid": valid,
        "total": ep.reward,
        "resolved": bool(info.get("resolved", False)),
        "failure": failure,
        "failure_reason": info.get("failure_reason", ""),
        "sampled_tokens": sum(s.num_sampled for s in ep.trajectory.segments),
        "untrained_tokens": sum(s.num_sampled - s.num_trainable for s in ep.trajectory.segments),
        "truncated": False,
        "turns": int(info.get("turns", 1)),
        "segments": len(ep.trajectory.segments),
        "broken_tool_calls": 0,
        "no_action_turns": 0,
        "summaries": 0,
        "breakdown": {},
        "hack_flags": [],
    }


class TrainLearner:
    """Trainer side: the pipeline's batch building and the trainer step on async groups."""

    def __init__(self, cfg: Config) -> None:
        check_supported(cfg)
        self.run = setup_run(cfg)
        self.observers = default_observers()  # what coderl train registers (the workers' too)

    @property
    def version(self) -> int:
        return int(self.run.policy.version)

    @property
    def steps(self) -> int:
        return int(self.run.step)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step; every group keeps its own advantage baseline (the same task may
        appear twice in an async batch, from different epochs); masked episodes (infra failures,
        reward-term failures) are left out of the loss and of their group's baseline."""
        run, cfg = self.run, self.run.cfg
        eps = [(g, ep) for g in groups for ep in g.episodes]
        infos = [_info(ep) for _, ep in eps]
        keys = [P.group_key(ep.task_id, g.job.index) for g, ep in eps]
        owners = [g.job.task for g, _ in eps]
        run.sampler.observe(owners, infos)  # as coderl train does after scoring
        check_step_measured(run.step + 1, infos)  # the step it becomes (from 1)
        metrics: dict[str, float] = rollout_metrics(run.sampler, owners, keys, infos)
        metrics.update(P.step_metrics(infos, cfg))
        batch = P.make_batch(
            cfg,
            run.policy,
            run.value_head,
            [ep.trajectory for _, ep in eps],
            [ep.reward for _, ep in eps],
            [bool(x["valid"]) for x in infos],
            keys,
        )
        metrics.update(optimize(run, batch))
        run.step += 1
        run.sampler.step = run.step  # the tasks issued next belong to this step
        # a version per update (none without one), served before the runner publishes it
        metrics.update(advance_version(run, metrics))
        metrics["policy_version"] = float(run.policy.version)
        metrics.update(P.observe_step(self.observers, cfg, run.step, infos))
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
        sync_engine(run)


def load_configs(path: str | None, overrides: list[str]) -> tuple[Config, AsyncConfig]:
    """:func:`coderl.config.load_config` and its resolved ``async`` section (:func:`resolve`).

    Raises:
        ConfigError: a missing file, unknown keys or bad values (naming the dotted key).
    """
    cfg = load_config(path, overrides)
    return cfg, resolve(cfg)


def _checkpoint(run: Run, runner: AsyncRunner) -> int:
    """Save ``run`` between steps with the runner's task ledger (its outstanding groups are
    re-issued on resume); returns the step saved."""
    run.sampler.position = _cursor(runner)
    ledger = runner.ledger
    pending = [*ledger.outstanding, *(i for i, _ in ledger.retry)]
    run.sampler.forget_before(min(pending, default=ledger.next_index))
    save(run, ledger=ledger.state_dict())
    return run.step


def _cursor(runner: AsyncRunner) -> int:
    """Tasks trained on or dropped so far (``coderl train``'s data cursor at a step boundary)."""
    ledger = runner.ledger
    return ledger.next_index - len(ledger.outstanding) - len(ledger.retry)


def train_async(
    cfg: Config, acfg: AsyncConfig | None = None, *, resume: bool = False
) -> dict[str, Any]:
    """Train ``cfg.trainer.steps`` steps asynchronously with ``acfg`` (None: ``cfg.async_``,
    resolved); logs like ``coderl train`` and writes checkpoints every
    ``trainer.checkpoint_every`` steps with the task ledger in ``state.json``. Returns the run
    summary (staleness histogram, dropped groups, idle fractions...).

    Raises:
        ValueError: unsupported settings (see :func:`check_supported`), or ``resume`` from a
            checkpoint of ``coderl train`` (no task ledger).
        FileNotFoundError: ``resume`` without a complete checkpoint.
        FileExistsError: not ``resume`` and ``cfg.run_dir`` holds a previous run's checkpoints
            or logs, or another process writes to it (:class:`coderl.rundir.RunDirBusy`).
    """
    acfg = resolve(cfg.model_copy(update={"async_": acfg})) if acfg else resolve(cfg)
    with run_lock(cfg.run_dir, "coderl train-async"):  # one writer at a time
        return _train_async(cfg, acfg, resume)


def _train_async(cfg: Config, acfg: AsyncConfig, resume: bool) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    if not resume:  # a resumed run's config.yaml changes only through coderl.train.resume
        ensure_new_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(
            dump_config(anchored(cfg.model_copy(update={"async_": acfg})))
        )
    workers_cfg = cfg.model_copy(update={"async_": acfg})  # the section the runner reads
    check_supported(workers_cfg)  # here, not first inside a worker
    learner = TrainLearner(cfg)
    run = learner.run
    saved = [run.step]  # the newest checkpoint's step

    def on_step(runner: AsyncRunner, metrics: dict[str, float]) -> None:
        summary = runner.summary()
        extra = {f"async/{k}": float(v) for k, v in summary.items() if not isinstance(v, dict)}
        logger.log(run.step, {**metrics, **extra})
        updates.saw(metrics)
        bar.advance(status=step_status(metrics))
        if run.step % cfg.trainer.checkpoint_every == 0 or run.step == cfg.trainer.steps:
            saved.append(_checkpoint(run, runner))

    try:
        shared = run.engine if cfg.engine.kind == "vllm" else None  # the workers' one server
        runner = AsyncRunner(
            acfg, learner, _SamplerFactory(workers_cfg, shared), run.sampler.at, seed=cfg.seed,
            on_step=on_step,
        )  # fmt: skip
        if resume:
            state = restore(run)
            if "ledger" not in state:
                raise ValueError(
                    f"{cfg.run_dir} was written by the synchronous `coderl train` (its checkpoint "
                    "has no task ledger); continue it with `coderl train --resume`, or start "
                    "train-async in another run_dir"
                )
            runner.ledger.load_state_dict(state["ledger"])
        else:
            prepass(run)  # tasks.pool.prepass_samples, as coderl train does
        logger = run_logger(cfg, run.step)
        without_heldout_evals(run)  # a source without held-out tasks: said, and none run
        heldout = run.cfg.eval.before_after  # the evaluations coderl train starts and ends with
        if heldout and not resume:
            logger.log_eval(0, {**run_eval(run), "phase": "start"})
            log_extra_evals(run, logger, 0, "start")  # eval.extra_splits, beside it
        steps, at = cfg.trainer.steps, run.step
        updates = UpdateCount(at)
        try:
            with PhaseProgress("train-async", steps, completed=at, enabled=cfg.progress) as bar:
                with runner:
                    summary = runner.run(steps)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the runner is between steps (its loop)
            with deferred_interrupts():
                logger.close()
                if run.step > saved[-1]:  # the last completed step, as coderl train keeps it
                    _checkpoint(run, runner)
            raise
        if heldout and run.step > at:
            log_eval_with_alarm(logger, run.step, run_eval(run))
            log_extra_evals(run, logger, run.step)
        logger.close()
        updates.warn(run.step)  # as coderl train ends
    finally:
        close_run(run)  # a vLLM server coderl started stops, whatever happened
    return summary


class _SamplerFactory:
    """Picklable ``() -> EnvSampler`` for process and Ray workers (``shared``, the learner's
    vLLM engine, is only for thread workers and does not pickle)."""

    def __init__(self, cfg: Config, shared: Any = None) -> None:
        self.cfg = cfg
        self.shared = shared

    def __call__(self) -> EnvSampler:
        return EnvSampler(self.cfg, self.shared)
