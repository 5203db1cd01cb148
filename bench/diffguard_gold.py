"""False positives of the reward-denying detector (``coderl.grading.diffguard``) on shipped gold
patches: every task of ``data/tasks/*.jsonl.gz`` whose repository source is at hand (a built
environment's snapshot, or an sdist in ``--sdists``) gets its buggy tree (snapshot +
``bug_patch``), the gold patch applied as the grader applies a diff, and the detector run on the
files it changed. Prints tasks checked, tasks skipped (no source), and every finding.

    PYTHONPATH=$PWD .venv/bin/python bench/diffguard_gold.py [--sdists DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tempfile
from pathlib import Path

from coderl.grading.apply import apply_to_copy, remove_tree
from coderl.grading.guardproc import scan_change
from coderl.tasks.env import find_env
from coderl.tasks.patches import PatchError
from coderl.tasks.snapshot import unpack

ROOT = Path(__file__).resolve().parent.parent


def released_source(env_id: str, sdists: Path | None, scratch: Path) -> Path | None:
    """The released tree of ``env_id``: its built environment's snapshot when that is on disk,
    else its sdist from ``sdists`` unpacked under ``scratch``; None when neither is at hand."""
    try:
        snapshot = Path(find_env(env_id).snapshot)
        if snapshot.is_dir():  # a record can outlive its snapshot (another checkout's cache)
            return snapshot
    except KeyError:
        pass
    name_version = re.sub(r"-[0-9a-f]{12}$", "", env_id)
    name, _, version = name_version.rpartition("-")
    if sdists is None:
        return None
    for cand in sdists.glob("*.tar.gz"):
        stem = cand.name[: -len(".tar.gz")].lower().replace("_", "-")
        if stem == f"{name}-{version}".lower():
            return unpack(cand, scratch / env_id)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdists", type=Path, default=None)
    args = ap.parse_args()
    checked, skipped, findings, strict = 0, {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for path in sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz")):
            rows = [json.loads(line) for line in gzip.open(path, "rt")]
            src = released_source(rows[0]["env_id"], args.sdists, scratch)
            if src is None:
                skipped[path.name] = len(rows)
                continue
            for row in rows:
                buggy, fixed = scratch / "buggy", scratch / "fixed"
                for d in (buggy, fixed):
                    if d.exists():
                        remove_tree(d)
                    d.mkdir()
                try:
                    apply_to_copy(src, row["bug_patch"], lambda p: False, buggy)
                    changed, _ = apply_to_copy(buggy, row["gold_patch"], lambda p: False, fixed)
                except PatchError as e:
                    skipped[row["id"]] = f"patch: {str(e)[:80]}"
                    continue
                checked += 1
                raw = scan_change(buggy, fixed, changed)
                strict += [f"{row['id']}: {f}" for f in raw]
                findings += [f"{row['id']}: {f}" for f in scan_change(buggy, fixed, changed, src)]
    print(
        f"gold patches checked: {checked}; with a finding: {len({f.split(': ')[0] for f in findings})}"
    )
    n_strict = len({f.split(": ")[0] for f in strict})
    print(f"without the released-line allowance: {n_strict} gold patches with a finding")
    for f in strict:
        print("  ", f)
    print(f"skipped (no source at hand or patch failed): {skipped}")
    for f in findings:
        print("  ", f)
    print(f"gold patches with a finding, as graded: {len({f.split(': ')[0] for f in findings})}")


if __name__ == "__main__":
    main()
