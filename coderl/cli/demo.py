"""``coderl demo``: the main job on the embedded default.

Runs ``coderl train configs/repair.yaml`` (SFT warm start on oracle repairs of the
function-repair training split, then GRPO on SmolLM2-135M-Instruct + LoRA in the agent harness
from the difficulty pool with synthesis inside the loop, the held-out split evaluated after SFT
and after RL; ``--config configs/default.yaml`` is the HumanEval demo of earlier rounds), writes
the report, and prints the run's summary:
held-out pass@1 per phase, the paired RL-only change with its 95% CI, pass@k at the largest k
before and after RL, broken calls before and after, the same for each split of
``eval.extra_splits`` (``eval.extra_splits=[outside]``: the kept-back set of libraries the family
never uses, reported apart; off in the preset), phase times. Every run starts fresh: an existing run directory (an
earlier demo, finished or not) is first moved to ``RUN_DIR.prev``, or ``RUN_DIR.prev2``,
``.prev3``... when that is taken (no earlier run is deleted), so a second ``make demo`` neither
crashes nor resumes or mixes in the previous run; a run directory that a live command holds
(:func:`coderl.rundir.run_lock`, e.g. a ``coderl train`` writing there) is refused with the
line ``train`` gives, before anything is moved. Ctrl-C or SIGTERM in any phase ends in one
line: the last checkpoint and its resume command, or (before the first) the demo command again.
``--self-check``
instead prints the algorithm core's worked examples (seconds, no model).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def self_check() -> list[tuple[str, float, float]]:
    """(check, computed, expected) for the worked examples of the algorithm core."""
    import torch

    from coderl import algorithms as A

    rows: list[tuple[str, float, float]] = []
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    lp = A.token_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    rows.append(("token_logprobs([2,1,0], T=0.5)[0]", float(lp), -0.1429))
    per_token = torch.zeros(2, 10)
    per_token[0, :5] = 2.0
    per_token[1, 0] = 10.0
    mask = per_token > 0
    rows.append(("aggregate token-mean", float(A.aggregate(per_token, mask, "token-mean")), 3.3333))
    rows.append(
        (
            "aggregate seq-mean-token-mean",
            float(A.aggregate(per_token, mask, "seq-mean-token-mean")),
            6.0,
        )
    )
    rows.append(
        (
            "aggregate seq-mean-token-sum-norm",
            float(A.aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=10)),
            1.0,
        )
    )
    _, m = A.policy_loss(
        torch.tensor([[-0.5]]), torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1)
    )
    rows.append(("PPO ratio exp(-0.5 - -1.0)", m["ratio_mean"], 1.6487))
    adv = A.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    rows.append(("GRPO advantage of reward 1 in [1,0,1,0]", float(adv[0]), 0.8660))
    rows.append(("pass@1 with n=4, c=1", A.pass_at_k(4, 1, 1), 0.25))
    rows.append(("pass@4 with n=4, c=1", A.pass_at_k(4, 1, 4), 1.0))
    return rows


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "repair.yaml"


def set_aside(run_dir: Path) -> Path | None:
    """Move an existing ``run_dir`` to the first free ``run_dir.prev``, ``.prev2``, ``.prev3``...
    so that the demo starts fresh and no earlier run is lost; returns where it went (None: there
    was nothing to move)."""
    if not run_dir.exists():
        return None
    n = 1
    while (prev := run_dir.with_name(f"{run_dir.name}.prev{n if n > 1 else ''}")).exists():
        n += 1
    run_dir.rename(prev)
    return prev


def phase_times(name: str, start: tuple[float, float, float]) -> dict[str, float]:
    """``{name}_s`` (wall seconds since ``start``, a :func:`coderl.metrics.cpu_clock` reading),
    ``{name}_cpu_s`` (this process's CPU seconds) and ``{name}_children_cpu_s`` (its reaped
    children's), the entries of ``phases.json``."""
    from coderl.metrics import cpu_clock

    wall, cpu, children = (b - a for a, b in zip(start, cpu_clock(), strict=True))
    return {f"{name}_s": wall, f"{name}_cpu_s": cpu, f"{name}_children_cpu_s": children}


def run_demo(config: Path, overrides: list[str]) -> int:
    """Train the default recipe, write the report, print the run's summary
    (:func:`coderl.eval.summary.summary_lines`: held-out pass@1 per phase, the paired RL-only and
    whole-run changes, pass@k at the largest k before/after RL, broken calls, phase times)."""
    from coderl.config import load_config
    from coderl.rundir import not_started_line, run_lock

    cfg = load_config(config, overrides)
    if Path(cfg.run_dir).exists():
        with run_lock(cfg.run_dir, "coderl demo"):  # a live run there is refused, not moved
            prev = set_aside(Path(cfg.run_dir))
        if prev is not None:
            print(f"demo: the previous run in {cfg.run_dir} was moved to {prev}; starting fresh")
    phases: dict[str, float] = {}
    training = False  # no checkpoint can exist before RL starts (the demo always starts afresh)
    try:
        with run_lock(cfg.run_dir, "coderl demo"):  # one writer, SFT and RL alike
            # torch, the tasks and the model: after the refusals above
            from coderl.eval.observers import default_observers
            from coderl.metrics import cpu_clock
            from coderl.policy.threads import use_threads
            from coderl.train.loop import train
            from coderl.train.warmstart import warm_start

            use_threads(cfg.threads)
            if cfg.eval.extra_splits:  # an empty split is refused before SFT, not after it
                from coderl.envs import build_environment
                from coderl.train.run import check_extra_splits

                check_extra_splits(cfg, build_environment(cfg))
            clock = cpu_clock()
            if cfg.sft.enabled:
                reused = warm_start(cfg).reused  # sft.cache: an earlier build of the same inputs
                phases.update(phase_times("sft", clock), sft_reused=float(reused))
            clock = cpu_clock()
            training = True
            run_dir = train(cfg, observers=default_observers())
            phases.update(phase_times("train", clock))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, in any phase
        again = shlex.join(["coderl", "demo", *overrides, "--config", str(config)])
        if not training:  # torch may be half-imported: this line needs none of it
            print(not_started_line("coderl demo", cfg.run_dir, again), file=sys.stderr)
            return 130
        from coderl.cli.train import resume_command
        from coderl.train.resume import stopped_line

        line = stopped_line("coderl demo", cfg.run_dir, resume_command(cfg), again)
        print(line, file=sys.stderr)
        return 130
    from coderl.eval.report import write_report
    from coderl.eval.summary import print_summary, write_phases

    write_phases(run_dir, phases)
    page = write_report(run_dir)
    print_summary(run_dir, phases)
    Console().print(f"report: {page}")
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.self_check:
        return run_demo(Path(args.config), args.overrides)
    table = Table(title="coderl algorithm self-check")
    for col in ("check", "computed", "expected", "ok"):
        table.add_column(col)
    ok_all = True
    for name, got, want in self_check():
        ok = abs(got - want) < 1e-3
        ok_all &= ok
        table.add_row(name, f"{got:.4f}", f"{want:.4f}", "yes" if ok else "NO")
    Console().print(table)
    return 0 if ok_all else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the main job on the embedded default")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the default config")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="preset (default: repair.yaml)")
    p.add_argument("--self-check", action="store_true", help="only the algorithm self-check")
    p.set_defaults(func=run)
