"""``make learn``: the learning curve of the repair recipe, one longer run.

Runs ``coderl demo --config configs/repair.yaml`` (SFT on oracle repairs, GRPO from the
difficulty pool with synthesis inside the loop, :func:`coderl.cli.demo.run_demo`) with
``--steps`` RL steps and a held-out evaluation every ``--every`` steps (``eval.every``; each
one after the first carries the collapse check, :func:`coderl.train.heldout.log_eval_with_alarm`),
then prints the curve the run report draws (:mod:`coderl.eval.curve`: held-out pass@1 and
pass@k with 95% CIs and the alarm per evaluation; reward per term, the pool's active band and
synthesis counts per step) and what the run cost: wall time, CPU seconds (this process and
its children: the synthesis worker, sandboxes, graders), peak RSS, CPU flags, load.

Defaults: 256 SFT demonstrations (``--demos``; the demo's 128 start the policy at 0.016
held-out pass@1, 256 at 0.047-0.057: docs/training.md, "The repair demo"), 12 steps, an
evaluation every 3 (after SFT and at steps 3, 6, 9, 12). Sized from the phase rates of the
measured ``make demo`` (2026-12-06, 2 idle cores: SFT 2.3 s a demonstration, 32 x 4 held-out
episodes ~150 s, ~108 s an RL step): SFT ~10 min, five evaluations ~13 min, 12 steps ~22 min,
about 45 minutes (an estimate from those rates; the default run was not timed end to end). The
picture is ``RUN_DIR/report/learning_curve.png``, its data ``RUN_DIR/report/curve.json``, both
in ``RUN_DIR/report/index.html``.

    .venv/bin/python bench/learn_curve.py                       # the defaults above
    .venv/bin/python bench/learn_curve.py --steps 24 --every 4 --demos 128

``make learn-repo`` runs it on the repository ladder (``--config configs/repo-ladder.yaml
--run-dir runs/learn-repo``); its evaluations carry pass@1 per level in the run summary. Its
budget has not been measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from coderl.cli.demo import run_demo
from coderl.eval.curve import ACTIVE_KEY, CURVE_JSON, CURVE_PNG, SYNTH_KEYS, alarm_caption

sys.path.insert(0, str(Path(__file__).parent))
from grading import cpu_flags  # noqa: E402 - a sibling bench script

REPAIR = Path(__file__).resolve().parent.parent / "configs" / "repair.yaml"


def _ci(est: dict[str, float]) -> str:
    return f"{est['mean']:.3f} [{est['lo']:.3f}, {est['hi']:.3f}]"


def print_curve(data: dict) -> None:
    """The curve's evaluations (pass@1 and pass@k at the largest k, 95% CIs, the alarm) and
    its training rows (reward per term, active band, synthesis)."""
    print("held-out evaluations:")
    for e in data["evals"]:
        kmax = max(e["pass_at"], key=int)
        alarm = {None: "-", True: "ALARM", False: "no alarm"}[e["alarm"]]
        print(
            f"  step {e['step']:>3} {e['phase'] or '':<5} n={e['samples']}  "
            f"pass@1 {_ci(e['pass_at']['1'])}  pass@{kmax} {_ci(e['pass_at'][kmax])}  {alarm}"
        )
    print(f"  {alarm_caption(data)}")
    train = data["train"]
    keys = [k for k in train if k.startswith("reward/")]
    keys += [k for k in ("resolved_rate", ACTIVE_KEY, *SYNTH_KEYS) if k in train]
    print("training steps: " + "  ".join(keys))
    for i, step in enumerate(train["step"]):
        cells = ["-" if train[k][i] is None else f"{train[k][i]:.3g}" for k in keys]
        print(f"  step {step:>3}  " + "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    p.add_argument("--config", default=str(REPAIR), help="preset (default: repair.yaml)")
    p.add_argument("--steps", type=int, default=12, help="RL steps (trainer.steps)")
    p.add_argument("--every", type=int, default=3, help="held-out evaluation every N steps")
    p.add_argument("--run-dir", default="runs/learn", help="run directory (run_dir)")
    p.add_argument("--demos", type=int, default=256, help="SFT demonstrations (sft.limit)")
    args = p.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; cpu: {cpu_flags()}")
    print(f"load at start {os.getloadavg()}", flush=True)
    t0, c0 = time.perf_counter(), _cpu_s()
    overrides = [
        f"run_dir={args.run_dir}",
        f"trainer.steps={args.steps}",
        f"sft.limit={args.demos}",
    ]
    overrides += [f"eval.every={args.every}", *args.overrides]
    run_demo(Path(args.config), overrides)
    report = Path(args.run_dir) / "report"
    print_curve(json.loads((report / CURVE_JSON).read_text()))
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    print(f"wall {wall / 60:.1f} min; CPU {cpu:.0f} s ({cpu / max(wall, 1e-9):.0%} of one core)")
    print(f"peak RSS {own:.2f} GB (this process), {kids:.2f} GB (largest child)")
    print(f"load at the end {os.getloadavg()}")
    print(f"learning curve: {report / CURVE_PNG} (data {report / CURVE_JSON})")
    return 0


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


if __name__ == "__main__":
    raise SystemExit(main())
