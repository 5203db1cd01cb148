"""``coderl rm mine`` / ``coderl rm train`` / ``coderl rm eval``: a Bradley-Terry reward model from preference pairs.

Pairs come from any of ``--pairs`` (labelled JSONL), ``--episodes`` (resolved over unresolved
episodes of the same task) and ``--store`` (kept over discarded completions in the online store);
see :mod:`coderl.graders.pairs`. ``mine`` writes split-tagged pairs from graded episodes
(:mod:`coderl.graders.mine`); ``train`` splits them by context, trains, writes the checkpoint
(an existing ``--out`` only with ``--force``; ``--head-only`` freezes the backbone and fits the
head on cached features, :func:`coderl.graders.rm.fit_head`)
and ``rm_eval.json`` (held-out pairwise accuracy with its Wilson 95% interval; pairs whose
chosen and rejected are all identical, or no held-out pair, are refused before the backbone
loads); ``eval`` scores a checkpoint on all the pairs given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coderl.cli import threads_option
from coderl.graders.pairs import (
    PreferencePair,
    pairs_from_jsonl,
    pairs_from_outcomes,
    pairs_from_store,
    read_episodes,
)
from coderl.metrics import reported


def _pairs(args: argparse.Namespace) -> list[PreferencePair]:
    out: list[PreferencePair] = []
    if args.pairs:
        out += pairs_from_jsonl(args.pairs)
    notes = []
    if args.episodes:
        views, resolved = read_episodes(args.episodes)
        got = pairs_from_outcomes(views, resolved)
        if not got:
            notes.append(
                f"--episodes {args.episodes}: {len(views)} episodes, {sum(resolved)} resolved, "
                "no task with both a resolved and an unresolved episode"
            )
        out += got
    if args.store:
        from coderl.online.store import Store

        store = Store(args.store)
        try:
            out += pairs_from_store(store)
        finally:
            store.close()
    if not out:
        why = f" ({'; '.join(notes)})" if notes else ""
        raise ValueError(f"no preference pairs{why}: give --pairs, --episodes or --store with data")
    return out


def train(args: argparse.Namespace) -> int:
    from coderl.cli.tasks import writable
    from coderl.graders.rm import (
        RewardModel,
        RMSpec,
        pairwise_accuracy,
        split_pairs,
        summary,
        train_rm,
    )

    writable(args.out, args.force)  # before the pairs are read and the backbone loads
    pairs = _pairs(args)
    if all(p.chosen == p.rejected for p in pairs):
        raise ValueError(
            f"the {len(pairs)} preference pairs carry no text to learn from (chosen and "
            "rejected are identical in each: episodes without a statement, diff or tool log, "
            "such as toy episodes?)"
        )
    tr, held = split_pairs(pairs, args.heldout)
    if not tr:
        raise ValueError(f"all {len(pairs)} pairs fell in the held-out split; lower --heldout")
    if not held:
        contexts = len({p.context_id for p in pairs})
        raise ValueError(
            f"no held-out pair to measure the reward model on ({len(pairs)} pairs of {contexts} "
            "contexts, all in the training split); raise --heldout or give more contexts"
        )
    spec = RMSpec(args.backbone, args.lora_rank or None, seed=args.seed, max_len=args.max_len,
                  head_only=args.head_only, pool=args.pool)  # fmt: skip
    model = RewardModel(spec)
    losses = train_rm(model, tr, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      weight_decay=args.weight_decay, progress=True)  # fmt: skip
    out = model.save(args.out)
    result = reported({"train_pairs": len(tr), **summary(pairwise_accuracy(model, held), losses)})
    (out / "rm_eval.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    print(json.dumps(result, indent=1, allow_nan=False))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from coderl.graders.rm import RewardModel, pairwise_accuracy, summary

    model = RewardModel.load(args.checkpoint)
    print(
        json.dumps(
            reported(summary(pairwise_accuracy(model, _pairs(args)), [])), indent=1, allow_nan=False
        )
    )
    return 0


def mine(args: argparse.Namespace) -> int:
    from coderl.graders.mine import mine_pairs, write_pairs

    pairs = mine_pairs(args.sources, max_per_task=args.max_per_task)
    write_pairs(args.out, pairs)
    held = sum(p.split == "heldout" for p in pairs)
    tasks = len({p.context_id for p in pairs})
    print(json.dumps({"pairs": len(pairs), "train": len(pairs) - held, "heldout": held,
                      "tasks": tasks, "out": str(args.out)}))  # fmt: skip
    return 0 if pairs else 1


def _sources(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", help="JSONL of labelled pairs {context, chosen, rejected}")
    p.add_argument("--episodes", help="episodes JSONL (resolved over unresolved, same task)")
    p.add_argument("--store", help="online store URL (sqlite:///... or postgresql://...)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("rm", help="train / evaluate a reward model from preferences")
    rm = p.add_subparsers(dest="rm_command", metavar="ACTION", required=True)
    m = rm.add_parser("mine", help="preference pairs from graded episodes (split kept)")
    m.add_argument("sources", nargs="+", help="run dirs (episodes*.jsonl) or episodes JSONL files")
    m.add_argument("--out", type=Path, required=True, help="pairs JSONL to write")
    m.add_argument("--max-per-task", type=int, default=16, help="pairs kept per task")
    m.set_defaults(func=mine)
    t = rm.add_parser("train", help="Bradley-Terry training with a held-out accuracy")
    _sources(t)
    t.add_argument("--backbone", default="smollm2-135m", help="model name or path")
    t.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    t.add_argument("--force", action="store_true", help="replace an existing --out")
    t.add_argument("--lora-rank", type=int, default=16, help="LoRA rank; 0: full fine-tune")
    t.add_argument(
        "--head-only",
        action="store_true",
        help="frozen backbone: fit only the head on features computed once per "
        "sequence (fast on CPU; --lora-rank ignored; try --lr 1e-2)",
    )
    t.add_argument(
        "--pool",
        default="last",
        help="features: `last` token's hidden state or their `mean` over tokens",
    )
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    t.add_argument("--steps", type=int, default=200, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    t.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    t.add_argument("--max-len", type=int, default=512, help="tokens per scored sequence")
    t.add_argument("--heldout", type=float, default=0.2, help="held-out fraction of contexts")
    t.add_argument("--seed", type=int, default=0, help="minibatch and initialisation seed")
    threads_option(t)
    t.set_defaults(func=train)
    e = rm.add_parser("eval", help="pairwise accuracy of a checkpoint on pairs")
    e.add_argument("checkpoint", type=Path, help="a reward model directory (rm train --out)")
    _sources(e)
    threads_option(e)
    e.set_defaults(func=evaluate)
