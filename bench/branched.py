"""Branched rollouts (``algorithm.advantage=vineppo``) against outcome-only GRPO on multi-turn
function repair, at the same CPU budget.

Both arms start from the same policy and config (``configs/branched.yaml`` shrunk by the
flags); vineppo trains ``--steps`` steps, then GRPO trains until it has used as many
CPU-seconds (this process and its finished children: sandboxes, graders), at most
``4 * --steps`` steps. Printed per arm: the signal per episode (share of sampled tokens with a
non-zero advantage, variance of the advantages over sampled tokens), the rollout cost (sampled
tokens, continuations, rollout and grading seconds), and held-out pass@1 after the budget.

``--sft N``: first an SFT warm start on oracle repair episodes of the first N training tasks
(:func:`coderl.train.sft.run_sft`, the preset's ``sft`` block), run once; both arms then start
from that adapter (``RUN_DIR/sft/trainable.safetensors``, loaded by ``setup_run``), and the
held-out pass@1 of the warm start itself is measured once (``start_pass@1``). ``--seed`` is the
run seed of the SFT and both arms; ``--json OUT`` writes the figures (and the settings, date,
CPU flags and load) to OUT.

    .venv/bin/python bench/branched.py --sft 64 --json runs/branched.json   # SmolLM2-135M
    .venv/bin/python bench/branched.py --model tiny-random --context 8192 --steps 1 \\
        --tasks-per-step 1 --group 2 --k 1 --eval-tasks 2 --eval-samples 1 --sft 2  # smoke run

With ``--model tiny-random`` nothing is solved: the advantages come from the broken-call
penalty alone, so the figures show the cost and the plumbing, not a learning gain.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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
from coderl.train.run import SFT_WEIGHTS, close_run, run_eval, setup_run  # noqa: E402
from coderl.train.sft import run_sft  # noqa: E402

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


def arm(
    overrides: list[str], steps: int, budget: float | None, sft: Path | None, start_eval: bool
) -> dict[str, float]:
    """One arm: ``steps`` steps (``budget``: until that many CPU-seconds, at most 4x), from the
    SFT adapter ``sft`` when given; ``start_eval``: also held-out pass@1 before the first step."""
    cfg = load_config(PRESET, [*overrides, f"sft.enabled={sft is not None}"])
    if sft is not None:  # where setup_run looks for the warm start of this run
        (Path(cfg.run_dir) / SFT_WEIGHTS).parent.mkdir(parents=True)
        shutil.copy(sft, Path(cfg.run_dir) / SFT_WEIGHTS)
    cap = Capture()
    P.make_batch = cap
    run = setup_run(cfg, load_sft=sft is not None)
    totals = {"tokens": 0.0, "continuations": 0.0, "rollout_s": 0.0, "grading_s": 0.0}
    try:
        if start_eval:  # the warm start itself, before the budget starts
            totals["start_pass@1"] = run_eval(run)["pass_at"]["1"]["mean"]
        t0, c0, done = time.perf_counter(), cpu_seconds(), 0
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
    ap.add_argument("--sft", type=int, default=0, help="SFT warm start on N oracle episodes")
    ap.add_argument("--seed", type=int, default=0, help="run seed (SFT and both arms)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_flags(), "load": os.getloadavg()}
    print(f"date {meta['date']}; cpu: {meta['cpu']}; load {meta['load']}")
    base = [f"seed={a.seed}",
        f"model.name={a.model}", f"tasks.tasks_per_step={a.tasks_per_step}",
        f"rollout.group_size={a.group}", f"rollout.max_turns={a.max_turns}",
        f"rollout.max_context_tokens={a.context}",
        f"eval.tasks={a.eval_tasks}", f"eval.samples={a.eval_samples}", "eval.k=[1]",
        "tensorboard=false", "progress=false", "trainer.checkpoint_every=1000",
    ]  # fmt: skip
    turns = "[" + a.turns + "]"
    sft_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        sft = None
        if a.sft:
            t0 = time.perf_counter()
            sft_cfg = load_config(PRESET, [*base, f"run_dir={tmp}/sft", "sft.enabled=true", f"sft.limit={a.sft}"])  # fmt: skip
            sft = run_sft(sft_cfg)
            sft_s = time.perf_counter() - t0
        vine = [*base, f"run_dir={tmp}/vineppo", f"rollout.branch.turns={turns}", f"rollout.branch.k={a.k}"]  # fmt: skip
        grpo = [*base, f"run_dir={tmp}/grpo", "algorithm.advantage=grpo", "rollout.branch.k=0", "rollout.branch.turns=[]", "reward.shaping=0"]  # fmt: skip
        v = arm(vine, a.steps, None, sft, start_eval=True)
        g = arm(grpo, a.steps, v["cpu_s"], sft, start_eval=False)
    print(f"model {a.model}; {a.tasks_per_step} tasks x G={a.group}, max_turns {a.max_turns}, "
          f"vineppo k={a.k} at turns {a.turns}; held-out {a.eval_tasks} tasks x {a.eval_samples}; "
          f"seed {a.seed}; sft on {a.sft} oracle episodes ({sft_s:.0f} s)")  # fmt: skip
    v_start = v.pop("start_pass@1")
    print(f"held-out pass@1 at the start of both arms: {v_start:.4g}")
    keys = ["steps", "cpu_s", "wall_s", "tokens", "continuations", "rollout_s", "grading_s",
            "nonzero_token_share", "advantage_var", "pass@1"]  # fmt: skip
    print(f"{'':22}{'vineppo':>12}{'grpo':>12}{'ratio':>9}")
    for k in keys:
        ratio = v[k] / g[k] if g[k] else float("nan")
        print(f"{k:22}{v[k]:12.4g}{g[k]:12.4g}{ratio:9.3g}")
    meta["load_end"] = os.getloadavg()
    print(f"load at the end {meta['load_end']}")
    if a.json:
        start = load_config(PRESET, base).model_dump(mode="json")  # the shared settings
        out = {**meta, "args": {k: str(x) if isinstance(x, Path) else x for k, x in vars(a).items()},
               "sft_s": sft_s, "start_pass@1": v_start, "vineppo": v, "grpo": g, "config": start}  # fmt: skip
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"figures: {a.json}")


if __name__ == "__main__":
    main()
