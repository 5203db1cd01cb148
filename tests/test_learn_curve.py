"""The learning curve (``make learn``: ``bench/learn_curve.py``, :mod:`coderl.eval.curve`): a
tiny run with a held-out evaluation every step writes the curve's data and picture, the report
embeds them, and a planted collapse is marked where it happened (and nowhere in a flat run)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from coderl.eval.curve import ALARM_LABEL, curve_data, curve_figure
from coderl.eval.passk import summarize
from coderl.train import loop

ROOT = Path(__file__).parent.parent
TOY = ROOT / "configs" / "toy.yaml"


def _bench():
    spec = importlib.util.spec_from_file_location("learn_curve", ROOT / "bench" / "learn_curve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _learn(run_dir: Path, monkeypatch, correct_at) -> dict:
    """``bench/learn_curve.py`` on the toy preset (tiny random model, difficulty pool): 3
    steps, an evaluation every step whose per-task counts are ``correct_at(step)`` of 2."""
    real = loop.run_eval

    def planted(run, *a, **kw):
        rec = real(run, *a, **kw)
        for t in rec["per_task"]:
            t["correct"] = correct_at(run.step)
        ks = [int(k) for k in rec["pass_at"]]
        rec.update(summarize(rec["per_task"], ks, rec["samples"]).to_dict())  # its CIs too
        return rec

    monkeypatch.setattr(loop, "run_eval", planted)
    over = ["progress=false", "tensorboard=false", "tasks.tasks_per_step=1", "tasks.sampler=pool"]
    over += ["rollout.group_size=2", "eval.tasks=6", "eval.samples=2", "eval.k=[1,2]"]
    argv = ["--config", str(TOY), "--steps", "3", "--every", "1", "--run-dir", str(run_dir)]
    assert _bench().main(argv + over) == 0
    return json.loads((run_dir / "report" / "curve.json").read_text())


def _alarm_lines(ax) -> list[float]:
    """x of the vertical dashed red lines on ``ax`` (the alarm marks)."""
    xs = []
    for line in ax.get_lines():
        x = line.get_xdata()
        if line.get_linestyle() == "--" and len(x) == 2 and x[0] == x[1]:
            xs.append(float(x[0]))
    return xs


def test_a_planted_collapse_is_in_the_curve_data_the_picture_and_the_report(
    tmp_path, monkeypatch, capsys
):
    # every held-out task solved 2 of 2 times until step 2, then never: steps 2 and 3 fall
    # by 1.0 from step 0's pass@2 (the CI of an all -1 paired change is [-1, -1])
    data = _learn(tmp_path / "fall", monkeypatch, lambda step: 2 if step < 2 else 0)
    assert [e["step"] for e in data["evals"]] == [0, 1, 2, 3]
    assert [e["alarm"] for e in data["evals"]] == [None, False, True, True]
    assert data["alarms"] == [2, 3]
    one = data["evals"][3]["pass_at"]["1"]
    assert (one["mean"], one["lo"], one["hi"]) == (0.0, 0.0, 0.0)
    assert data["evals"][0]["pass_at"]["2"]["mean"] == 1.0
    train = data["train"]
    assert train["step"] == [1, 2, 3]
    for key in ("reward/mean", "reward/tests", "resolved_rate", "pool/active"):
        assert len(train[key]) == 3 and all(v is not None for v in train[key]), key
    assert not any(k.startswith("synth/") for k in train)  # the toy preset has no synthesis
    report = tmp_path / "fall" / "report"
    assert (report / "learning_curve.png").stat().st_size > 5000
    html = (report / "index.html").read_text()
    assert '<img src="learning_curve.png"' in html and 'href="curve.json"' in html
    assert "collapse alarm RAISED at step 2, 3 of 3 checks (marked in red)" in html
    out = capsys.readouterr().out
    assert "collapse alarm RAISED at step 2, 3" in out and "peak RSS" in out and "cpu:" in out

    evals = [json.loads(x) for x in (tmp_path / "fall" / "eval.jsonl").read_text().splitlines()]
    fig = curve_figure(data, evals)
    passk, *others = fig.axes
    assert _alarm_lines(passk) == [2.0, 3.0]
    assert ALARM_LABEL in passk.get_legend_handles_labels()[1]
    crosses = [ln for ln in passk.get_lines() if ln.get_marker() == "x"]
    assert [(float(c.get_xdata()[0]), float(c.get_ydata()[0])) for c in crosses] == [
        (2.0, 0.0),
        (3.0, 0.0),
    ]  # on pass@2 of each alarmed evaluation
    assert len(passk.collections) >= 2  # a CI band for each k
    assert all(_alarm_lines(ax) == [2.0, 3.0] for ax in others)


def test_a_flat_run_has_no_alarm_marks(tmp_path, monkeypatch):
    data = _learn(tmp_path / "flat", monkeypatch, lambda step: 1)
    assert data["alarms"] == [] and [e["alarm"] for e in data["evals"]] == [None] + [False] * 3
    html = (tmp_path / "flat" / "report" / "index.html").read_text()
    assert "collapse alarm not raised in 3 checks" in html
    evals = [json.loads(x) for x in (tmp_path / "flat" / "eval.jsonl").read_text().splitlines()]
    fig = curve_figure(data, evals)
    assert all(_alarm_lines(ax) == [] for ax in fig.axes)
    assert ALARM_LABEL not in fig.axes[0].get_legend_handles_labels()[1]


def test_synthesis_counts_and_nan_steps_in_the_curve_data():
    est = {"mean": 0.5, "lo": 0.25, "hi": 0.75}
    evals = [{"step": 0, "phase": "sft", "samples": 4, "pass_at": {"1": est, "4": est}}]
    rows = [
        {"step": 1, "reward/mean": 0.1, "reward/masked": 2.0, "synth/admitted": 8.0},
        {"step": 2, "reward/mean": 0.2, "synth/admitted": math.nan, "pool/active": 3.0},
    ]
    data = curve_data(evals, rows)
    assert data["train"] == {
        "step": [1, 2],
        "reward/mean": [0.1, 0.2],  # reward/masked is a count, not a term
        "pool/active": [None, 3.0],
        "synth/admitted": [8.0, None],  # NaN (nothing requested) is no value
    }
    assert data["evals"][0]["alarm"] is None and data["alarms"] == []
    fig = curve_figure(data, evals)
    synth = fig.axes[3]
    assert [ln.get_label() for ln in synth.get_lines()] == ["synth/admitted"]
    assert not synth.texts  # drawn, not "synthesis off"
    plain = [{"step": 1, "reward/mean": 0.1}]
    no_synth = curve_figure(curve_data(evals, plain), evals).axes[3]
    assert "synthesis off" in no_synth.texts[0].get_text()
