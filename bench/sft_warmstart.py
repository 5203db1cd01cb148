"""The warm start, measured: SFT alone on N oracle repair demonstrations (``sft.limit``), then
held-out repair pass@1 at T = 1 with its 95% CI, for each N of ``--n`` (default 0, 64, 256;
0 is the base model, no SFT) and each SFT precision of ``--dtypes``.

Each (N, dtype) runs in its own subprocess (its memory is its own) on the preset
(``configs/repair.yaml`` by default, ``key=value`` overrides apply): the model is loaded first,
then :func:`coderl.train.sft.run_sft` is timed alone (building the oracle episodes in sandboxes
and the optimizer steps; wall and CPU seconds of the process and its children, per
demonstration), then the held-out split is evaluated as the repair demo does after SFT
(:func:`coderl.train.run.run_eval`: ``eval.tasks`` tasks x ``eval.samples`` samples at
``eval.temperature``, forced to 1.0 here). Printed per run: SFT CPU-s and wall-s per
demonstration, whether SFT ran bf16 MLPs (:func:`coderl.train.sft.sft_bf16`), peak RSS after
SFT and at the end, pass@1 [95% CI], broken calls per episode; and once, the CPU flags, torch
threads and the load at start and end. ``--no-eval`` times SFT only (the fp32 vs bf16 check).

    .venv/bin/python bench/sft_warmstart.py                                   # N = 0, 64, 256
    .venv/bin/python bench/sft_warmstart.py --n 8 --dtypes float32 bfloat16 --no-eval
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from grading import cpu_flags  # noqa: E402 - a sibling bench script

REPAIR = Path(__file__).resolve().parent.parent / "configs" / "repair.yaml"
RESULT = "RESULT "


def _cpu_s() -> float:
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def one(config: str, n: int, dtype: str, run_dir: str, evaluate: bool, over: list[str]) -> dict:
    """SFT on ``n`` demonstrations (none for 0) at ``dtype``, then (``evaluate``) held-out
    pass@1; the measurement as a dict."""
    from coderl.cli.demo import set_aside
    from coderl.config import load_config
    from coderl.train.run import build_policy, close_run, run_eval, setup_run
    from coderl.train.sft import run_sft, sft_bf16

    sft = [f"sft.enabled={n > 0}", f"sft.dtype={dtype}"] + ([f"sft.limit={n}"] if n else [])
    cfg = load_config(config, [*over, f"run_dir={run_dir}", *sft, "eval.temperature=1.0"])
    set_aside(Path(run_dir))  # a fresh directory; an earlier run is moved, not deleted
    out: dict = {"n": n, "dtype": dtype, "bf16": sft_bf16(cfg) if n else None}
    if n:
        policy = build_policy(cfg)
        out["rss_loaded_gb"] = _rss_gb()
        t0, c0 = time.perf_counter(), _cpu_s()
        run_sft(cfg, policy)
        out["sft_wall_s"], out["sft_cpu_s"] = time.perf_counter() - t0, _cpu_s() - c0
        out["sft_cpu_s_per_demo"] = out["sft_cpu_s"] / n
        out["sft_wall_s_per_demo"] = out["sft_wall_s"] / n
        out["rss_after_sft_gb"] = _rss_gb()
        del policy
    if evaluate:
        run = setup_run(cfg)  # loads the SFT weights when SFT ran
        try:
            rec = run_eval(run)
        finally:
            close_run(run)
        out.update(pass1=rec["pass_at"]["1"], eval_s=rec["time_s"], samples=rec["samples"])
        out.update(tasks=len(rec["per_task"]), broken_calls=rec.get("broken_calls"))
    out["rss_peak_gb"] = _rss_gb()
    return out


def _row(r: dict) -> str:
    cells = [f"N={r['n']:<4}", f"{r['dtype']:<8}", f"bf16 MLPs {r['bf16']}"]
    if r["n"]:
        cells.append(
            f"SFT {r['sft_cpu_s_per_demo']:.1f} CPU-s/demo ({r['sft_wall_s_per_demo']:.1f} "
            f"wall-s/demo, {r['sft_wall_s']:.0f} s); RSS loaded {r['rss_loaded_gb']:.2f} GB, "
            f"after SFT {r['rss_after_sft_gb']:.2f} GB"
        )
    if "pass1" in r:
        p = r["pass1"]
        cells.append(
            f"held-out pass@1 (T=1, {r['tasks']} tasks x {r['samples']}) {p['mean']:.3f} "
            f"[{p['lo']:.3f}, {p['hi']:.3f}], broken calls/episode {r['broken_calls']:.2f}, "
            f"eval {r['eval_s']:.0f} s"
        )
    cells.append(f"peak RSS {r['rss_peak_gb']:.2f} GB")
    return "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    p.add_argument("--config", default=str(REPAIR))
    p.add_argument("--n", type=int, nargs="+", default=[0, 64, 256], help="demonstrations")
    p.add_argument("--dtypes", nargs="+", default=["auto"], help="sft.dtype values")
    p.add_argument("--run-dir", default="runs/warmstart", help="one sub-directory per run")
    p.add_argument("--no-eval", action="store_true", help="time SFT only")
    p.add_argument("--one", nargs=2, metavar=("N", "DTYPE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:  # the child: one measurement, one JSON line
        n, dtype = int(a.one[0]), a.one[1]
        rd = f"{a.run_dir}/n{n}-{dtype}"
        print(RESULT + json.dumps(one(a.config, n, dtype, rd, not a.no_eval, a.overrides)))
        return 0
    import torch

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; cpu: {cpu_flags()}")
    print(f"torch threads {torch.get_num_threads()}; load at start {os.getloadavg()}", flush=True)
    rows = []
    for n in a.n:
        for dtype in a.dtypes if n else a.dtypes[:1]:  # N = 0 trains nothing
            cmd = [sys.executable, __file__, "--one", str(n), dtype, "--config", a.config]
            cmd += ["--run-dir", a.run_dir, *(["--no-eval"] if a.no_eval else []), *a.overrides]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            if proc.returncode != 0 or not lines:
                print(f"N={n} {dtype}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}")
                return 1
            rows.append(json.loads(lines[-1][len(RESULT) :]))
            print(_row(rows[-1]), flush=True)
    print(f"load at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
