"""A user's first day (issue 48), tenth pass: ``threads`` sets torch's intra-op threads in
every command that runs torch, before the model loads (``--threads`` in those that read no
config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import coderl.online.cycle
import coderl.train.run
from coderl.cli import main

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
ONLINE = str(ROOT / "configs" / "online-demo.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false"]


pytestmark = pytest.mark.usefixtures("one_torch_thread_each")  # conftest: tests set threads


# --- threads: torch's intra-op threads, set before the model loads ------------------------------


class ModelLoads(RuntimeError):
    """Raised where a command loads its model, holding torch's thread count at that moment."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.threads = threads


def _stop_at_model(*args, **kwargs):
    raise ModelLoads(torch.get_num_threads())


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TOY, *FAST],
        ["train-async", TOY, *FAST],
        ["sft", str(ROOT / "configs" / "default.yaml"), "model.name=tiny-random"],
        ["demo", "--config", TOY, *FAST],
        ["serve", ONLINE, "--port", "0"],
    ],
    ids=lambda argv: argv[0],
)
def test_threads_is_set_before_the_model_loads(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    monkeypatch.setattr(coderl.online.cycle, "load_policy", _stop_at_model)
    torch.set_num_threads(2)  # not 1: the command must change it
    with pytest.raises(ModelLoads) as got:
        main([*argv, f"run_dir={tmp_path / 'run'}", "threads=1"])
    assert got.value.threads == 1


def test_threads_is_set_before_eval_and_export_load_the_model(tmp_path, monkeypatch):
    run = tmp_path / "run"
    argv = [*FAST, "trainer.steps=1", "rollout.group_size=2", "rollout.max_new_tokens=2"]
    assert main(["train", TOY, *argv, f"run_dir={run}", "--no-report"]) == 0
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    torch.set_num_threads(2)
    with pytest.raises(ModelLoads) as got:
        main(["eval", str(run), "threads=1"])
    assert got.value.threads == 1
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(saved.replace("\nthreads: null\n", "\nthreads: 1\n"))
    torch.set_num_threads(2)
    with pytest.raises(ModelLoads) as got:  # export reads the run's config.yaml
        main(["export", str(run)])
    assert got.value.threads == 1


def test_threads_is_set_by_an_online_cycle(tmp_path, capsys):
    torch.set_num_threads(2)
    assert main(["online", "cycle", ONLINE, f"run_dir={tmp_path / 'run'}", "threads=1"]) == 0
    assert "waiting" in capsys.readouterr().out  # no traffic yet: no model loaded, threads set
    assert torch.get_num_threads() == 1


def test_threads_left_out_keeps_torchs_default(tmp_path, monkeypatch):
    monkeypatch.setattr(coderl.train.run, "load_policy", _stop_at_model)
    torch.set_num_threads(2)
    with pytest.raises(ModelLoads) as got:
        main(["train", TOY, *FAST, f"run_dir={tmp_path / 'run'}"])
    assert got.value.threads == 2


def _config_less(tmp_path: Path, command: str) -> list[str]:
    """``coderl COMMAND ...`` of a command that runs torch and reads no config, with inputs
    that pass its checks before the model loads."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [("a", "good a", "bad a", "train"), ("b", "good b", "bad b", "heldout")]
    keys = ("context", "chosen", "rejected", "split")
    pairs.write_text("".join(json.dumps(dict(zip(keys, r, strict=True))) + "\n" for r in rows))
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "rm.json").write_text(json.dumps({"backbone": "tiny-random"}))
    (rm / "rm.safetensors").write_bytes(b"")
    return {
        "rm train": ["rm", "train", "--pairs", str(pairs), "--out", str(tmp_path / "out")],
        "rm eval": ["rm", "eval", str(rm), "--pairs", str(pairs)],
        "agent": ["agent", "--workspace", str(tmp_path), "--task", "fix it"],
        "tasks build-env": ["tasks", "build-env", str(tmp_path), "--builder", "model"],
    }[command]


@pytest.mark.parametrize("command", ["rm train", "rm eval", "agent", "tasks build-env"])
def test_threads_is_set_before_a_config_less_command_loads_its_model(
    command, tmp_path, monkeypatch
):
    import coderl.policy
    import coderl.policy.loading

    monkeypatch.setattr(coderl.policy, "load_policy", _stop_at_model)
    monkeypatch.setattr(coderl.policy.loading, "load_policy", _stop_at_model)
    argv = _config_less(tmp_path, command)
    for given, want in ((["--threads", "1"], 1), ([], 2)):  # left out: torch's as it was
        torch.set_num_threads(2)
        with pytest.raises(ModelLoads) as got:
            main([*argv, *given])
        assert got.value.threads == want


def test_threads_flag_below_one_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*_config_less(tmp_path, "agent"), "--threads", "0"])
    assert stop.value.code == 2
    assert "--threads: must be at least 1 (got 0)" in capsys.readouterr().err


def test_threads_below_one_is_a_config_error(tmp_path, capsys):
    assert main(["train", TOY, f"run_dir={tmp_path / 'run'}", "threads=0"]) == 2
    err = capsys.readouterr().err
    assert "threads: must be at least 1 (got 0)" in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


# --- a resumed run shows each step once in TensorBoard -----------------------------------------


def _tb_scalars(tb_dir: Path) -> list[tuple[str, int, float]]:
    """Every scalar of every event file in ``tb_dir`` as a reader without TensorBoard's restart
    handling sees it (the Rust data server, ``summary_iterator``)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    rows = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                rows.append((v.tag, event.step, round(float(v.tensor.float_val[0]), 3)))
    return rows


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    from coderl.metrics import MetricsLogger

    killed = MetricsLogger(tmp_path)
    for step in range(1, 5):  # checkpointed at 2, killed after logging 4
        killed.log(step, {"loss": float(step)})
    killed.close()
    resumed = MetricsLogger(tmp_path, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    assert _tb_scalars(tmp_path / "tb") == [
        ("loss", 1, 1.0),
        ("loss", 2, 2.0),
        ("loss", 3, 13.0),
        ("loss", 4, 14.0),
    ]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]


# --- the gate's reasons: one row per metric, none that contradicts another ----------------------


def test_each_gated_metric_that_fails_is_one_reason():
    from coderl.config.online import GateConfig
    from coderl.online.gate import run_gate

    # worse on one task of five, better on none: the bound and the no-gain check both fail
    rep = run_gate(GateConfig(), {"pass@1": ([1.0, 0, 0, 0, 0], [1.0, 1, 0, 0, 0])}, None, [])
    assert rep.reasons == [
        "held-out pass@1: candidate 0.200 vs champion 0.400, lower bound of the paired "
        "difference -0.565 <= -margin -0.050 (n=5); worse on 1 of 5 tasks and better on none"
    ]
    # 0.000 vs 0.000 everywhere: nothing was measured, not "worse by the bound" beside it
    rep = run_gate(GateConfig(), {"pass@1": ([0.0] * 5, [0.0] * 5)}, None, [])
    assert not rep.promote and len(rep.reasons) == 1
    assert rep.reasons[0].startswith("not measured: candidate and champion both score 0.000")


# --- a preset named from outside the checkout: the error gives its path -------------------------


@pytest.mark.parametrize("named", ["configs/toy.yaml", "toy", "toy.yaml"])
def test_a_preset_named_outside_the_checkout_is_answered_with_its_path(
    named, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["train", named]) == 2
    err = capsys.readouterr().err
    assert f"the shipped preset is {ROOT.resolve() / 'configs' / 'toy.yaml'}: give that path" in err


def test_a_config_that_is_no_preset_says_where_the_presets_are(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "mine.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"the shipped ones in {ROOT.resolve() / 'configs'}" in err


# --- the numbers a user reads carry no float noise ----------------------------------------------


def test_logged_and_reported_numbers_carry_no_float_noise(tmp_path):
    from coderl.eval.summary import write_phases
    from coderl.metrics import MetricsLogger, read_jsonl

    noisy = 0.1 + 0.2  # 0.30000000000000004
    est = {"mean": noisy, "lo": 0.0, "hi": 1.0 / 3.0}
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"cpu_s/rollout_children": 0.2646170000000012, "loss": noisy})
    logger.log_eval(1, {"pass_at": {"1": est}, "best_of_n": est, "time_s": 3.0464139999999995})
    logger.close()
    write_phases(tmp_path, {"train_s": noisy})
    for name in ("metrics.jsonl", "eval.jsonl", "phases.json"):
        text = (tmp_path / name).read_text()
        assert "0000000" not in text and "9999999" not in text, (name, text)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["cpu_s/rollout_children"] == 0.264617
    record = read_jsonl(tmp_path / "eval.jsonl")[0]
    assert record["pass_at"]["1"] == {"mean": 0.3, "lo": 0.0, "hi": 0.333333333333}


# --- Ctrl-C in train-async keeps the last completed step --------------------------------------


@pytest.mark.parametrize(
    "where, kept", [("update", 3), ("wait", 2)], ids=["in-update-step-finished", "waiting"]
)
def test_ctrl_c_in_train_async_keeps_the_last_completed_step(
    tmp_path, monkeypatch, capsys, where, kept
):
    import os
    import signal

    from coderl.asyncrl.local import LocalBackend
    from coderl.asyncrl.trainer import TrainLearner
    from coderl.metrics import read_jsonl
    from coderl.rundir import list_checkpoints

    train_step, poll = TrainLearner.train_step, LocalBackend.poll
    done = []

    def signalled(self, groups):  # SIGINT lands in the third step's update, which holds it
        if self.run.step == 2 and where == "update":
            os.kill(os.getpid(), signal.SIGINT)
        out = train_step(self, groups)
        done.append(self.run.step)
        return out

    def waiting(self, timeout):  # Ctrl-C while the trainer waits for the third step's groups
        if where == "wait" and done and done[-1] == 2:
            raise KeyboardInterrupt
        return poll(self, timeout)

    monkeypatch.setattr(TrainLearner, "train_step", signalled)
    monkeypatch.setattr(LocalBackend, "poll", waiting)
    run = tmp_path / "run"
    argv = [
        *FAST,
        "trainer.steps=4",
        "trainer.checkpoint_every=50",  # no checkpoint before the end
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        f"run_dir={run}",
        "--no-report",
    ]
    assert main(["train-async", TOY, *argv]) == 130
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "interrupted" in x]
    assert len(line) == 1 and "Traceback" not in err, err
    assert f"(step {kept}); resume with: coderl train-async --resume {run}" in line[0], line
    assert [p.name for p in list_checkpoints(run)] == [f"step-{kept:06d}"]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, kept + 1))
    monkeypatch.undo()
    assert main(["train-async", "--resume", str(run), "--no-report"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_ctrl_c_in_a_sharded_run_is_said_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    import logging

    from coderl.train import loop

    def interrupted(run, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "rollout_round", interrupted)
    level = logging.getLogger().level  # a rank above 0 silences library logging
    argv = ["train", TOY, *FAST, "--no-report"]
    try:
        for rank, said in (("1", 0), ("0", 1)):
            monkeypatch.setenv("RANK", rank)
            run = tmp_path / f"rank{rank}"
            assert main([*argv, f"run_dir={run}"]) == 130
            err = capsys.readouterr().err
            assert len([x for x in err.splitlines() if "interrupted" in x]) == said, err
    finally:
        logging.getLogger().setLevel(level)


def test_train_async_stopped_before_any_step_gives_the_command_that_starts_over(
    tmp_path, monkeypatch, capsys
):
    from coderl.asyncrl.local import LocalBackend

    def interrupted(self, timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalBackend, "poll", interrupted)
    run = tmp_path / "run"
    argv = ["train-async", TOY, *FAST, "eval.before_after=true", "eval.tasks=2"]
    assert main([*argv, f"run_dir={run}", "--no-report"]) == 130  # after the evaluation
    line = [x for x in capsys.readouterr().err.splitlines() if "interrupted" in x]
    again = f"start again with: rm {run / 'eval.jsonl'} && coderl train-async {TOY} "
    assert len(line) == 1 and again in line[0], line


def test_resume_drops_a_log_line_the_killed_writer_cut_short(tmp_path):
    from coderl.metrics import MetricsLogger, read_jsonl

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    MetricsLogger(tmp_path, resume_step=2, tensorboard=False).close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
