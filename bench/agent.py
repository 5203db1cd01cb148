"""Concurrent episodes (``run_episodes``) vs the same episodes one after another (``run_episode``).

Two workloads, each run both ways in the same process on the same tasks:

- ``sampling``: a real policy (``--model``, default ``tiny-random``) for ``--turns`` turns per
  episode; the gain comes from batching one turn of every ready episode into one generate call.
  Broken calls never end these episodes early, so both arms take the same number of turns.
- ``tools``: a ScriptedPolicy whose episodes each run ``sleep --tool-s`` twice then submit; the
  gain comes from running tool calls in a thread pool (sandboxes in parallel).

Prints wall time, generated tokens, turns, episodes per second per arm and the speed-up of the
concurrent arm. ``--engine torch,vllm`` runs the sampling workload once per rollout engine
(``coderl.policy.rollout.build_engine``; ``vllm`` starts a server from ``.venv-vllm``) in the
same run, so the engines' episodes per second compare directly.

    .venv/bin/python bench/agent.py                # 8 episodes, torch engine
    .venv/bin/python bench/agent.py --episodes 16 --model smollm2-135m --engine torch,vllm
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from coderl.agent import EpisodeConfig, ScriptedPolicy, SimpleTask, run_episode, run_episodes
from coderl.agent.parsing import format_hermes
from coderl.config import load_config
from coderl.policy import load_policy
from coderl.policy.rollout import build_engine
from coderl.sandbox import Sandbox


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


def run_both(policy, base: Path, n: int, cfg: EpisodeConfig) -> list[dict[str, float | str]]:
    tasks = [
        SimpleTask(f"bench-{i}", f"TASK bench-{i}: fix add() in pkg/calc.py.") for i in range(n)
    ]
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="coderl-bench-agent-"))
    base = tmp / "repo"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")

    policy = load_policy(args.model, reference=False)
    cfg = EpisodeConfig(
        max_turns=args.turns,
        max_tokens_per_turn=args.tokens,
        max_consecutive_broken_calls=10**6,
        toolsets={"repo": ("read_file", "submit")},
        instructions="Fix the bug.",
        seed=0,
    )
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
