"""Run many episodes at once: batched sampling across episodes, tool calls in a thread pool.

Every episode is a generator of requests (:func:`coderl.agent.episode.episode_steps`). The runner
runs tool calls in a thread pool and samples in rounds: once no tool call is running, every
episode that is not finished is waiting for a turn, and one ``policy.generate`` call samples
those turns, rows in a fixed order (job order, each continuation right after its parent). So
which prompts share a call, their order and the call's seed follow from the episodes' states
alone, never from which tool call happened to return first: a run samples the same tokens (bit
for bit, on the same machine, given the same tool results) however long its tool calls take,
which is what exact ``--resume`` rests on (a served engine may still split or merge a call's
prompts its own way). The price: a round waits for its slowest tool call (a long test run
holds back the next turn of every episode, not only its own); the tool calls of a round still
run at once.

One generate call serves prompts with different remaining budgets: it is asked for the largest
``max_new_tokens`` of the batch and each completion is cut to its own budget. The first ``m``
tokens of an autoregressive sample are an exact sample with budget ``m``, so the cut completions
(and their logprobs) are what a separate call would have produced in distribution.

An episode that branches (``EpisodeConfig.branch``) yields a ``SpawnRequest``: its continuations
join the episodes being driven (their first turn is sampled in the same call as the parent's
next one, from the same prompt: the engine prefills that prompt once, and the local engine's
prefix cache or vLLM's automatic prefix caching hold the KV of the prefix they share), and each
finished continuation is filed under its parent's ``Episode.branches``.

When an episode ends the runner tells a sampler that keeps KV across calls (a
``forget_prefixes`` method, :meth:`coderl.policy.local.LocalPolicy.forget_prefixes`) that its
context windows will not be extended, so their cache is freed at once.

Not parallel across processes: sampling happens on the caller's thread, tools in threads of this
process (sandbox commands are separate processes, so they do run in parallel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

from coderl.agent.episode import (
    AgentTask,
    Branch,
    ContextExhausted,
    Episode,
    EpisodeConfig,
    SampleRequest,
    SpawnRequest,
    Step,
    episode_steps,
)
from coderl.agent.tools import TOOLS, Tool
from coderl.policy.base import (
    Completion,
    Policy,
    SamplingParams,
    check_finish_reason,
    context_limit,
)
from coderl.pools import thread_pool
from coderl.progress import inner_progress
from coderl.sandbox.base import Sandbox


def _cut(c: Completion, budget: int) -> Completion:
    if len(c.token_ids) <= budget:
        return c
    return replace(
        c,
        token_ids=c.token_ids[:budget],
        logprobs=c.logprobs[:budget],
        token_versions=c.token_versions[:budget],  # per-token versions stay aligned
        finish_reason="length",
    )


def sample_batch(
    policy: Policy, requests: Sequence[SampleRequest], cfg: EpisodeConfig, call_index: int
) -> list[Completion]:
    """One ``policy.generate`` call for all ``requests``; each completion cut to its budget.

    The seed, when ``cfg.seed`` is set, is ``cfg.seed + call_index`` so that successive batches
    do not replay the same random stream.

    Raises:
        RuntimeError: the policy returned a different number of completions than prompts.
        ValueError: a completion's finish reason is not ``"stop"`` or ``"length"``.
    """
    stops = sorted({t for r in requests for t in r.stop_token_ids})
    params = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=max(r.max_new_tokens for r in requests),
        stop_token_ids=tuple(stops),
        seed=None if cfg.seed is None else cfg.seed + call_index,
    )
    completions = policy.generate([r.prompt_ids for r in requests], params)
    if len(completions) != len(requests):
        raise RuntimeError(f"policy returned {len(completions)} completions for {len(requests)}")
    return [
        _cut(check_finish_reason(c), r.max_new_tokens)
        for c, r in zip(completions, requests, strict=True)
    ]


def _end_episode(policy: Policy, episode: Episode) -> None:
    """Tell a sampler that keeps KV across calls (``forget_prefixes``, e.g.
    :meth:`coderl.policy.local.LocalPolicy.forget_prefixes`) that no turn will extend this
    episode's context windows, so their cache can go."""
    forget = getattr(policy, "forget_prefixes", None)
    if forget is not None:
        forget([seg.token_ids for seg in episode.trajectory.segments])


def run_episodes(
    policy: Policy,
    jobs: Sequence[tuple[AgentTask, Sandbox]],
    cfg: EpisodeConfig,
    *,
    registry: Mapping[str, Tool] = TOOLS,
    max_workers: int | None = None,
    tokenizer: Any = None,
) -> list[Episode]:
    """Run one episode per ``(task, sandbox)`` pair, all at once; episodes in job order.

    The caller owns the sandboxes (create them before, close them after; the episode's
    ``diff`` is taken before this returns); continuations close their own forks. Episode ids
    are ``"{task.id}/{job index}"``, a continuation's ``"{parent id}@{boundary}.{index}"``.

    Args:
        policy: samples turns; ``policy.tokenizer`` renders the prompts.
        jobs: one ``(task, sandbox)`` per episode; the same task may appear many times (a group).
        cfg: limits, prompts and sampling settings shared by all episodes.
        registry: tool name -> tool; each task kind's tool set is looked up here.
        max_workers: threads for tool calls (default: one per episode, at most 32).
        tokenizer: renders the prompts; default ``policy.tokenizer`` (for policies without one,
            e.g. a remote sampler).

    Raises:
        KeyError: a task kind has no tool set, a tool set names an unknown tool, or
            ``cfg.call_format`` is unknown.
        Whatever ``policy.generate`` raises (it affects every episode of the batch). A prompt
        that reaches the engine's context (:func:`coderl.policy.base.context_limit`) is never
        sent: its episode ends ``finish_reason="context"`` (scored), the batch goes on.
    """
    tok = policy.tokenizer if tokenizer is None else tokenizer
    limit = context_limit(policy)
    gens: dict[int, Step] = {
        i: episode_steps(tok, task, sb, cfg, episode_id=f"{task.id}/{i}", registry=registry)
        for i, (task, sb) in enumerate(jobs)
    }
    done: list[Episode | None] = [None] * len(gens)
    parents: dict[int, tuple[int, int, int]] = {}  # continuation -> (parent, boundary, index)
    order: dict[int, tuple[int, ...]] = {i: (i,) for i in gens}  # a batch's row order
    ready: dict[int, SampleRequest] = {}
    running: dict[Future[Any], int] = {}
    calls = 0
    turns = inner_progress("rollout turn", cfg.max_turns)  # one line per batch of turns
    with thread_pool(max_workers or min(32, max(1, len(gens)))) as pool, turns:

        def advance(i: int, value: Any = None, error: BaseException | None = None) -> None:
            try:
                req = gens[i].throw(error) if error is not None else gens[i].send(value)
            except StopIteration as stop:
                done[i] = stop.value
                _end_episode(policy, stop.value)
                return
            if isinstance(req, SampleRequest):
                ready[i] = req
            elif isinstance(req, SpawnRequest):
                spawn(i, req)
            else:
                running[pool.submit(req.run)] = i

        def spawn(i: int, req: SpawnRequest) -> None:
            for k, child in enumerate(req.children):
                j = len(done)
                parents[j] = (i, req.turn, k)
                order[j] = (*order[i], req.turn, k)
                done.append(child if isinstance(child, Episode) else None)  # failed fork: done
                if not isinstance(child, Episode):
                    gens[j] = child
                    advance(j)
            advance(i)

        for i in range(len(jobs)):
            advance(i)
        while ready or running:
            while running:  # a round ends when no tool call is left: timing cannot shape it
                for fut in wait(running, return_when=FIRST_COMPLETED).done:
                    i = running.pop(fut)
                    error = fut.exception()
                    if error is not None:
                        advance(i, error=error)
                    else:
                        advance(i, fut.result())
            for i in [i for i in ready if limit is not None and len(ready[i].prompt_ids) >= limit]:
                n = len(ready.pop(i).prompt_ids)  # the engine would refuse it, failing the batch
                advance(i, error=ContextExhausted(f"prompt of {n} tokens; context {limit}"))
            if ready:
                batch = sorted(ready, key=order.__getitem__)
                completions = sample_batch(policy, [ready[i] for i in batch], cfg, calls)
                ready.clear()
                calls += 1
                for i, completion in zip(batch, completions, strict=True):
                    advance(i, completion)
                ended = sum(e is not None for e in done[: len(jobs)])
                turns.advance(status=f"episodes done {ended}/{len(jobs)}")
    for j, (i, turn, k) in sorted(parents.items()):  # every generator has returned by now
        parent, child = done[i], done[j]
        assert parent is not None and child is not None
        parent.branches.append(Branch(turn, k, child))
    return [e for e in done[: len(jobs)] if e is not None]


def run_episode(
    policy: Policy,
    task: AgentTask,
    sandbox: Sandbox,
    cfg: EpisodeConfig,
    *,
    registry: Mapping[str, Tool] = TOOLS,
) -> Episode:
    """Run one episode (see :func:`run_episodes`); the caller owns the sandbox."""
    return run_episodes(policy, [(task, sandbox)], cfg, registry=registry)[0]
