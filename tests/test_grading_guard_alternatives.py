"""Correct fixes written differently from the gold patch (``bench/data/guard_alt_fixes.json``):
each six entry must resolve its task when graded with the guard off, and the guard must leave it
clean (or deny it where the entry records a known false positive). The bench
``bench/guard_alt_fixes.py --grade`` runs every entry over all repositories."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

from coderl.envbuild.build import build_env

BENCH = Path(__file__).parent.parent / "bench" / "guard_alt_fixes.py"
sys.path.insert(0, str(BENCH.parent))  # the bench imports its sibling diffguard_gold
_spec = importlib.util.spec_from_file_location("guard_alt_fixes", BENCH)
alt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(alt)

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
SIX = [f for f in alt.load_fixes() if f["id"].startswith("six-1.17.0/")]


@pytest.fixture(scope="module")
def env():
    return build_env("six==1.17.0")


def test_the_data_covers_several_repositories_and_is_mostly_clean():
    fixes = alt.load_fixes()
    assert len(fixes) >= 25 and len({f["id"].split("-")[0] for f in fixes}) >= 5
    assert len(SIX) >= 5


@pytest.mark.parametrize("fix", SIX, ids=[f"{f['id']}:{f['note'][:20]}" for f in SIX])
def test_an_alternative_fix_resolves_and_the_guard_judges_it_as_recorded(env, fix, tmp_path):
    found, resolved = alt.check(fix, Path(env.snapshot), tmp_path, graded=True)
    assert resolved, fix["id"]
    assert (found == []) == (fix["expect"] == "clean"), found
