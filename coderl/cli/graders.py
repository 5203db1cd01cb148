"""``coderl graders probe``: the gameability probes on a grader, over episodes from a file.

The grader is the rubric judge (``--grader judge``, built from ``reward.judge``) or a reward model
(``--grader rm``, from ``reward.rm.checkpoint``); config overrides as ``key=value``. Prints one
line per probe (mean shift, 95% CI, flag), appends the results to ``--out`` (a JSONL file the
run report reads as ``RUN_DIR/probes.jsonl``) and exits 1 when a probe raises the score.
"""

from __future__ import annotations

import argparse
import json


def probe(args: argparse.Namespace) -> int:
    from coderl.config import load_config
    from coderl.graders.pairs import read_episodes
    from coderl.graders.probes import probe_gate, run_probes
    from coderl.graders.report import write_probe_results
    from coderl.policy.threads import use_threads
    from coderl.rewards.learned import build_judge

    cfg = load_config(args.config, args.overrides)
    use_threads(cfg.threads)
    views, _ = read_episodes(args.episodes)
    views = [v for v in views if v.diff.strip()][: cfg.graders.probe_episodes]
    if args.grader == "judge":
        grader = build_judge(cfg.reward.judge)
    else:
        from coderl.graders.rm import RewardModelGrader

        if not cfg.reward.rm.checkpoint:
            raise ValueError("--grader rm needs reward.rm.checkpoint=DIR")
        grader = RewardModelGrader.load(cfg.reward.rm.checkpoint, squash=cfg.reward.rm.squash)
    results = run_probes(grader, views, cfg.graders.probes, max_shift=cfg.graders.max_shift)
    for r in results:
        flag = "  RAISES THE SCORE" if r.flagged else ""
        print(f"{r.probe:18s} n={r.n:3d} shift {r.mean:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]{flag}")
    if args.out:
        write_probe_results(args.out, args.grader, results)
    ok, reason = probe_gate(results)
    print(json.dumps({"pass": ok, "reason": reason, "counts": dict(getattr(grader, "counts", {}))}))
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("graders", help="learned graders: gameability probes")
    g = p.add_subparsers(dest="graders_command", metavar="ACTION", required=True)
    pr = g.add_parser("probe", help="score shifts of the probe suite on a grader")
    pr.add_argument("episodes", help="episodes JSONL, as `coderl eval --episodes-out` writes it")
    pr.add_argument("overrides", nargs="*", help="key=value config overrides")
    pr.add_argument("--grader", choices=["judge", "rm"], default="judge",
                    help="the rubric judge (reward.judge) or a reward model (reward.rm)")  # fmt: skip
    pr.add_argument("--config", help="a YAML preset (default: the built-in defaults)")
    pr.add_argument("--out", help="append the results to this JSONL file")
    pr.set_defaults(func=probe)
