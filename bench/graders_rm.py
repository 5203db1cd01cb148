"""A head-only Bradley-Terry reward model on SmolLM2-135M, from pairs mined out of
tests-graded HumanEval episodes of two origins, reported apart:

- ``real``: SmolLM2's own replies (chat prompt of :mod:`coderl.online.suites`, ``--k`` samples
  at T = 1 per problem, the first fenced code block, graded by the hidden tests in the
  sandbox); a task gives pairs only where some samples pass and some fail.
- ``mutant``: the canonical solution against single-site mutants of it
  (:mod:`coderl.synth.mutate`) that the hidden tests reject. Both sides are graded by the tests
  (the canonical one must pass), so each is a real tests-graded preference; mutants the tests
  accept (equivalent or untested) are dropped.

Episodes carry the task and the diff only (no tool log, no tests report: a report would hand
the reward model its label). Pairs are mined with :func:`coderl.graders.mine.mine_pairs`, so a
pair's split is its HumanEval task's: held-out problems never train. The reward model
(:func:`coderl.graders.rm.fit_head`) freezes SmolLM2 and fits a linear head on each distinct
sequence's features, computed once. Reported: held-out pairwise accuracy per origin and in all
(Wilson 95%); on the held-out episodes, agreement with the tests (``sigmoid(r) >= 0.5``, where
``r = 0`` is the mean training sequence, and Spearman); the margin (mean ``sigmoid(r)`` of the
chosen minus the rejected side over held-out pairs, paired bootstrap CI); the probe shifts on
held-out canonical solutions. Pairs that share an episode (one canonical solution against two
mutants) are not independent: the intervals treat them as if they were. Episodes and pairs are kept in ``--out`` (``--reuse`` reads them
back instead of sampling again), with each origin's ``pairs.jsonl`` and the reward model
(``--out/rm``, a ``reward.rm.checkpoint``). Prints JSON with the CPU flags and load average.

    python bench/graders_rm.py --threads 1                     # ~25 min on a shared 2-core box
    python bench/graders_rm.py --train-n 8 --held-n 8 --k 2   # a smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import time
from pathlib import Path

import torch
from graders_judge import machine

from coderl.graders.judge import EpisodeView, code_diff
from coderl.graders.mine import mine_pairs, write_pairs
from coderl.graders.pairs import PreferencePair, read_episodes, render_episode, write_episodes
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
from coderl.online.suites import SuiteTask, extract_code, grade_replies, humaneval
from coderl.synth.mutate import functions, mutants_of

Episodes = tuple[list[EpisodeView], list[bool]]


def real_episodes(policy, tasks: list[SuiteTask], k: int, max_new: int, seed: int) -> Episodes:
    """``k`` sampled replies per task, graded by the hidden tests (no code block: no change)."""
    from coderl.policy import SamplingParams, render

    tok = policy.tokenizer
    rows = [t for t in tasks for _ in range(k)]
    prompts = [
        tok.encode(render(tok, t.messages(), add_generation_prompt=True), add_special_tokens=False)
        for t in rows
    ]
    texts: list[str] = []
    for i in range(0, len(prompts), 32):
        params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed + i)
        done = policy.generate(prompts[i : i + 32], params)
        texts += [tok.decode(c.token_ids, skip_special_tokens=True) for c in done]
    codes = [extract_code(x) for x in texts]
    ok = grade_replies(list(zip(rows, codes, strict=True)))
    views = [
        EpisodeView(t.task_id, t.prompt, code_diff(c or ""))
        for t, c in zip(rows, codes, strict=True)
    ]
    return views, ok


def mutant_episodes(tasks: list[SuiteTask], per_task: int, seed: int) -> Episodes:
    """Per task: the canonical solution and up to ``per_task`` mutants that fail the tests
    (at most ``3 * per_task`` mutants tried, in a seeded random order). A task whose canonical
    solution fails (never seen on HumanEval) gives no episodes."""
    rng = random.Random(seed)
    cands: list[tuple[SuiteTask, str, bool]] = []
    for t in tasks:
        src = t.prompt + t.canonical_solution
        fn = next(f for name, f in functions(ast.parse(src)) if name == t.entry_point)
        muts = list(mutants_of(src, t.entry_point, fn))
        rng.shuffle(muts)
        cands += [(t, src, True)] + [(t, m.source, False) for m in muts[: 3 * per_task]]
    passed = grade_replies([(t, code) for t, code, _ in cands])
    gold_ok = {t.task_id for (t, _, gold), ok in zip(cands, passed, strict=True) if gold and ok}
    views, resolved, used = [], [], dict.fromkeys(gold_ok, 0)
    for (t, code, gold), ok in zip(cands, passed, strict=True):
        if t.task_id not in gold_ok or (not gold and (ok or used[t.task_id] >= per_task)):
            continue  # a failing gold, a mutant the tests accept, or enough mutants
        used[t.task_id] += not gold
        views.append(EpisodeView(t.task_id, t.prompt, code_diff(code)))
        resolved.append(ok)
    return views, resolved


def _episodes(path: Path, reuse: bool, make, *args) -> Episodes:
    """``make(*args)``, written to ``path``; with ``reuse``, ``path`` read back if it exists."""
    if reuse and path.is_file():
        return read_episodes(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    views, ok = make(*args)
    write_episodes(path, views, ok)
    return views, ok


def _accuracy(model: RewardModel, pairs: list[PreferencePair]) -> dict[str, object]:
    return pairwise_accuracy(model, pairs).__dict__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--train-n", type=int, default=40, help="train-split problems")
    ap.add_argument("--held-n", type=int, default=24, help="held-out problems")
    ap.add_argument("--k", type=int, default=4, help="SmolLM2 replies per problem (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--mutants", type=int, default=2, help="failing mutants per problem")
    ap.add_argument("--pool", default="last", help="features: last | mean")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--probe-n", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the box is shared)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-graders-rm"))
    ap.add_argument("--reuse", action="store_true", help="read --out's episodes back")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {"machine_before": machine(), "args": vars(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    suites = {"train": humaneval("train", limit=args.train_n),
              "heldout": humaneval("heldout", limit=args.held_n)}  # fmt: skip
    t0 = time.perf_counter()
    eps: dict[str, Episodes] = {}
    for split, tasks in suites.items():
        f = args.out / "mutant" / f"episodes-{split}.jsonl"
        eps[f"mutant/{split}"] = _episodes(
            f, args.reuse, mutant_episodes, tasks, args.mutants, args.seed
        )
    if args.k:
        from coderl.policy import load_policy

        policy = load_policy(args.backbone, reference=False)
        for split, tasks in suites.items():
            f = args.out / "real" / f"episodes-{split}.jsonl"
            eps[f"real/{split}"] = _episodes(
                f, args.reuse, real_episodes, policy, tasks, args.k, args.max_new_tokens, args.seed
            )
        del policy
    out["episodes_s"] = time.perf_counter() - t0
    out["episodes"] = {name: {"n": len(ok), "resolved": sum(ok)} for name, (_, ok) in eps.items()}
    origins = ["mutant", "real"] if args.k else ["mutant"]
    pairs = {}
    for o in origins:  # (train, held-out) pairs of each origin, also written for `coderl rm`
        mined = mine_pairs([args.out / o])
        write_pairs(args.out / o / "pairs.jsonl", mined)
        pairs[o] = split_pairs(mined)
    out["pairs"] = {o: {"train": len(tr), "heldout": len(he)} for o, (tr, he) in pairs.items()}
    train = [p for tr, _ in pairs.values() for p in tr]
    model = RewardModel(RMSpec(args.backbone, head_only=True, pool=args.pool, max_len=args.max_len))
    t0 = time.perf_counter()
    losses = train_rm(model, train, steps=args.steps, batch_size=16, lr=args.lr,
                      weight_decay=args.weight_decay, seed=args.seed)  # fmt: skip
    out["fit_s"] = time.perf_counter() - t0
    out["checkpoint"] = str(model.save(args.out / "rm"))  # for reward.rm.checkpoint
    out["loss_first_last"] = [losses[0], losses[-1]]
    out["train_pairwise"] = _accuracy(model, train)
    held_all = [p for _, he in pairs.values() for p in he]
    out["heldout_pairwise"] = {o: _accuracy(model, he) for o, (_, he) in pairs.items()}
    out["heldout_pairwise"]["all"] = _accuracy(model, held_all)  # type: ignore[index]
    hv = [v for o in origins for v in eps[f"{o}/heldout"][0]]
    h_ok = [ok for o in origins for ok in eps[f"{o}/heldout"][1]]
    grader = RewardModelGrader(model)
    lengths = [len(model.tokenizer(render_episode(v))["input_ids"]) for v in hv]
    out["heldout_truncated"] = sum(n > args.max_len for n in lengths)  # head + tail kept
    t0 = time.perf_counter()
    out["agreement"] = agreement_with_tests(grader.score(hv), h_ok)
    # the margin over held-out pairs, chosen and rejected interleaved (grader_margin pairs them)
    both = [x for p in held_all for x in (p.chosen, p.rejected)]
    pair_scores = [1 / (1 + math.exp(-r)) for r in model.rewards(both)]
    if args.probe_n:
        gold = [v for v, ok in zip(*eps["mutant/heldout"], strict=True) if ok][: args.probe_n]
        out["probes"] = margin_report(
            run_probes(grader, gold), pair_scores, [True, False] * len(held_all)
        )
    out["score_s"] = time.perf_counter() - t0
    out["machine_after"] = machine()
    text = json.dumps(out, indent=1, default=str)
    (args.out / "result.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
