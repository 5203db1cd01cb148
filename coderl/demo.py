"""``coderl demo``: the main job on the embedded default.

Until the training loop lands this runs a self-check of the RL algorithm core on worked examples
(the same numbers the test suite pins) and prints them as a table.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from coderl import algorithms as A


def self_check() -> list[tuple[str, float, float]]:
    """(check, computed, expected) for the worked examples of the algorithm core."""
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


def run(args: argparse.Namespace) -> int:
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
    p.set_defaults(func=run)
