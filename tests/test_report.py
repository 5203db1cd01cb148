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


def _eval(step, phase, correct, broken):
    per_task = [
        {"task_id": f"t{i}", "n": 4, "correct": c, "best": float(c > 0), "tool_episodes": 4}
        for i, c in enumerate(correct)
    ]
    from coderl.eval.passk import summarize

    rec = summarize(per_task, [1, 4], 4).to_dict()
    rec.update(step=step, temperature=1.0, time_s=30.0, broken_calls=broken)
    rec["broken_episode_rate"] = broken / 2
    return {**rec, **({"phase": phase} if phase else {})}


def _tiny_run(tmp_path, signal=True):
    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/tests": 0.1 * s,
            "reward/broken_calls": -0.05,
            "resolved_rate": 0.1 * s,
            "time/rollout": 2.0,
            "time/train": 0.5,
            **({"signal/groups_with_signal": 0.25 * s, "pool/active": 10.0} if signal else {}),
        }
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [
        _eval(0, "base", [0] * 16, 1.0),
        _eval(0, "sft", [0] * 8 + [1] * 8, 0.6),
        _eval(3, None, [0] * 8 + [3] * 8, 0.2),
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    from coderl.eval.summary import write_phases

    write_phases(tmp_path, {"sft_s": 100.0, "train_s": 200.0})
    return write_report(tmp_path).read_text()


def test_report_of_a_tiny_run_shows_the_summary_and_the_rl_curves(tmp_path):
    html = _tiny_run(tmp_path)
    for png in ("heldout.png", "reward.png", "resolved.png", "signal.png", "pool.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
        assert png in html
    # the summary: every phase's pass@1 with CI, the RL-only and whole-run paired changes
    assert "pass@1, base model" in html and "pass@1, after SFT" in html
    assert "pass@1, after RL (step 3)" in html and "n=4, T=1" in html
    # RL only: 8 tasks go from 1/4 to 3/4: +0.25 on average over 16 tasks, CI above 0
    assert "RL only: pass@1 change (paired, 95% CI)</th><td>+0.250 [+0." in html
    assert "(excludes zero)" in html and "whole run: pass@1 change" in html
    assert "pass@4 before -&gt; after RL (collapse check)" in html
    assert "0.60 -&gt; 0.20 (episodes with one: 30% -&gt; 10%)" in html
    assert "SFT 100 s" in html and "RL 3 steps 8 s" in html and "total 5.0 min" in html
    assert "not logged by this run" not in html


def test_report_says_when_groups_with_signal_were_not_logged(tmp_path):
    html = _tiny_run(tmp_path, signal=False)
    assert "signal.png" not in html and "pool.png" not in html
    assert "Groups with signal: not logged by this run" in html


def test_step_axes_have_integer_ticks():
    from coderl.eval.report import _figure, heldout_figure

    fig, ax = _figure("t")
    ax.plot([1, 2, 3], [0.0, 1.0, 0.5])
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    est = {"mean": 0.2, "lo": 0.1, "hi": 0.3}
    evals = [{"step": s, "samples": 4, "pass_at": {"1": est}} for s in (0, 1, 2)]
    fig, ax = heldout_figure([{**evals[0], "phase": "base"}, *evals])
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert len(ax.collections) >= 2  # the CI band and the base model's error bar
