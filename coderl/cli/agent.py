"""``coderl agent``: run episodes of the harness on a directory and show what happened.

    coderl agent --workspace path/to/repo --task "Fix add() so the tests pass" \\
        --model smollm2-135m --episodes 4 --max-turns 10 --out episodes.json

Each episode gets its own sandbox over ``--workspace`` (never modified). Prints one row per
episode (finish reason, turns, tokens, broken calls, no-action turns, summaries, diff size) and,
with ``--show``, the first episode's messages; ``--out`` writes every episode as JSON (stats,
tool-call log, diff, messages and the token-exact segments).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from coderl.agent.parsing import CALL_FORMATS  # `coderl agent` only: the harness is loaded
    from coderl.agent.tools import TOOLSETS
    from coderl.cli import threads_option

    p = sub.add_parser("agent", help="run agent episodes on a directory in sandboxes")
    p.add_argument("--workspace", required=True, type=Path, help="directory the sandboxes copy")
    p.add_argument("--task", required=True, help="the problem statement given to the agent")
    p.add_argument(
        "--kind", default="repo", choices=sorted(TOOLSETS), help="task kind, selects the tool set"
    )
    p.add_argument("--model", default="smollm2-135m", help="a load_policy spec")
    p.add_argument("--episodes", type=int, default=1, help="episodes to run on the task")
    p.add_argument("--max-turns", type=int, default=10, help="turns per episode")
    p.add_argument("--max-tokens-per-turn", type=int, default=256, help="sampled tokens per turn")
    p.add_argument("--context-budget", type=int, default=4096, help="tokens of one context window")
    p.add_argument("--call-format", default="hermes", choices=sorted(CALL_FORMATS),
                   help="how the model writes tool calls")  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--backend",
        default="bwrap",
        help="sandbox backend: bwrap, container (image from CODERL_CONTAINER_IMAGE) or local",
    )
    p.add_argument("--show", action="store_true", help="print the first episode's messages")
    p.add_argument("--out", type=Path, help="write the episodes as JSON here")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from coderl.agent.episode import EpisodeConfig, SimpleTask
    from coderl.agent.runner import run_episodes
    from coderl.cli.tasks import writable
    from coderl.policy import load_policy
    from coderl.sandbox import Sandbox

    if args.out:  # before the model loads
        writable(args.out, args.force)
    if not args.workspace.is_dir():  # before the model loads
        raise FileNotFoundError(f"--workspace {args.workspace} is not a directory that exists")
    cfg = EpisodeConfig(
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
        context_budget=args.context_budget,
        call_format=args.call_format,
        temperature=args.temperature,
        seed=args.seed,
    )
    policy = load_policy(args.model, reference=False)
    task = SimpleTask("cli", args.task, args.kind)
    boxes = [Sandbox.create(args.workspace, backend=args.backend) for _ in range(args.episodes)]
    try:
        episodes = run_episodes(policy, [(task, box) for box in boxes], cfg)
    finally:
        for box in boxes:
            box.close()

    console = Console()
    table = Table(title=f"{len(episodes)} episode(s), model {args.model}")
    cols = (
        "episode",
        "finish",
        "turns",
        "tokens",
        "broken",
        "no-action",
        "summaries",
        "diff lines",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for ep in episodes:
        s = ep.stats
        table.add_row(
            ep.episode_id,
            s.finish_reason,
            str(s.turns),
            str(s.generated_tokens),
            str(s.broken_tool_calls),
            str(s.no_action_turns),
            str(s.summaries),
            str(len(ep.diff.splitlines())),
        )
    console.print(table)
    if args.show and episodes:
        for window in episodes[0].transcripts:
            for m in window:
                console.rule(m["role"])
                console.print(m["content"], markup=False, highlight=False)
    if args.out:
        args.out.write_text(json.dumps([dataclasses.asdict(ep) for ep in episodes], indent=1))
        console.print(f"wrote {args.out}")
    return 0 if all(ep.error is None for ep in episodes) else 1
