import json

import pytest

from coderl.eval.report import write_report


def test_report_writes_pngs_and_one_html_page(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/tests": 0.1 * s,
            "kl": 0.01 * s,
            "approx_kl": 0.001,
            "entropy": 1.0,
            "episode/sampled_tokens": 50.0,
            "episode/broken_tool_calls": 0.5,
            "episode/no_action_turns": 0.0,
            "time/rollout": 2.0,
            "time/grading": 1.0,
            "time/train": 0.5,
        }
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    est = {"mean": 0.25, "lo": 0.1, "hi": 0.4}
    evals = [
        {
            "step": s,
            "samples": 4,
            "pass_at": {"1": est, "4": est},
            "best_of_n": est,
            "per_task": [],
            "grading_errors": 0,
        }
        for s in (0, 3)
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    page = write_report(tmp_path)
    html = page.read_text()
    for png in (
        "heldout.png",
        "reward.png",
        "kl.png",
        "entropy.png",
        "length.png",
        "broken_calls.png",
        "time.png",
    ):
        assert (tmp_path / "report" / png).stat().st_size > 1000
        assert png in html
    assert "pass@1 0.250 [0.100, 0.400]" in html and "best-of-4" in html


def test_report_on_an_empty_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(tmp_path)
