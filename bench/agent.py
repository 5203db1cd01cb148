"""Concurrent episodes (``run_episodes``) vs the same episodes one after another (``run_episode``).

Two workloads, each run both ways in the same process on the same tasks:

- ``sampling``: a real policy (``--model``, default ``tiny-random``) for ``--turns`` turns per
  episode; the gain comes from batching one turn of every ready episode into one generate call.
  Broken calls never end these episodes early, so both arms take the same number of turns.
- ``tools``: a ScriptedPolicy whose episodes each run ``sleep --tool-s`` twice then submit; the
  gain comes from running tool calls in a thread pool (sandboxes in parallel).

Prints wall time, generated tokens, turns, episodes per second per arm and the speed-up of the
concurrent arm.

``--reuse`` runs a third workload instead: the sampling episodes (concurrent, ``--turns`` turns,
``--context`` tokens per window, so long episodes self-summarise) once with KV reuse across turns
off and once on, per engine: ``torch`` with ``engine.prefix_cache_mib`` 0 vs its default
(``coderl.policy.prefixcache``), ``vllm`` with ``engine.prefix_caching`` false vs true (the
server's own ``/metrics`` counters). Per arm: tokens prefilled per episode, the episode's
distinct tokens (every token of each of its context windows once), their ratio, wall and
CPU-seconds of this process (the vLLM server's CPU is not counted), and whether both arms
sampled the same tokens. The CPU flags and the load average are printed at the start and the
end. ``--engine torch,vllm`` runs the sampling workload once per rollout engine
(``coderl.policy.rollout.build_engine``; ``vllm`` starts a server from ``.venv-vllm``) in the
same run, so the engines' episodes per second compare directly.

    .venv/bin/python bench/agent.py                # 8 episodes, torch engine
    .venv/bin/python bench/agent.py --episodes 16 --model smollm2-135m --engine torch,vllm
    .venv/bin/python bench/agent.py --reuse --model smollm2-135m --episodes 4 --turns 6
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import requests
import torch
from rich.console import Console
from rich.table import Table

from coderl.agent import EpisodeConfig, ScriptedPolicy, SimpleTask, run_episode, run_episodes
from coderl.agent.parsing import format_hermes
from coderl.config import load_config
from coderl.policy import load_policy
from coderl.policy.rollout import TorchRollout, build_engine
from coderl.sandbox import Sandbox

sys.path.insert(0, str(Path(__file__).parent))
from grading import cpu_flags  # noqa: E402 - a sibling bench script


def open_sandbox(base: Path) -> Sandbox:
    if os.geteuid() == 0 and shutil.which("bwrap"):
        return Sandbox.create(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Sandbox.create(base, backend="local")


def timed(fn: Callable[[], list], label: str) -> dict[str, float | str]:
    start = time.perf_counter()
    episodes = fn()
    wall = time.perf_counter() - start
    return {
        "arm": label,
        "wall_s": wall,
        "tokens": sum(e.stats.generated_tokens for e in episodes),
        "turns": sum(e.stats.turns for e in episodes),
    }


def sampling_config(args, **overrides) -> EpisodeConfig:
    """The sampling workload's episodes: ``--turns`` turns of ``--tokens`` tokens, never ended
    early by broken calls."""
    return EpisodeConfig(
        max_turns=args.turns,
        max_tokens_per_turn=args.tokens,
        max_consecutive_broken_calls=10**6,
        toolsets={"repo": ("read_file", "submit")},
        instructions="Fix the bug.",
        seed=0,
        **overrides,
    )


def bench_tasks(n: int) -> list[SimpleTask]:
    return [
        SimpleTask(f"bench-{i}", f"TASK bench-{i}: fix add() in pkg/calc.py.") for i in range(n)
    ]


def run_both(policy, base: Path, n: int, cfg: EpisodeConfig) -> list[dict[str, float | str]]:
    tasks = bench_tasks(n)
    rows = []
    for label, concurrent in (("one by one", False), ("concurrent", True)):
        boxes = [open_sandbox(base) for _ in range(n)]
        jobs = list(zip(tasks, boxes, strict=True))
        if concurrent:
            rows.append(timed(lambda jobs=jobs: run_episodes(policy, jobs, cfg), label))
        else:
            rows.append(
                timed(lambda jobs=jobs: [run_episode(policy, t, b, cfg) for t, b in jobs], label)
            )
        for box in boxes:
            box.close()
    return rows


def prefilled(engine) -> int:
    """Prompt tokens the engine has run through the model so far (not read from a cache)."""
    if isinstance(engine, TorchRollout):
        return engine.policy.engine.prefill_stats["prefilled_tokens"]
    text = requests.get(f"{engine.engine.url}/metrics", timeout=10).text

    def total(name: str) -> float:
        pattern = rf"^{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$"
        return sum(float(v) for v in re.findall(pattern, text, flags=re.M))

    return int(total("vllm:prompt_tokens") - total("vllm:prompt_tokens_cached"))


def reuse_arm(engine, base: Path, n: int, cfg: EpisodeConfig) -> dict[str, object]:
    """The sampling episodes once through ``engine``, with its prefill count and timings."""
    tasks = bench_tasks(n)
    boxes = [open_sandbox(base) for _ in range(n)]
    before = prefilled(engine)
    start, cpu = time.perf_counter(), time.process_time()
    episodes = run_episodes(engine, list(zip(tasks, boxes, strict=True)), cfg)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    for box in boxes:
        box.close()
    segments = [s for e in episodes for s in e.trajectory.segments]
    return {
        "prefilled": (prefilled(engine) - before) / n,
        "distinct": sum(len(s) for s in segments) / n,
        "windows": len(segments) / n,
        "turns": sum(e.stats.turns for e in episodes) / n,
        "wall_s": wall,
        "cpu_s": cpu,
        "ids": [s.token_ids for s in segments],
        "cache_mib": cache_peak_mib(engine),
    }


def cache_peak_mib(engine) -> str:
    """The most KV the in-process prefix cache held at once (MiB); '-' for a vLLM server."""
    if not isinstance(engine, TorchRollout):
        return "-"
    cache = engine.policy.engine.prefix_cache
    return f"{cache.peak_nbytes / 2**20:.0f}" if cache is not None else "0"


def run_reuse(args, policy, base: Path) -> None:
    """The ``--reuse`` workload (see the module docstring)."""
    cfg = sampling_config(args, context_budget=args.context, summary_max_tokens=args.tokens)
    print(f"cpu: {cpu_flags()}; load {os.getloadavg()}; torch threads {args.threads}")
    table = Table(
        title=f"KV reuse across turns: {args.episodes} episodes x {args.turns} turns, "
        f"{args.tokens} tokens per turn, {args.context}-token windows, model {args.model}"
    )
    cols = ("engine", "reuse", "prefill/ep", "distinct/ep", "prefill/distinct", "windows/ep")
    more = ("turns/ep", "wall s", "cpu s", "wall ratio", "cpu ratio", "same ids", "cache MiB")
    for col in (*cols, *more):
        table.add_column(col, justify="right")
    for kind in args.engine.split(","):
        arms = []
        for on in (False, True):
            over = [f"model.name={args.model}", "model.lora=false", f"engine.kind={kind}"]
            over += [f"engine.prefix_caching={on}", f"engine.prefix_cache_mib={1024 if on else 0}"]
            engine = build_engine(load_config(None, over), policy, training=False)
            try:
                arms.append(reuse_arm(engine, base, args.episodes, cfg))
            finally:
                engine.close()
        off = arms[0]
        for on, row in zip(("off", "on"), arms, strict=True):
            table.add_row(
                kind,
                on,
                f"{row['prefilled']:.0f}",
                f"{row['distinct']:.0f}",
                f"{float(row['prefilled']) / float(row['distinct']):.2f}",
                f"{row['windows']:.1f}",
                f"{row['turns']:.1f}",
                f"{row['wall_s']:.1f}",
                f"{row['cpu_s']:.1f}",
                f"{float(row['wall_s']) / float(off['wall_s']):.2f}",
                f"{float(row['cpu_s']) / float(off['cpu_s']):.2f}",
                "yes" if row["ids"] == off["ids"] else "no",
                str(row["cache_mib"]),
            )
    Console(width=200).print(table)
    print(f"load at the end {os.getloadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="max new tokens per turn")
    ap.add_argument(
        "--tool-s", type=float, default=0.5, help="seconds each scripted tool call sleeps"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--engine", default="torch", help="comma-separated rollout engines: torch, vllm"
    )
    ap.add_argument("--reuse", action="store_true", help="KV reuse on vs off (see above)")
    ap.add_argument("--context", type=int, default=1536, help="--reuse: tokens per window")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="coderl-bench-agent-"))
    base = tmp / "repo"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")

    policy = load_policy(args.model, reference=False)
    if args.reuse:
        run_reuse(args, policy, base)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    cfg = sampling_config(args)
    results = {}
    for kind in args.engine.split(","):
        over = [f"model.name={args.model}", "model.lora=false", f"engine.kind={kind}"]
        engine = build_engine(load_config(None, over), policy, training=False)
        try:
            results[f"sampling ({kind})"] = run_both(engine, base, args.episodes, cfg)
        finally:
            engine.close()

    sleep = format_hermes("run", {"command": f"sleep {args.tool_s}"})
    script = [sleep, sleep, format_hermes("submit", {})]

    def reply(prompt: str) -> str:
        return script[prompt.count("<|im_start|>assistant") - 1]

    scripted = ScriptedPolicy(policy.tokenizer, reply)
    tool_cfg = EpisodeConfig(max_turns=5, toolsets={"repo": ("run", "submit")})
    results["tools"] = run_both(scripted, base, args.episodes, tool_cfg)
    shutil.rmtree(tmp, ignore_errors=True)

    table = Table(
        title=f"{args.episodes} episodes, model {args.model}, {args.threads} torch thread(s)"
    )
    cols = ("workload", "arm", "wall s", "turns", "tokens", "tokens/s", "episodes/s", "speed-up")
    for col in cols:
        table.add_column(col, justify="right")
    for workload, (seq, conc) in results.items():
        for row in (seq, conc):
            speed = float(seq["wall_s"]) / float(row["wall_s"])
            table.add_row(
                workload,
                str(row["arm"]),
                f"{row['wall_s']:.2f}",
                str(row["turns"]),
                str(row["tokens"]),
                f"{float(row['tokens']) / float(row['wall_s']):.1f}",
                f"{args.episodes / float(row['wall_s']):.2f}",
                f"{speed:.2f}x",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
