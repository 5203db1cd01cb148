"""``logging.wandb``: a short toy run in offline mode writes a W&B run whose history holds, step
for step, the metrics of ``metrics.jsonl`` (same keys, same values) plus the evaluations; a
resumed run logs to a new W&B run in the same group. Skipped only where ``wandb`` is not
installed and CI is not set (CI installs the dev extra, which has it)."""

import math
from pathlib import Path

import pytest
from conftest import in_ci

from coderl.config import load_config
from coderl.metrics import read_jsonl
from coderl.train.loop import train

try:
    import wandb
except ImportError:
    if in_ci():
        raise
    pytest.skip("wandb is not installed (pip install 'coderl[wandb]')", allow_module_level=True)

from wandb_records import history, records

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"


def _offline_runs(root):
    return sorted(root.glob("wandb/offline-run-*/run-*.wandb"))


def _run_record(path):
    """The run's metadata as last written (wandb may rewrite the run record after init)."""
    return [r.run for r in records(path) if r.WhichOneof("record_type") == "run"][-1]


def test_offline_history_has_the_jsonl_metrics(tmp_path, monkeypatch):
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = [
        "progress=false",
        "tensorboard=false",
        "trainer.checkpoint_every=2",
        "logging.wandb.enabled=true",
        "logging.wandb.project=coderl-test",
        f"run_dir={tmp_path / 'run'}",
    ]
    train(load_config(TOY, [*common, "trainer.steps=2"]))
    wandb.teardown()  # run.finish() can return before wandb-core has written the log out
    (first,) = _offline_runs(wandb_dir)
    rows = {row["_step"]: row for row in history(first)}
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    assert sorted(rows) == [0, 1, 2]
    eval_keys = {"eval/best_of_n", *(f"eval/pass@{k}" for k in evals[0]["pass_at"])}
    assert {k for k in rows[0] if not k.startswith("_")} == eval_keys  # the evaluation at step 0
    for m in metrics:
        row = rows[m["step"]]
        keys = {k for k in row if not k.startswith("_")} - eval_keys
        assert keys == set(m) - {"step"}
        assert len(keys) > 20
        for k in keys:
            want = m[k]
            if want is None:  # the JSONL writes NaN / inf as null
                assert not math.isfinite(row[k]), k
            else:
                assert row[k] == pytest.approx(want, rel=1e-6, abs=1e-12), k
    for e in evals:
        row = rows[e["step"]]
        assert row["eval/best_of_n"] == pytest.approx(e["best_of_n"]["mean"])
        for k, est in e["pass_at"].items():
            assert row[f"eval/pass@{k}"] == pytest.approx(est["mean"])
    run_record = _run_record(first)
    assert (run_record.project, run_record.display_name) == ("coderl-test", "run")

    train(load_config(TOY, [*common, "trainer.steps=3"]), resume=True)
    wandb.teardown()
    second = next(p for p in _offline_runs(wandb_dir) if p != first)
    run_record = _run_record(second)
    assert (run_record.display_name, run_record.run_group) == ("run-resume-2", "run")
    assert [row["_step"] for row in history(second)] == [3]  # starts after the checkpoint
