"""Branched rollouts (``algorithm.advantage=vineppo``) against outcome-only GRPO on multi-turn
function repair, at the same CPU budget.

Both arms start from the same policy and config (``configs/branched.yaml`` shrunk by the
flags); vineppo trains ``--steps`` steps, then GRPO trains until it has used as many
CPU-seconds (this process and its finished children: sandboxes, graders), at most
``4 * --steps`` steps. Printed per arm: the signal per episode (share of sampled tokens with a
non-zero advantage, variance of the advantages over sampled tokens), the rollout cost (sampled
tokens, continuations, rollout and grading seconds), and held-out pass@1 after the budget.

    .venv/bin/python bench/branched.py                         # SmolLM2-135M (the default)
    .venv/bin/python bench/branched.py --model tiny-random --context 8192 --steps 1 \\
        --tasks-per-step 1 --group 2 --k 1 --eval-tasks 2 --eval-samples 1   # smoke run

With ``--model tiny-random`` nothing is solved: the advantages come from the broken-call
penalty alone, so the figures show the cost and the plumbing, not a learning gain.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from grading import cpu_flags  # noqa: E402 - a sibling bench script

from coderl.config import load_config  # noqa: E402
from coderl.train import loop  # noqa: E402
from coderl.train import pipeline as P  # noqa: E402
from coderl.train.run import close_run, run_eval, setup_run  # noqa: E402

PRESET = Path(__file__).parent.parent / "configs" / "branched.yaml"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Capture:
    """Wraps ``pipeline.make_batch`` to record each step's advantages over sampled tokens."""

    def __init__(self) -> None:
        self.nonzero: list[float] = []
        self.variance: list[float] = []
        self._make = P.make_batch

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        batch = self._make(*args, **kwargs)
        if batch is not None:
            m = batch.loss_mask
            adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand(m.shape)  # fmt: skip
            a = adv[m].double()
            self.nonzero.append(float((a != 0).double().mean()))
            self.variance.append(float(a.var()) if a.numel() > 1 else 0.0)
        return batch


def arm(name: str, overrides: list[str], steps: int, budget: float | None) -> dict[str, float]:
    cfg = load_config(PRESET, overrides)
    cap = Capture()
    P.make_batch = cap
    run = setup_run(cfg, load_sft=False)
    totals = {"tokens": 0.0, "continuations": 0.0, "rollout_s": 0.0, "grading_s": 0.0}
    t0, c0, done = time.perf_counter(), cpu_seconds(), 0
    try:
        while (
            done < steps if budget is None else (cpu_seconds() - c0 < budget and done < 4 * steps)
        ):
            m = loop.training_step(run)
            done += 1
            totals["tokens"] += m["episode/sampled_tokens"] * m["episodes"]
            totals["continuations"] += m.get("branch/continuations", 0.0)
            totals["rollout_s"] += m["time/rollout"]
            totals["grading_s"] += m["time/grading"] + m.get("time/branch_grading", 0.0)
        cpu, wall = cpu_seconds() - c0, time.perf_counter() - t0
        ev = run_eval(run)
    finally:
        close_run(run)
        P.make_batch = cap._make
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "steps": done, "cpu_s": cpu, "wall_s": wall, "pass@1": ev["pass_at"]["1"]["mean"],
        "nonzero_token_share": mean(cap.nonzero), "advantage_var": mean(cap.variance), **totals,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tasks-per-step", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--turns", default="1,2", help="boundaries to fork at")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048, help="tokens per window (tiny: 8192)")
    ap.add_argument("--eval-tasks", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}; cpu: {cpu_flags()}; load {os.getloadavg()}")
    base = [
        f"model.name={a.model}", f"tasks.tasks_per_step={a.tasks_per_step}",
        f"rollout.group_size={a.group}", f"rollout.max_turns={a.max_turns}",
        f"rollout.max_context_tokens={a.context}",
        f"eval.tasks={a.eval_tasks}", f"eval.samples={a.eval_samples}", "eval.k=[1]",
        "sft.enabled=false", "tensorboard=false", "progress=false", "trainer.checkpoint_every=1000",
    ]  # fmt: skip
    turns = "[" + a.turns + "]"
    with tempfile.TemporaryDirectory() as tmp:
        vine = [*base, f"run_dir={tmp}/vineppo", f"rollout.branch.turns={turns}", f"rollout.branch.k={a.k}"]  # fmt: skip
        grpo = [*base, f"run_dir={tmp}/grpo", "algorithm.advantage=grpo", "rollout.branch.k=0", "rollout.branch.turns=[]"]  # fmt: skip
        v = arm("vineppo", vine, a.steps, None)
        g = arm("grpo", grpo, a.steps, v["cpu_s"])
    print(f"model {a.model}; {a.tasks_per_step} tasks x G={a.group}, max_turns {a.max_turns}, "
          f"vineppo k={a.k} at turns {a.turns}; held-out {a.eval_tasks} tasks x {a.eval_samples}")  # fmt: skip
    keys = ["steps", "cpu_s", "wall_s", "tokens", "continuations", "rollout_s", "grading_s",
            "nonzero_token_share", "advantage_var", "pass@1"]  # fmt: skip
    print(f"{'':22}{'vineppo':>12}{'grpo':>12}{'ratio':>9}")
    for k in keys:
        ratio = v[k] / g[k] if g[k] else float("nan")
        print(f"{k:22}{v[k]:12.4g}{g[k]:12.4g}{ratio:9.3g}")
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
