"""What a training run holds between steps, and the one way to build, checkpoint, restore and
evaluate it; shared by ``coderl train``, ``coderl train-async``, ``coderl sft`` and
``coderl eval`` (none of them imports another's recipe).

The run's rollout engine (:func:`coderl.policy.rollout.build_engine`, ``cfg.engine``) is built
last, from the weights the run starts with; every later change of the weights outside a step (the
SFT warm start, a restore) re-syncs it, and the loop syncs it after every optimizer step.

Every tensor follows ``trainer.device`` (:func:`resolve_device`): the policy and its reference,
the value head, the optimizer state (created on its parameters' device; restored state is cast
there by ``torch.optim.Optimizer.load_state_dict``) and each step's batch
(:func:`coderl.train.pipeline.make_batch`).

A checkpoint's ``state.json`` holds ``step``, ``version`` (the policy's weights version) and
``cursor`` (tasks handed out so far), ``sampler`` (a pool's or a mix's state, see
:mod:`coderl.train.sampling`); the async driver adds its task ``ledger``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from coderl.config import Config
from coderl.envs import Environment, build_environment
from coderl.envs.registry import check_built
from coderl.eval.passk import check_measured
from coderl.metrics import add_cpu_since, cpu_clock
from coderl.policy.loading import load_policy
from coderl.policy.local import LocalPolicy, LoraSpec
from coderl.policy.rollout import RolloutEngine, build_engine
from coderl.rundir import SFT_WEIGHTS as SFT_WEIGHTS  # where coderl sft writes; RL starts there
from coderl.sandbox.settings import restore_backend, use_backend
from coderl.train.batch import StepBatch
from coderl.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    save_checkpoint,
)
from coderl.train.optim import build_optimizer
from coderl.train.pipeline import advantage_metrics, sampling_params
from coderl.train.sampling import TaskSource, build_sampler
from coderl.train.step import train_step

EVAL_SEED_OFFSET = 1_000_003


def resolve_device(name: str) -> torch.device:
    """The torch device of ``trainer.device``: ``"auto"`` is ``cuda`` when a CUDA device is
    visible, else ``cpu``; anything else is passed to :class:`torch.device` (``"cpu"``,
    ``"cuda"``, ``"cuda:1"``; ``"meta"`` places tensors without data, for placement tests).

    Raises:
        RuntimeError: a CUDA device is named and none is available (torch's own error text).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"trainer.device={name!r} but torch sees no CUDA device")
    return device


def build_policy(cfg: Config, *, reference: bool = True) -> LocalPolicy:
    """The policy of ``cfg.model`` on ``trainer.device``: LoRA adapters (reference = adapter
    disabled) or full fine-tuning (reference = a frozen copy on the same device; none with
    ``reference=False``, e.g. to export or evaluate only). A sharded run's ``cuda`` without an
    index is ``cuda:LOCAL_RANK`` (torchrun's local rank: one GPU per rank, the device
    :func:`coderl.train.distributed.init_distributed` makes current)."""
    m = cfg.model
    lora = LoraSpec(rank=m.lora_r, alpha=m.lora_alpha, dropout=m.lora_dropout) if m.lora else None
    torch.manual_seed(m.seed)  # LoRA initialisation
    device = resolve_device(cfg.trainer.device)
    if cfg.trainer.distributed.enabled and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # a GPU per rank
    return load_policy(m.name, lora=lora, seed=m.seed, device=device, reference=reference)


@dataclass
class Run:
    """Everything a training run holds between steps."""

    cfg: Config
    env: Environment
    policy: LocalPolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: TaskSource | None
    """The task order and data cursor (the async driver's ledger reads tasks from it too);
    ``tasks.sampler`` / ``tasks.mix``, see :mod:`coderl.train.sampling`. None in a run built
    for evaluation only (:func:`setup_run` with ``training=False``)."""
    value_head: nn.Module | None = None
    step: int = 0
    engine: RolloutEngine | None = None
    """What rollouts sample from (``cfg.engine``); synced after every weight change. None until
    :func:`setup_run` builds it (or when built with ``engine=False``)."""
    observers: list[Any] = field(default_factory=list)
    """The :class:`coderl.train.pipeline.StepObserver` s the driver registered."""
    sharded: Any = None
    """The root :class:`coderl.train.distributed.ShardedPolicy` of a sharded run
    (``trainer.distributed.enabled``), else None."""
    extra: dict[str, Any] = field(default_factory=dict)


def setup_run(
    cfg: Config,
    *,
    resume: bool = False,
    load_sft: bool = True,
    engine: bool = True,
    training: bool = True,
) -> Run:
    """Build policy, environment, optimizer and data cursor; restore them from the latest
    checkpoint of ``cfg.run_dir`` when ``resume``; then the rollout engine (``engine=False``:
    none, e.g. to load other weights first and build an evaluation engine). The caller closes
    ``run.engine`` (:func:`close_run`). ``training=False`` (``coderl eval``): no data cursor is
    built, so a task file without training tasks (only held-out ones) is fine.

    Raises:
        FileNotFoundError: ``resume`` and the run has no complete checkpoint.
        ValueError: a split of ``eval.extra_splits`` holds no task (:func:`check_extra_splits`).
        ValueError, coderl.policy.vllm_server.ServerError, coderl.policy.vllm_engine.CanaryError:
            from :func:`coderl.policy.rollout.build_engine`.
    """
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    say = cfg.progress and int(os.environ.get("RANK", "0") or 0) == 0
    if say:  # minutes can pass before the first progress line (tasks, weights, the engine)
        print(f"setup: tasks of {cfg.tasks.source!r}, model {cfg.model.name}...", file=sys.stderr)
    sandbox_before = use_backend(
        cfg.sandbox.backend, cfg.sandbox.image, cfg.sandbox.cli
    )  # close_run restores
    try:
        env = build_environment(cfg)
        if training:
            check_extra_splits(cfg, env)  # before the model loads
            check_built(env, cfg.tasks.train_split)
            if cfg.eval.before_after or cfg.eval.every:
                check_built(env, cfg.tasks.heldout_split, cfg.eval.tasks)
        policy = build_policy(cfg)
        value_head = None
        if cfg.algorithm.advantage == "gae":
            torch.manual_seed(cfg.seed)
            value_head = nn.Linear(policy.model.config.hidden_size, 1).to(policy.device)
        sharded = _shard(cfg, policy, value_head)  # before the optimizer: it takes the shards
        groups: list[dict[str, Any]] = [{"params": policy.trainable_parameters()}]
        if value_head is not None:
            groups.append({"params": list(value_head.parameters()), "lr": cfg.algorithm.value_lr})
        optimizer, scheduler = build_optimizer(groups, cfg.trainer)
        run = Run(
            cfg,
            env,
            policy,
            optimizer,
            scheduler,
            build_sampler(cfg, env) if training else None,
            value_head,
            sharded=sharded,
        )
        run.extra["sandbox_before"] = sandbox_before
        if load_sft and not resume:
            load_sft_weights(run)  # start RL from the SFT warm start
        if resume:
            restore(run)
        if engine:
            run.engine = build_engine(
                cfg, policy
            )  # its first sync: the weights the run starts with
    except BaseException:
        restore_backend(sandbox_before)
        raise
    if say:
        where = f"{policy.device}, engine {cfg.engine.kind}" if engine else str(policy.device)
        print(f"setup: done in {time.perf_counter() - t0:.0f} s ({where})", file=sys.stderr)
    return run


def _shard(cfg: Config, policy: LocalPolicy, value_head: nn.Module | None) -> Any:
    """Shard the policy and value head over the torchrun ranks when
    ``trainer.distributed.enabled`` (:mod:`coderl.train.distributed`); None otherwise.

    Raises:
        ValueError: a sharded run with ``engine.kind`` other than ``torch``.
    """
    if not cfg.trainer.distributed.enabled:
        return None
    if cfg.engine.kind != "torch":
        raise ValueError("trainer.distributed.enabled runs rollouts with engine.kind=torch only")
    from coderl.train import distributed

    world = distributed.init_distributed(cfg.trainer.distributed, policy.device)
    return distributed.shard_policy(policy.model, value_head, world.mesh)


def full_weights(run: Run) -> AbstractContextManager[None]:
    """The block in which rollouts, reference logprobs and evaluations run: in a sharded run
    every weight gathered (:func:`coderl.train.distributed.gathered`, on every rank), else
    nothing to do."""
    if run.sharded is None:
        return nullcontext()
    from coderl.train.distributed import gathered

    return gathered(run.sharded)


def close_run(run: Run) -> None:
    """Close the run's engine (a vLLM server coderl started is stopped) and put back the
    sandbox backend the process had before :func:`setup_run`; idempotent."""
    if run.engine is not None:
        run.engine.close()
        run.engine = None
    restore_backend(run.extra.pop("sandbox_before", {}))


def sync_engine(run: Run) -> dict[str, float]:
    """Push the policy's current weights to the run's engine (canary-checked); its metrics
    (``engine/canary_gap`` for vLLM, none for torch; nothing without an engine).

    Raises:
        coderl.policy.vllm_engine.CanaryError: the engine serves other weights.
    """
    return run.engine.sync(run.policy) if run.engine is not None else {}


def step_status(metrics: dict[str, float]) -> str:
    """A training step's progress status: reward and resolved rate over the episodes it
    measured (``measured_episodes``: every graded episode, dropped groups included), and what it
    did not measure or train on, said as such (never ``reward nan``): groups dropped
    by dynamic sampling (every group dropped: said so, with no update), episodes masked as
    infrastructure failures."""
    n = int(metrics.get("episodes", 0))
    masked = int(metrics.get("reward/masked", 0))
    dropped = int(metrics.get("dynamic/dropped_groups", 0))
    measured = int(metrics.get("measured_episodes", n - masked))
    notes = [f"{dropped} zero-variance groups dropped"] if dropped and n else []
    if masked:
        notes.append(f"{masked} of {n} episodes masked")

    def said() -> str:
        reward, resolved = metrics["reward/mean"], metrics["resolved_rate"]
        return f"reward {reward:.3f} resolved {resolved:.0%} of {measured} episodes"

    if n == 0 and dropped:  # graded, but every group scored the same: no advantage anywhere
        head = f"all {dropped} groups had zero reward variance, dropped (no update)"
        if measured > 0:  # what the rollouts measured, as metrics.jsonl logs it
            head += f": {said()}"
    elif n - masked <= 0:
        head = "no episode measured (no update)"
    else:
        head = said()
        if not has_signal(metrics):
            notes.append("no signal (every advantage 0, or gradient 0)")
    return "; ".join([head, *notes])


def has_signal(metrics: dict[str, float]) -> bool:
    """Whether a step that updated had something to learn from: some advantage not 0
    (``advantage/zero_frac`` < 1) and a gradient not 0 (``grad_norm``). A step without is an
    update in name only (all rewards of every group equal, no dynamic sampling to drop them):
    the optimizer steps while the policy loss has no gradient. True for a step that did not
    update (said otherwise) or whose metrics lack both."""
    if metrics.get("optimizer_steps", 0.0) <= 0:
        return True
    return metrics.get("advantage/zero_frac", 0.0) < 1.0 and metrics.get("grad_norm", 1.0) != 0.0


class UpdateCount:
    """The steps of a run that updated the policy (``optimizer_steps > 0``) and those of them
    with a learning signal (:func:`has_signal`), counted from step ``first`` (where the run
    started or resumed): ``coderl train`` and ``train-async`` both end with :meth:`warn`."""

    def __init__(self, first: int) -> None:
        self.first, self.updates, self.signal = first, 0, 0

    def saw(self, metrics: dict[str, float]) -> None:
        """Count one step by its metrics."""
        updated = metrics.get("optimizer_steps", 0.0) > 0
        self.updates += updated
        self.signal += updated and has_signal(metrics)

    def warn(self, last: int) -> None:
        """Print :func:`no_update_warning` on stderr when steps ran up to ``last`` and none of
        them updated the policy, :func:`no_signal_warning` when some updated and none of those
        had a signal."""
        if last <= self.first:
            return
        if not self.updates:
            print(no_update_warning(self.first, last), file=sys.stderr, flush=True)
        elif not self.signal:
            print(no_signal_warning(self.first, last), file=sys.stderr, flush=True)


def no_signal_warning(first: int, last: int) -> str:
    """The line a run ends with when steps ``first + 1 .. last`` updated but none of them had a
    learning signal (:func:`has_signal`): nothing was learned from the rewards."""
    return (
        f"WARNING: none of steps {first + 1}-{last} had a learning signal (every advantage 0 "
        "or gradient 0 in each: the rewards of every group were all equal); the optimizer "
        "stepped but nothing was learned from the rewards (metrics.jsonl: "
        "signal/groups_with_signal, advantage/zero_frac, grad_norm; dynamic_sampling.mode "
        "drops such groups, harder or easier tasks give them variance)"
    )


def no_update_warning(first: int, last: int) -> str:
    """The line a run ends with when none of steps ``first + 1 .. last`` updated the policy
    (``optimizer_steps`` 0 in each: every group dropped by dynamic sampling, every episode
    masked, or no episode with a token to train on): the weights it saved are the ones it
    started from."""
    return (
        f"WARNING: none of steps {first + 1}-{last} updated the policy (optimizer_steps 0 in "
        "each: every group had zero reward variance and was dropped, every episode was "
        "masked, or no episode had a token to train on); the checkpoints hold the weights the "
        "run started from and policy_version stayed where it was (metrics.jsonl: "
        "dynamic/dropped_groups, reward/masked, sequences)"
    )


def save(run: Run, **state: Any) -> Path:
    """Checkpoint ``run`` at its step (``state``: extra JSON entries, e.g. the async ledger);
    a sampler with state beyond the cursor (pool, mix) saves it as ``sampler``."""
    assert run.sampler is not None  # built for training
    sampler = {"sampler": s} if (s := run.sampler.state_dict()) else {}
    extra = {"cursor": run.sampler.position, "version": run.policy.version, **sampler, **state}
    if run.sharded is not None:
        from coderl.train.distributed import save_sharded_checkpoint

        return save_sharded_checkpoint(
            run.cfg.run_dir,
            run.step,
            root=run.sharded,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            state=extra,
            keep=run.cfg.trainer.keep_checkpoints,
        )
    return save_checkpoint(
        run.cfg.run_dir,
        run.step,
        model=run.policy.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        value_head=run.value_head,
        state=extra,
        keep=run.cfg.trainer.keep_checkpoints,
    )


def restore(run: Run) -> dict[str, Any]:
    """Load the latest checkpoint of ``run.cfg.run_dir`` into ``run``; returns its state.

    Raises:
        FileNotFoundError: no complete checkpoint.
    """
    if run.sharded is not None:  # DCP, at any world size
        from coderl.train.distributed import load_sharded_checkpoint

        state = load_sharded_checkpoint(
            latest_checkpoint(run.cfg.run_dir),
            root=run.sharded,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
        )
    else:
        state = load_checkpoint(
            latest_checkpoint(run.cfg.run_dir),
            model=run.policy.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            value_head=run.value_head,
        )
    run.step, run.policy.version = int(state["step"]), int(state["version"])
    assert run.sampler is not None  # built for training
    run.sampler.position = int(state.get("cursor", 0))
    run.sampler.load_state_dict(state.get("sampler", {}))
    run.sampler.step = run.step
    sync_engine(run)
    return state


def load_sft_weights(run: Run) -> bool:
    """Load the SFT warm start (``RUN_DIR/sft/trainable.safetensors``) into the policy when SFT
    is enabled and its weights exist; returns whether it did."""
    sft = Path(run.cfg.run_dir) / SFT_WEIGHTS
    if not (run.cfg.sft.enabled and sft.is_file()):
        return False
    if run.sharded is not None:  # every rank reads the whole file and keeps its shard
        from coderl.train.distributed import load_full_trainable

        load_full_trainable(run.sharded, load_file(str(sft)))
    else:
        load_trainable(run.policy.model, load_file(str(sft)))
    sync_engine(run)
    return True


def check_extra_splits(cfg: Config, env: Environment) -> None:
    """Refuse an ``eval.extra_splits`` split that the environment does not have or that holds no
    task (a run would otherwise fail at its first evaluation, after SFT).

    Raises:
        ValueError: one line naming the split and the task source.
    """
    if not (cfg.eval.before_after and cfg.eval.extra_splits):
        return
    for split in cfg.eval.extra_splits:
        try:
            found = env.tasks(split)
        except (KeyError, ValueError) as e:
            raise ValueError(f"eval.extra_splits: {e.args[0] if e.args else e}") from None
        if not found:
            raise ValueError(
                f"eval.extra_splits: split {split!r} of tasks.source={cfg.tasks.source!r} holds "
                "no task"
            )


def run_eval(
    run: Run,
    split: str | None = None,
    episodes_out: list[tuple[Any, bool]] | None = None,
    samples: int | None = None,
) -> dict[str, Any]:
    """Held-out evaluation with the eval config (same seeds every time: before/after pairs),
    sampled through ``run.engine`` (the policy's own sampler when the run has none);
    ``episodes_out`` collects each episode's view and outcome (see
    :func:`coderl.eval.passk.evaluate`).

    ``samples``: n per task (None: ``eval.samples``). pass@1 and pass@n (the collapse check) are
    always reported, besides the ``eval.k`` up to n. The record also holds ``temperature`` and
    ``time_s`` (wall seconds of the evaluation, rollouts and grading) and ``perf``: its CPU
    seconds (``cpu_s/eval``, ``cpu_s/eval_children``, :func:`coderl.metrics.add_cpu_since`) and,
    with the torch sampler, the deltas of its engine's counters (``engine/<counter>``, as in the
    step metrics), for ``bench/demo_profile.py``.

    A sharded run with ``trainer.distributed.split_rollouts``: each rank evaluates its
    contiguous share of the batches of tasks (:func:`coderl.eval.passk.evaluate` seeds a batch
    by its offset in the split, so the episodes are one process's) and every rank summarizes
    the gathered per-task rows; ``time_s`` is this rank's.

    Raises:
        coderl.stats.NothingMeasured: every episode was masked (grading errors, dropped);
            at least half masked prints a warning line on stderr
            (:func:`coderl.eval.passk.check_measured`).
    """
    cfg = run.cfg
    n = samples or cfg.eval.samples
    ks = sorted({1, n, *(k for k in cfg.eval.k if k <= n)})
    t0, clock = time.perf_counter(), cpu_clock()
    counters = getattr(run.engine, "prefill_counters", None)  # the torch sampler's; vLLM: none
    before = counters() if counters is not None else {}
    tasks = run.env.tasks(split or cfg.tasks.heldout_split)[: cfg.eval.tasks]
    per_batch = max(1, cfg.eval.batch_episodes // n)
    lo, hi = 0, len(tasks)
    split_eval = run.sharded is not None and cfg.trainer.distributed.split_rollouts
    if split_eval:
        from coderl.train.distributed import rank_share

        b0, b1 = rank_share(-(-len(tasks) // per_batch))  # whole batches of tasks
        lo, hi = b0 * per_batch, min(b1 * per_batch, len(tasks))
    seed = cfg.seed + EVAL_SEED_OFFSET + lo
    params = sampling_params(cfg, seed, cfg.eval.temperature)
    views = None if episodes_out is None else []
    res = None
    with full_weights(run):  # every rank enters it (a collective), with tasks or without
        if hi > lo or not split_eval:
            res = _evaluate(run, tasks[lo:hi], n, ks, params, per_batch, views)
    if split_eval:
        res, views = _gather_eval(res, views, ks, n)
    assert res is not None  # evaluated above, or gathered
    if episodes_out is not None and views is not None:
        episodes_out.extend(views)
    out = res.to_dict()
    out.update(temperature=cfg.eval.temperature, time_s=time.perf_counter() - t0)
    perf = add_cpu_since({}, "eval", clock)
    if counters is not None:
        perf.update({f"engine/{k}": float(v - before[k]) for k, v in counters().items()})
    out["perf"] = perf
    warning = check_measured(out)  # nothing measured: raises
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return out


def _gather_eval(
    res: Any, views: list[Any] | None, ks: list[int], n: int
) -> tuple[Any, list[Any] | None]:
    """Every rank's share of a split evaluation (``res`` None: this rank had no tasks), summarized
    over the gathered per-task rows: ``(result, views of every rank)``; a collective."""
    from coderl.eval.passk import summarize
    from coderl.train.distributed import gather

    mine = (
        (
            res.per_task,
            res.grading_errors,
            res.dropped_episodes,
            views,
            res.grading_error_examples,
        )
        if res
        else None
    )
    parts = [p for p in gather(mine) if p is not None]
    res = summarize([t for p in parts for t in p[0]], ks, n, sum(p[1] for p in parts))
    res.dropped_episodes = sum(p[2] for p in parts)
    res.grading_error_examples = sorted({e for p in parts for e in p[4]})[:3]
    views = None if views is None else [v for p in parts for v in p[3]]
    return res, views


def _evaluate(
    run: Run,
    tasks: list[Any],
    n: int,
    ks: list[int],
    params: Any,
    per_batch: int,
    episodes_out: list[tuple[Any, bool]] | None,
) -> Any:
    """:func:`coderl.eval.passk.evaluate` of ``tasks`` with a progress bar (the caller
    gathers a sharded run's weights)."""
    from coderl.eval.passk import eval_phase, evaluate, shown_batches
    from coderl.progress import PhaseProgress

    with PhaseProgress(eval_phase("eval", n), len(tasks), enabled=run.cfg.progress) as bar:
        return evaluate(
            run.env,
            run.engine if run.engine is not None else run.policy,
            tasks,
            samples=n,
            ks=ks,
            params=params,
            tasks_per_batch=per_batch,
            episodes_out=episodes_out,
            on_batch=shown_batches(bar, n),
        )


def optimize(run: Run, batch: StepBatch | None) -> dict[str, float]:
    """One optimizer step on ``batch`` (the algorithm-blind :func:`coderl.train.step.train_step`)
    with its advantage metrics; ``None`` (no valid episode) logs an empty step. The one update
    both drivers call; the caller then advances the version (:func:`advance_version`)."""
    if batch is None:
        return {"optimizer_steps": 0.0, "sequences": 0.0, "trained_tokens": 0.0}
    cfg = run.cfg
    metrics = advantage_metrics(batch)
    if run.sharded is not None:  # this rank's share of the batch; gradients summed over ranks
        from coderl.train.distributed import sharded_train_step

        kw = {"temperature": cfg.rollout.temperature, "max_len": run.env.token_budget()}
        step = sharded_train_step(
            run.sharded, run.optimizer, run.scheduler, batch, cfg.algorithm, cfg.trainer, **kw
        )
        return {**metrics, **step}
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
    return metrics


def advance_version(run: Run, step: dict[str, float]) -> dict[str, float]:
    """After :func:`optimize`: a new weight version when its ``step`` metrics say the weights
    changed (``optimizer_steps`` > 0), pushed to the engine before any rollout of it; a step
    that updated nothing (every group dropped, every episode masked) keeps the version and the
    engine's weights. A version counts weight updates: async staleness (versions between
    sampling and training, :mod:`coderl.asyncrl.buffer`) is not inflated by steps that changed
    nothing. Returns the engine's sync metrics (none without an update).

    Raises:
        coderl.policy.vllm_engine.CanaryError: as :func:`sync_engine`.
    """
    if step.get("optimizer_steps", 0.0) <= 0:
        return {}
    run.policy.bump_version()
    return sync_engine(run)
