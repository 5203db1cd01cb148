"""A user's first day (issue 48), the second user's findings: ``--force`` never removes a run,
nothing moves or writes into a run another command holds, a number that was not measured is
never printed as one, and errors are one line that names what to fix.

Each class is tested through the command line a user types (``coderl.cli.main``) on the toy
task where it can be, so a refusal is checked together with its one-line message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.cli import main
from coderl.train.checkpoint import list_checkpoints

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4"]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", TOY, *FAST, f"run_dir={run_dir}", *extra, "--no-report"])


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith("(set CODERL_TRACEBACK")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``runs/`` holding two finished toy runs, ``a`` and ``b``."""
    root = tmp_path_factory.mktemp("first-day") / "runs"
    for name in ("a", "b"):
        assert _train(root / name) == 0
    return root


# --- 1. --force replaces a previous export, never a run -------------------------------------


def test_export_force_never_removes_a_run_or_a_directory_of_runs(runs, tmp_path, capsys):
    before = _tree(runs)
    refusals = {
        str(runs / "a"): "holds the run being exported",  # the run itself
        str(runs): "holds the run being exported",  # a directory holding it
        str(runs / "b"): "not a previous export",  # another run
        str(runs / "a" / "checkpoints"): "holds the run being exported",
    }
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    refusals[str(tmp_path / "mine")] = "not a previous export"  # anything else
    for out, why in refusals.items():
        assert main(["export", str(runs / "a"), "--out", out, "--force"]) == 2, out
        line = _one_line_error(capsys.readouterr().err)
        assert why in line and "--out" in line, line
    assert _tree(runs) == before
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    # an export that a run was later moved into is not an export any more
    out = tmp_path / "export"
    assert main(["export", str(runs / "a"), "--out", str(out)]) == 0
    (out / "checkpoints").mkdir()
    assert main(["export", str(runs / "b"), "--out", str(out), "--force"]) == 2
    assert "holds a training run" in _one_line_error(capsys.readouterr().err)
    (out / "checkpoints").rmdir()
    # a previous export is replaced
    assert main(["export", str(runs / "b"), "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    assert str(runs / "b") in json.loads((out / "export.json").read_text())["checkpoint"]
