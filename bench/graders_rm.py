"""A Bradley-Terry reward model on SmolLM2-135M (LoRA) from pairs mined out of graded episodes.

Episodes as in ``bench/graders_judge.py`` (canonical solution vs ``return None``, outcome by
construction) for both HumanEval splits, written as episodes JSONL and mined with
:func:`coderl.graders.mine.mine_pairs` (so the split comes from the task: held-out pairs never
train). Trains on the train-split pairs, then reports held-out pairwise accuracy (Wilson 95%),
agreement with the tests on the held-out episodes (sigmoid(r) >= 0.5, Spearman), the margin and
the probe shifts. Prints JSON with the CPU flags and load average.

    python bench/graders_rm.py --train-n 64 --held-n 32 --steps 30
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from graders_judge import episodes, machine

from coderl.graders.mine import mine_pairs
from coderl.graders.pairs import write_episodes
from coderl.graders.probes import margin_report, run_probes
from coderl.graders.report import agreement_with_tests
from coderl.graders.rm import (
    RewardModel,
    RewardModelGrader,
    RMSpec,
    pairwise_accuracy,
    split_pairs,
    train_rm,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--train-n", type=int, default=64, help="train-split episodes (half resolved)")
    ap.add_argument("--held-n", type=int, default=32, help="held-out episodes (half resolved)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--probe-n", type=int, default=8)
    args = ap.parse_args()
    out: dict[str, object] = {"machine_before": machine(), "args": vars(args)}
    tv, tr_ok = episodes(args.train_n, "train")
    hv, h_ok = episodes(args.held_n, "heldout")
    with tempfile.TemporaryDirectory() as d:
        write_episodes(Path(d) / "episodes-train.jsonl", tv, tr_ok)
        write_episodes(Path(d) / "episodes-heldout.jsonl", hv, h_ok)
        pairs = mine_pairs([d])
    train, held = split_pairs(pairs)
    out["pairs"] = {"train": len(train), "heldout": len(held)}
    model = RewardModel(RMSpec(args.backbone, 16, max_len=args.max_len))
    t0 = time.perf_counter()
    losses = train_rm(model, train, steps=args.steps, batch_size=args.batch_size, lr=2e-4)
    out["train_s"] = time.perf_counter() - t0
    out["loss_first_last"] = [losses[0], losses[-1]]
    out["heldout_pairwise"] = pairwise_accuracy(model, held).__dict__
    grader = RewardModelGrader(model)
    scores = grader.score(hv)
    out["agreement"] = agreement_with_tests(scores, h_ok)
    if args.probe_n:
        good = [v for v, ok in zip(hv, h_ok, strict=True) if ok][: args.probe_n]
        out["probes"] = margin_report(run_probes(grader, good), scores, h_ok)
    out["machine_after"] = machine()
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
