"""``coderl demo`` end to end on the toy preset (tiny random model, seconds): the summary it
prints and the phase times it records are the ones the report shows."""

import json

from coderl.demo import DEFAULT_CONFIG, run_demo


def test_demo_prints_the_run_summary_and_records_phase_times(tmp_path, capsys):
    toy = DEFAULT_CONFIG.parent / "toy.yaml"
    run_dir = tmp_path / "toy"
    overrides = [f"run_dir={run_dir}", "trainer.steps=2", "tensorboard=false", "progress=false"]
    assert run_demo(toy, overrides) == 0
    out = capsys.readouterr().out
    for line in (
        "pass@1, start",
        "pass@1, after RL (step 2)",
        "RL only: pass@1 change",
        "pass@4 before -> after RL",
        "broken calls per episode",
        "phase times",
    ):
        assert line in out, line
    phases = json.loads((run_dir / "phases.json").read_text())
    assert set(phases) == {"train_s"} and phases["train_s"] > 0  # the toy preset has no SFT
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e.get("phase") for e in evals] == ["start", None]
    assert all(e["time_s"] > 0 and e["temperature"] == 0.8 for e in evals)
    assert "RL only: pass@1 change" in (run_dir / "report" / "index.html").read_text()
