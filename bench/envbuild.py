"""Environment building as a measured pipeline: repositories built per hour, and the share built
by the rules alone versus with the model's help.

Builds every spec of ``--from`` that the ledger has not finished (resumable: run it again after a
kill), then prints the ledger's totals. With ``--report-only`` it only reads the ledger.

    .venv/bin/python bench/envbuild.py --from data/repos.txt --jobs 2
    .venv/bin/python bench/envbuild.py --from data/repos.txt --builder model     # one at a time
    .venv/bin/python bench/envbuild.py --ledger data/repos.txt.ledger.jsonl --report-only

``built_per_hour`` divides by the summed build time of the finished rows (not the wall clock of
this run), so it is the rate of one build slot; with ``--jobs N`` the wall-clock rate is up to N
times higher, and this script prints that too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coderl.agent.buildpolicy import build_function
from coderl.envbuild.ledger import build_many, finished, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="from_file", help="specs, one a line (# comments)")
    ap.add_argument("--ledger", help="JSONL ledger (default FILE.ledger.jsonl)")
    ap.add_argument("--builder", default="rules")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not (args.from_file or args.ledger):
        ap.error("give --from FILE or --ledger PATH")
    ledger = Path(args.ledger or f"{args.from_file}.ledger.jsonl")
    wall = 0.0
    new: list[dict[str, object]] = []
    if not args.report_only:
        specs = [
            line.split("#")[0].strip()
            for line in Path(args.from_file).read_text().splitlines()
            if line.split("#")[0].strip()
        ]
        start = time.monotonic()
        new = build_many(specs, build_function(args.builder), ledger, jobs=args.jobs)
        wall = time.monotonic() - start
    rows = list(finished(ledger).values())
    s = summary(rows)
    console = Console(width=120)
    table = Table(title=f"{ledger}: {s['repositories']} repositories")
    for col in ("spec", "status", "builder", "plan / step", "attempts", "passing", "flaky", "s"):
        table.add_column(col)
    for r in rows:
        where = str(r.get("plan") or r.get("step"))
        table.add_row(
            str(r["spec"]),
            str(r["status"]),
            str(r.get("builder")),
            where,
            str(r.get("attempts")),
            str(r.get("passing", "")),
            str(r.get("flaky_dropped", "")),
            f"{r.get('time_s', 0):.0f}",
        )
    console.print(table)
    console.print(s)
    if s["built"]:
        share = s["built_by_rules"] / s["built"]
        console.print(f"built by rules alone: {share:.0%}; with the model's help: {1 - share:.0%}")
    if new and wall:
        built_now = sum(r["status"] == "built" for r in new)
        console.print(f"this run: {len(new)} builds in {wall:.0f} s wall ({built_now} built)")


if __name__ == "__main__":
    main()
