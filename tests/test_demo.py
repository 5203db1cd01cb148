"""``coderl demo`` end to end on the toy preset (tiny random model, seconds): the summary it
prints and the phase times it records are the ones the report shows."""

import json
import os

from coderl.cli.demo import DEFAULT_CONFIG, run_demo


def plausible_cpu(wall: float) -> float:
    """The most CPU seconds a process can spend in ``wall`` seconds: every core busy, plus the
    clocks' granularity."""
    return wall * (os.cpu_count() or 1) + 0.05


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
        "phase times",
    ):
        assert line in out, line
    assert "broken calls" not in out and "prefill" not in out  # single replies: not measured
    phases = json.loads((run_dir / "phases.json").read_text())
    # the toy preset has no SFT
    assert set(phases) == {"train_s", "train_cpu_s", "train_children_cpu_s"}
    assert 0 < phases["train_cpu_s"] <= plausible_cpu(phases["train_s"])
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e.get("phase") for e in evals] == ["start", None]
    assert all(e["time_s"] > 0 and e["temperature"] == 0.8 for e in evals)
    for e in evals:  # the work a FLOP profile reads (bench/demo_profile.py)
        perf = e["perf"]
        assert 0 < perf["cpu_s/eval"] <= plausible_cpu(e["time_s"])
        assert perf["engine/decoded_tokens"] > 0 and perf["engine/prefilled_tokens"] > 0
        assert perf["engine/decode_attended"] > perf["engine/decoded_tokens"]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in steps:
        for span in ("rollout", "grading", "train"):
            assert 0 < m[f"cpu_s/{span}"] <= plausible_cpu(m[f"time/{span}"]), span
            assert m[f"cpu_s/{span}_children"] >= 0
        assert m["engine/decoded_tokens"] > 0 and m["engine/prefill_attended"] > 0
        assert m["forward_tokens"] >= m["trained_tokens"] > 0
        assert m["forward_attended"] > m["forward_tokens"]
    assert "RL only: pass@1 change" in (run_dir / "report" / "index.html").read_text()


def test_the_base_model_is_evaluated_with_eval_base_samples(tmp_path):
    # The base-model evaluation may use fewer samples than the two that bound the RL phase;
    # the after-SFT and final evaluations keep eval.samples, pass@1 and pass@n each.
    import torch
    from safetensors.torch import save_file

    from coderl.config import load_config
    from coderl.metrics import read_jsonl
    from coderl.train.checkpoint import trainable_state
    from coderl.train.loop import setup_run, train

    toy = DEFAULT_CONFIG.parent / "toy.yaml"
    over = ["progress=false", "tensorboard=false", "trainer.steps=1", "eval.base_samples=1"]
    cfg = load_config(toy, [f"run_dir={tmp_path / 'run'}", "sft.enabled=true", *over])
    run = setup_run(cfg, load_sft=False)
    warm = {k: torch.zeros_like(v) for k, v in trainable_state(run.policy.model).items()}
    (tmp_path / "run" / "sft").mkdir(parents=True)
    save_file(warm, str(tmp_path / "run" / "sft" / "trainable.safetensors"))
    evals = read_jsonl(train(cfg) / "eval.jsonl")
    assert [(e.get("phase"), e["samples"], sorted(e["pass_at"])) for e in evals] == [
        ("base", 1, ["1"]),
        ("sft", 4, ["1", "4"]),
        (None, 4, ["1", "4"]),
    ]
