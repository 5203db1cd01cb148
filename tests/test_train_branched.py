"""``coderl train configs/branched.yaml`` end to end on the tiny random model: branched rollouts
of multi-turn function-repair tasks in real sandboxes, ``algorithm.advantage=vineppo``, two
steps, and ``coderl train --resume`` from the step-1 checkpoint equal to the uninterrupted run,
bit for bit, though the resumed run's first episode has its fork and its tool calls slowed by
0.2 s each: the runner's batches do not depend on how long a tool call takes.

The tiny model solves nothing; its rewards vary through the broken-call penalty (it samples the
xml call markup now and then), which is what gives the per-turn advantages something to be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from metrics_compare import stable
from safetensors.torch import load_file
from test_agent_branch import delay
from test_graders_wired import one_torch_thread  # noqa: F401 - autouse: one torch thread

from coderl.cli import main
from coderl.eval.audit import read_audit_records
from coderl.metrics import read_jsonl
from coderl.train import pipeline as P

PRESET = Path(__file__).parent.parent / "configs" / "branched.yaml"
TINY = [
    "model.name=tiny-random",
    "sft.enabled=false",
    "tensorboard=false",
    "progress=false",
    "eval.before_after=false",
    "tasks.tasks_per_step=1",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=32",
    "rollout.max_context_tokens=8192",  # the tiny vocabulary spends many tokens on the statement
    "rollout.branch.turns=[1]",
    "rollout.branch.k=1",
    "trainer.steps=2",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=5",
]


def test_branched_vineppo_trains_and_resumes_exactly(tmp_path, monkeypatch):
    batches = []
    make = P.make_batch

    def spy(*args, **kwargs):
        batch = make(*args, **kwargs)
        batches.append(batch)
        return batch

    monkeypatch.setattr(P, "make_batch", spy)
    ref = tmp_path / "ref"
    assert main(["train", str(PRESET), *TINY, f"run_dir={ref}", "--no-report"]) == 0
    rows = read_jsonl(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # 2 episodes, each forks k=1 continuation after turn 1; each continuation was graded
        assert r["branch/continuations"] == 2 and r["branch/masked_rate"] == 0
        assert r["branch/value_known_rate"] == 1  # the one inner boundary has its value
        assert r["time/branch_grading"] > 0 and r["episode/turns"] == 2
        assert r["advantage/std"] > 0 and r["advantage/zero_frac"] < 1  # signal to train on
        assert r["optimizer_steps"] == 1 and r["grad_norm"] > 0
    # per-token advantages (B, T): a turn's sampled tokens carry its turn's advantage
    assert all(b is not None and b.advantages.shape == b.loss_mask.shape for b in batches)
    w1, w2 = (load_file(ref / "checkpoints" / f"step-00000{s}" / "trainable.safetensors") for s in (1, 2))  # fmt: skip
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # the second step moved the weights

    # a run that stopped after its step-1 checkpoint: the same directory without step 2
    cut = tmp_path / "cut"
    shutil.copytree(ref, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000002")
    cfg_text = (cut / "config.yaml").read_text().replace(str(ref), str(cut))
    (cut / "config.yaml").write_text(cfg_text)
    delay(monkeypatch, forks_of=0, tools_of=0)  # timings differ; the batches must not
    assert main(["train", "--resume", str(cut), "--no-report"]) == 0
    assert stable(read_jsonl(cut / "metrics.jsonl")) == stable(rows)  # every value, exactly
    assert read_audit_records(cut) == read_audit_records(ref)
    a, b = (d / "checkpoints" / "step-000002" for d in (ref, cut))
    assert json.loads((a / "state.json").read_text()) == json.loads((b / "state.json").read_text())
    wa, wb = load_file(a / "trainable.safetensors"), load_file(b / "trainable.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (cut / "resume.jsonl").exists()  # nothing changed on resume
