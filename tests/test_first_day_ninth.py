"""A user's first day (issue 48), ninth pass: Ctrl-C before the first checkpoint keeps the
completed steps (resumable, exactly), a run that learned nothing says so, PPO's per-update
metrics come from one epoch, and ``coderl rm train`` refuses pairs it cannot learn or measure
instead of printing NaN."""

import json
import os
import signal
from pathlib import Path

import pytest
from metrics_compare import assert_same_metrics

from coderl.cli import main
from coderl.config import load_config
from coderl.metrics import read_jsonl
from coderl.rundir import list_checkpoints
from coderl.train import loop
from coderl.train import run as run_mod

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
COMMON = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.steps=4",
    "trainer.checkpoint_every=50",  # no checkpoint before the end
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
]


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if "CODERL_TRACEBACK" not in x]
    assert len(lines) == 1, err
    return lines[0]


# --- 1. Ctrl-C before the first checkpoint keeps the completed steps ---------------------------


def _interrupt_at(monkeypatch, name: str, at: int, *, signal_self: bool) -> None:
    """Interrupt the third step (run.step == ``at``) in ``loop.<name>``: raise KeyboardInterrupt
    there (a signal handled at once), or send this process SIGINT and carry on (a signal that
    lands in the update, which holds it)."""
    real = getattr(loop, name)

    def patched(run, *a, **k):
        if run.step == at:
            if not signal_self:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return real(run, *a, **k)

    monkeypatch.setattr(loop, name, patched)


@pytest.mark.parametrize(
    "where, at, signal_self, kept",
    [("rollout_round", 2, False, 2), ("optimize", 2, True, 3), ("run_eval", 3, False, 3)],
    ids=["in-rollouts-step-abandoned", "in-update-step-finished", "in-eval-step-kept"],
)
def test_ctrl_c_before_the_first_checkpoint_keeps_the_completed_steps_exactly(
    tmp_path, monkeypatch, capsys, where, at, signal_self, kept
):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    common = [*COMMON, "eval.every=3", "eval.tasks=2", "eval.samples=2", "eval.k=[1,2]"]
    loop.train(load_config(TOY, [*common, f"run_dir={ref_dir}"]))
    _interrupt_at(monkeypatch, where, at, signal_self=signal_self)
    assert main(["train", TOY, *common, f"run_dir={cut_dir}", "--no-report"]) == 130
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "interrupted" in x]
    assert len(line) == 1 and "Traceback" not in err, err
    line = line[0]
    assert [p.name for p in list_checkpoints(cut_dir)] == [f"step-{kept:06d}"]
    assert f"(step {kept}); resume with: coderl train --resume {cut_dir}" in line, line
    assert [r["step"] for r in read_jsonl(cut_dir / "metrics.jsonl")] == list(range(1, kept + 1))
    monkeypatch.undo()
    assert main(["train", "--resume", str(cut_dir), "--no-report"]) == 0
    ref, cut = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(cut_dir / "metrics.jsonl")
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    assert_same_metrics(ref, cut)


def test_stopped_before_any_step_the_line_and_the_refusal_give_the_command_that_starts_over(
    tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    argv = ["train", TOY, *COMMON, "eval.before_after=true", "eval.tasks=2", f"run_dir={run}"]
    _interrupt_at(monkeypatch, "rollout_round", 0, signal_self=False)
    assert main([*argv, "--no-report"]) == 130  # after the evaluation before training
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "interrupted" in x]
    again = f"start again with: rm {run / 'eval.jsonl'} && coderl train {TOY} "
    assert len(line) == 1 and again in line[0], err
    assert list_checkpoints(run) == []
    monkeypatch.undo()
    assert main([*argv, "--no-report"]) == 2  # refused over the kept log, and says how to go on
    said = _one_line_error(capsys.readouterr().err)
    assert f"start over there: rm {run / 'eval.jsonl'} then the same command again" in said, said


def test_starting_over_removes_the_tensorboard_events_with_the_logs(tmp_path):
    """The command that starts a stopped run over also removes its TensorBoard events: left
    behind, TensorBoard draws the old run's steps over the new run's."""
    import subprocess

    from coderl.rundir import existing_logs, start_over

    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events.out.tfevents.1").write_text("old")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    command = start_over(existing_logs(run))
    assert command == f"rm -r {run / 'metrics.jsonl'} {run / 'tb'}"
    subprocess.run(command, shell=True, check=True)
    assert sorted(run.iterdir()) == []
    (run / "eval.jsonl").write_text("{}\n")  # no events: the plain rm, as before
    assert start_over(existing_logs(run)) == f"rm {run / 'eval.jsonl'}"


def test_a_run_stopped_during_sft_leaves_no_directory_behind(tmp_path):
    """The demo makes its run's ``sft`` directory before SFT writes into it; stopped then,
    the run directory is left as found (none), so the next demo has no "previous run" to move
    aside. An ``sft`` directory that holds weights is a result and stays."""
    from coderl.rundir import run_lock

    run = tmp_path / "runs" / "repair"
    with pytest.raises(KeyboardInterrupt), run_lock(run, "coderl demo"):
        (run / "sft").mkdir()
        raise KeyboardInterrupt
    assert not run.exists() and not run.parent.exists()
    with pytest.raises(KeyboardInterrupt), run_lock(run, "coderl demo"):
        (run / "sft").mkdir()
        (run / "sft" / "trainable.safetensors").write_bytes(b"weights")
        raise KeyboardInterrupt
    assert (run / "sft" / "trainable.safetensors").is_file()


# --- 2. a run with no learning signal says so, per step and at its end -------------------------


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_a_run_whose_steps_had_no_signal_says_so(tmp_path, monkeypatch, capsys, command):
    from coderl.envs.base import GradeRecord
    from coderl.envs.toy import ToyEnvironment

    monkeypatch.setattr(ToyEnvironment, "grade", lambda self, t, eps: [GradeRecord() for _ in eps])
    run = tmp_path / "run"
    argv = [command, TOY, *COMMON, "trainer.steps=2", f"run_dir={run}", "--no-report"]
    assert main(argv) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["optimizer_steps"] > 0 for r in rows] == [True, True]  # it stepped, on nothing
    assert [r["advantage/zero_frac"] for r in rows] == [1.0, 1.0]
    assert all("no signal" in run_mod.step_status(r) for r in rows)
    err = capsys.readouterr().err
    assert "WARNING: none of steps 1-2 had a learning signal" in err, err


def test_a_step_with_signal_is_not_called_without():
    row = {"episodes": 8.0, "reward/mean": 0.5, "resolved_rate": 0.5, "optimizer_steps": 1.0}
    row |= {"advantage/zero_frac": 0.25, "grad_norm": 0.3}
    assert "no signal" not in run_mod.step_status(row)
    counter = run_mod.UpdateCount(0)
    counter.saw(row)
    counter.saw({**row, "advantage/zero_frac": 1.0, "grad_norm": 0.0})
    assert counter.signal == 1 and counter.updates == 2
    assert "no signal" in run_mod.step_status({**row, "grad_norm": 0.0})


# --- 3. PPO epochs: every per-update metric from the same (last) epoch -------------------------


def _batch(policy, n=4):
    import torch

    from coderl.train.batch import build_batch
    from coderl.trajectory import Segment

    g, segs = torch.Generator().manual_seed(1), []
    for i in range(n):
        ids = torch.randint(3, 100, (6 + i,), generator=g).tolist()
        seg = Segment()
        seg.append_context(ids[:3])
        seg.append_sampled(ids[3:], [-1.0 - 0.1 * j for j in range(len(ids) - 3)], 0)
        segs.append(seg)
    return build_batch(segs, [1.0, -1.0, 0.5, -0.5][:n], policy.pad_token_id)


def test_ppo_epochs_log_the_last_epochs_loss_with_its_clip_fractions():
    import torch

    from coderl.policy.loading import load_policy
    from coderl.train.step import accumulate_gradients, optimizer_step, train_step

    cfg = load_config(TOY, ["trainer.update_epochs=2", "trainer.lr=0.05"])
    alg, tr = cfg.algorithm, cfg.trainer

    def fresh():
        policy = load_policy("tiny-random")
        opt = torch.optim.AdamW(policy.trainable_parameters(), lr=0.05)
        return policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    policy, opt, sched = fresh()
    batch = _batch(policy)
    got = train_step(policy.model, opt, sched, batch, alg, tr, temperature=1.0, max_len=8)
    # the same two epochs by hand: the second one's metrics are the ones to log
    policy, opt, sched = fresh()
    params, cache, epochs = policy.trainable_parameters(), {}, []
    for _ in range(2):
        m = accumulate_gradients(policy.model, batch, alg, micro_batch_size=tr.micro_batch_size,
                                 temperature=1.0, max_len=8, old_logp_cache=cache)  # fmt: skip
        m.update(optimizer_step(params, opt, sched, tr.grad_clip))
        epochs.append(m)
    first, last = epochs
    assert abs(first["pg_loss"] - last["pg_loss"]) > 1e-4  # the first update moved the ratio
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "approx_kl", "clip_frac_high"):
        assert got[k] == pytest.approx(last[k], rel=1e-5, abs=1e-7), k
    assert got["logprob_gap"] == pytest.approx(first["logprob_gap"], rel=1e-5)  # before any


# --- 4. coderl rm train: no pairs it cannot learn or measure, never NaN ------------------------


def test_rm_train_refuses_pairs_without_text_and_without_a_heldout_pair(tmp_path, capsys):
    from coderl.graders.rm import PairwiseAccuracy, summary

    eps = tmp_path / "eps.jsonl"  # toy episodes: no statement, diff or tool log
    rows = [{"task_id": f"t{i % 5}", "statement": "", "diff": "", "resolved": i % 2 == 0}
            for i in range(20)]  # fmt: skip
    eps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    # a backbone that does not exist: the refusals come before it would load
    base = ["rm", "train", "--out", str(out), "--backbone", "no-such-model", "--steps", "1"]
    assert main([*base, "--episodes", str(eps)]) == 2
    said = _one_line_error(capsys.readouterr().err)
    assert "carry no text to learn from" in said, said
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"context": f"c{i}", "chosen": "good", "rejected": "bad"})
                             + "\n" for i in range(6)))  # fmt: skip
    assert main([*base, "--pairs", str(pairs), "--heldout", "0"]) == 2
    said = _one_line_error(capsys.readouterr().err)
    assert "no held-out pair to measure the reward model on (6 pairs of 6 contexts" in said, said
    assert not out.exists()
    empty = summary(PairwiseAccuracy(0, 0, float("nan"), float("nan"), float("nan")), [])
    assert empty == {"n": 0, "correct": 0}  # absent, not NaN
    json.dumps(empty, allow_nan=False)
