"""A user's first day (issue 48): no run directory is clobbered, a number that is not a
measurement is never printed as one, a damaged run is recoverable in one line.

Each class is tested through the command line a user types (``coderl.cli.main``) on the toy
task, so a refusal is checked together with its one-line message and exit status."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coderl.cli import main
from coderl.envs.base import GradeRecord
from coderl.envs.toy import ToyEnvironment
from coderl.metrics import read_jsonl
from coderl.train.checkpoint import list_checkpoints, verify_checkpoint
from coderl.train.run import step_status

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
FAST = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.steps=3",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=5",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", TOY, *FAST, f"run_dir={run_dir}", *extra, "--no-report"])


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith("(set CODERL_TRACEBACK")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


# --- 1. nothing clobbers a run directory ------------------------------------------------------

HOLD = """
import sys, time
from coderl.rundir import online_lock, run_lock
role = sys.argv[3:]  # an online role (serve, cycle, ...): held shared, else as the writer
with online_lock(sys.argv[1], role[0], sys.argv[2]) if role else run_lock(*sys.argv[1:3]):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(
    run_dir: Path, who: str = "coderl train (the first one)", role: str | None = None
) -> subprocess.Popen:
    """A process holding ``run_dir``'s lock, recorded as ``who``, until killed: as its writer,
    or for the online ``role`` (:func:`coderl.rundir.online_lock`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", HOLD, str(run_dir), who, *([role] if role else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TOY, *FAST],
        ["train-async", TOY, *FAST],
        ["sft", TOY],
    ],
    ids=["train", "train-async", "sft"],
)
def test_a_second_writer_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path, capsys, argv):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        assert main([*argv, f"run_dir={run_dir}"]) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert f"pid {holder.pid}" in line and "the first one" in line and "in use" in line, line
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed or kill -9'd run
        holder.wait()
    assert _train(run_dir) == 0  # the kernel dropped the lock with its process
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3]  # one writer: each step once


@pytest.mark.parametrize("name", ["metrics.jsonl", "eval.jsonl", "audit.jsonl"])
def test_a_run_stopped_before_its_first_checkpoint_keeps_its_logs(tmp_path, capsys, name):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).write_text('{"step": 1, "precious": true}\n')
    assert _train(run_dir) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert name in line and "run_dir=" in line, line
    assert (run_dir / name).read_text() == '{"step": 1, "precious": true}\n'
    assert not list_checkpoints(run_dir)


def test_a_second_train_into_a_finished_run_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(run_dir) == 0
    before = (run_dir / "metrics.jsonl").read_text()
    assert _train(run_dir, "seed=7") == 2
    assert "--resume" in _one_line_error(capsys.readouterr().err)
    assert (run_dir / "metrics.jsonl").read_text() == before


# --- 2. a number that is not a measurement is never printed as one ----------------------------


def _grade_errors(share: float):
    """A toy grader whose first ``share`` of the episodes of each call fail to grade, as
    repository tasks do whose environments are not built."""
    real = ToyEnvironment.grade

    def grade(self, tasks, episodes):
        out = real(self, tasks, episodes)
        cut = round(share * len(out))
        broken = GradeRecord(grading_error="environment 'toolz-1.0.0' is not built")
        return [broken] * cut + out[cut:]

    return grade


@pytest.fixture
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert _train(run_dir, "trainer.steps=1") == 0
    return run_dir


def test_eval_where_every_episode_failed_to_grade_fails_instead_of_printing_zeros(
    trained, monkeypatch, capsys
):
    monkeypatch.setattr(ToyEnvironment, "grade", _grade_errors(1.0))
    assert main(["eval", str(trained), "k=2"]) == 2
    out, err = capsys.readouterr()
    line = _one_line_error(err)
    assert "nothing was measured" in line and "not built" in line, line
    assert "0.000" not in out and "pass_at" not in out  # no table of zeros on stdout


def test_eval_mostly_masked_says_so_and_counts_them(trained, monkeypatch, capsys):
    monkeypatch.setattr(ToyEnvironment, "grade", _grade_errors(0.5))
    assert main(["eval", str(trained), "k=2"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["grading_errors"] >= result["samples"]  # at least one task's worth
    assert "WARNING" in err and "masked" in err and "not built" in err, err
    assert all(t["n"] == 2 for t in result["per_task"])  # masked samples stay in the denominator


def test_a_step_whose_episodes_were_all_masked_fails_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ToyEnvironment, "grade", _grade_errors(1.0))
    assert _train(tmp_path / "run") == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "all 8 episodes were masked" in line and "nothing to train on" in line, line
    assert not list_checkpoints(tmp_path / "run")  # nothing trained, nothing saved


def test_a_step_status_never_prints_nan_for_what_it_did_not_measure():
    nan = float("nan")
    dropped = {"episodes": 0.0, "reward/mean": nan, "resolved_rate": nan}
    dropped["dynamic/dropped_groups"] = 4.0
    said = step_status(dropped)
    assert "nan" not in said and said.startswith("all 4 groups had zero reward variance"), said
    masked = {"episodes": 8.0, "reward/masked": 6.0, "reward/mean": 0.5, "resolved_rate": 0.5}
    said = step_status(masked)
    assert "6 of 8 episodes masked" in said and "of 2 episodes" in said, said
    plain = {"episodes": 8.0, "reward/masked": 0.0, "reward/mean": 0.25, "resolved_rate": 0.125}
    assert step_status(plain) == "reward 0.250 resolved 12% of 8 episodes"


def test_kl_is_not_logged_as_zero_when_it_is_not_measured(trained):
    rows = read_jsonl(trained / "metrics.jsonl")
    assert rows and all("kl" not in r for r in rows)  # toy: algorithm.kl.coef is 0


def test_eval_base_is_the_base_model_from_any_directory(tmp_path, monkeypatch, capsys):
    """A run with a relative run_dir and an SFT warm start beside its checkpoints: ``--base``
    evaluates the model of ``model.name`` whether run from where the run was started or not."""
    import coderl.policy.rollout as rollout
    from coderl.config import load_config
    from coderl.train.run import build_policy

    monkeypatch.chdir(tmp_path)
    assert _train(Path("runs/rel"), "trainer.steps=1") == 0
    trained = load_config(TOY, [f"run_dir={tmp_path / 'runs/rel'}"])
    sft = tmp_path / "runs/rel/sft"
    sft.mkdir()
    ckpt = list_checkpoints(tmp_path / "runs/rel")[-1]
    (sft / "trainable.safetensors").write_bytes((ckpt / "trainable.safetensors").read_bytes())
    base = [p.detach().clone() for p in build_policy(trained).trainable_parameters()]
    seen = []
    real = rollout.build_engine

    def spy(cfg, policy, **kw):
        seen.append([p.detach().clone() for p in policy.trainable_parameters()])
        return real(cfg, policy, **kw)

    monkeypatch.setattr(rollout, "build_engine", spy)  # what coderl eval builds
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, run in ((tmp_path, "runs/rel"), (elsewhere, str(tmp_path / "runs/rel"))):
        monkeypatch.chdir(cwd)
        assert main(["eval", run, "--base", "k=1", "sft.enabled=true"]) == 0
        record = json.loads(capsys.readouterr().out)  # names the base model, no checkpoint
        assert record["base"] and record["checkpoint"] is None and record["model"], record
    assert len(seen) == 2
    for weights in seen:
        assert all(torch.equal(a, b) for a, b in zip(weights, base, strict=True))


# --- 3. a damaged run is recoverable in one line ----------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_checkpoints_carry_a_manifest_that_finds_damage(tmp_path):
    run_dir = tmp_path / "run"
    assert _train(run_dir) == 0
    ckpts = list_checkpoints(run_dir)
    for c in ckpts:
        files = json.loads((c / "manifest.json").read_text())["files"]
        assert {"trainable.safetensors", "optimizer.pt", "state.json", "rng.pt"} <= set(files)
        verify_checkpoint(c)
    (ckpts[-1] / "rng.pt").write_bytes((ckpts[-1] / "rng.pt").read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="rng.pt differs"):
        verify_checkpoint(ckpts[-1])
    (ckpts[-2] / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=f"newest intact one is {ckpts[-3]}"):
        verify_checkpoint(ckpts[-1])
    for c in ckpts[:-2]:
        (c / "state.json").write_text("{}")
    with pytest.raises(ValueError, match="no intact one is left") as info:  # and the way on
        verify_checkpoint(ckpts[-1])
    assert "start it again with run_dir=... set to a new directory" in str(info.value)


def test_a_truncated_checkpoint_is_named_with_the_intact_one_which_every_command_takes(
    tmp_path, capsys
):
    run_dir = tmp_path / "run"
    assert _train(run_dir) == 0
    step1, step2, step3 = list_checkpoints(run_dir)
    _truncate(step3 / "trainable.safetensors")
    for argv in (
        ["train", "--resume", str(run_dir), "trainer.steps=4"],
        ["eval", str(run_dir), "k=1"],
        ["export", str(run_dir), "--out", str(tmp_path / "export")],
    ):
        assert main(argv) == 2, argv
        line = _one_line_error(capsys.readouterr().err)
        assert f"{step3} is damaged" in line and f"newest intact one is {step2}" in line, line
    assert main(["eval", str(step2), "k=1"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(step2)
    # --resume takes the checkpoint: the damaged newer one is set aside, not deleted
    assert main(["train", "--resume", str(step2), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "step-000003 set aside" in out, out
    assert (run_dir / "checkpoints" / "superseded" / "step-000003").is_dir()
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    verify_checkpoint(list_checkpoints(run_dir)[-1])  # the new step 3, intact


# --- 5. long work shows progress, in a log file too; library noise kept out -------------------


def _logged(argv: list[str], cwd: Path, **env: str) -> str:
    """stderr and stdout of ``coderl ARGV`` as a log file holds them (not a terminal)."""
    run = subprocess.run(
        [sys.executable, "-m", "coderl", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def _progress_lines(log: str, phase: str, total: int) -> list[str]:
    lines = [x for x in log.splitlines() if x.startswith(f"{phase} ") and f"/{total} " in x]
    assert lines, log[-3000:]
    assert all("elapsed" in x and " eta " in x for x in lines), lines
    return lines


def test_train_async_shows_steps_with_total_and_eta_in_a_log(tmp_path):
    log = _logged(["train-async", TOY, *FAST, "progress=true", f"run_dir={tmp_path}/r"], tmp_path)
    lines = _progress_lines(log, "train-async", 3)
    assert lines[-1].startswith("train-async 3/3") and "reward" in lines[-1], lines
    assert "\r" not in log


def test_train_in_a_log_has_progress_lines(tmp_path):
    argv = ["train", TOY, *FAST, "progress=true", f"run_dir={tmp_path}/r", "--no-report"]
    log = _logged(argv, tmp_path)
    assert _progress_lines(log, "train", 3)[-1].startswith("train 3/3")
    setup = log.index("setup: tasks of 'toy', model tiny-random")  # said before it loads
    assert setup < log.index("setup: done in") < log.index("train 1/3"), log[-3000:]
    assert "\r" not in log, log[-3000:]


def test_the_known_library_warning_is_kept_out_and_every_other_one_shown(monkeypatch):
    import io
    import warnings

    from coderl.cli import quiet_libraries

    monkeypatch.setattr(sys, "warnoptions", [])
    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        quiet_libraries(io.StringIO())  # a log file, not a terminal
        peft = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
        warnings.warn(peft, FutureWarning, stacklevel=1)
        warnings.warn("another library's future change", FutureWarning, stacklevel=1)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    assert [w.category for w in got] == [FutureWarning, UserWarning]  # no blanket ignore
    assert os.environ["TQDM_DISABLE"] == "1" == os.environ["HF_HUB_DISABLE_PROGRESS_BARS"]
    monkeypatch.setattr(sys, "warnoptions", ["default"])  # -W / PYTHONWARNINGS wins
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        quiet_libraries(io.StringIO())
        warnings.warn(peft, FutureWarning, stacklevel=1)
    assert [w.category for w in got] == [FutureWarning]


COMMANDS_THAT_PRINT_NO_WARNING = [
    ["--help"],
    ["train", "--help"],
    ["eval", "--help"],
    ["serve", "--help"],
    ["tasks", "--help"],
    ["demo", "--self-check"],
    # builds a LoRA model (peft warned about transformers on every such command) and trains
    ["sft", str(ROOT / "configs" / "default.yaml"), "model.name=tiny-random", "model.lora=true",
     "sft.limit=1", "sft.batch_size=1", "progress=false"],
]  # fmt: skip


@pytest.mark.parametrize("argv", COMMANDS_THAT_PRINT_NO_WARNING, ids=lambda a: " ".join(a[:2]))
def test_commands_print_no_warning_line(tmp_path, argv):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TQDM_DISABLE")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coderl",
            *argv,
            *([f"run_dir={tmp_path}"] if "=" in argv[-1] else []),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    said = [x for x in run.stderr.splitlines() if "Warning" in x or "warn(" in x]
    assert not said, run.stderr[-3000:]
    assert "\r" not in run.stderr


def test_tqdm_bars_are_off_in_a_log_for_the_libraries_a_command_imports(tmp_path):
    """tqdm reads ``TQDM_DISABLE`` when it is imported, and a command's module imports it
    (``coderl sft`` and ``demo``: transformers, the GGUF conversion): the CLI sets it first."""
    code = (
        "import sys\nfrom coderl.cli import main\n"
        f"main(['sft', {TOY!r}, 'no_such_key=1'])\n"
        "import tqdm\nprint(tqdm.tqdm(range(1), file=sys.stderr).disable)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert run.stdout.strip() == "True", run.stdout + run.stderr[-3000:]


def test_sft_shows_progress_and_its_output_is_taken_by_eval_export_and_report(tmp_path, capsys):
    """Class 5 and 4: ``coderl sft`` shows its batches with a total and an ETA, and the run it
    writes is one that ``eval``, ``export`` and ``report`` take; a second ``sft`` into it is
    refused (its weights kept) unless ``--force``."""
    run_dir = tmp_path / "r"
    argv = ["sft", str(ROOT / "configs" / "default.yaml"), "model.name=tiny-random"]
    argv += ["sft.limit=2", "sft.epochs=1", "sft.batch_size=1", f"run_dir={run_dir}"]
    log = _logged(argv, tmp_path)
    lines = _progress_lines(log, "sft epoch 1/1", 2)
    assert "nll/token" in lines[-1] and lines[-1].startswith("sft epoch 1/1 2/2"), lines
    assert [r["step"] for r in read_jsonl(run_dir / "sft" / "metrics.jsonl")] == [1, 2]
    assert main(["eval", str(run_dir), "k=1", "eval.tasks=2"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(run_dir / "sft")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "sft.png").is_file()
    weights = (run_dir / "sft" / "trainable.safetensors").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    assert "--force" in _one_line_error(capsys.readouterr().err)
    assert (run_dir / "sft" / "trainable.safetensors").read_bytes() == weights


def test_rm_train_shows_steps_with_total_and_eta(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"id": f"t{i}", "chosen": f"return x + {i}", "rejected": "return None",
         "split": "heldout" if i < 2 else "train"}
        for i in range(8)
    ]  # fmt: skip
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["rm", "train", "--pairs", str(pairs), "--backbone", "tiny-random"]
    argv += ["--out", str(tmp_path / "rm"), "--steps", "4"]
    log = _logged(argv, tmp_path)
    assert _progress_lines(log, "rm train", 4)[-1].startswith("rm train 4/4"), log[-2000:]


def test_only_rank_0_shows_progress(monkeypatch):
    import io

    from coderl.progress import PhaseProgress

    for rank, shown in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        out = io.StringIO()
        with PhaseProgress("train", 2, stream=out) as bar:
            bar.advance(status="reward 0.5")
        assert bool(out.getvalue()) == shown, (rank, out.getvalue())


# --- 4. every output is usable by the next command --------------------------------------------


def _only_split(keep: str):
    """Toy tasks as a task file of one split holds them (the other split empty)."""
    real = ToyEnvironment.tasks

    def tasks(self, split):
        return real(self, split) if split == keep else []

    return tasks


def test_tasks_that_are_all_train_train_without_heldout_evals(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ToyEnvironment, "tasks", _only_split("train"))
    run_dir = tmp_path / "run"
    assert _train(run_dir, "eval.before_after=true", "eval.every=1") == 0
    err = capsys.readouterr().err
    assert "holds no tasks" in err and "without held-out evaluations" in err, err
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not read_jsonl(run_dir / "eval.jsonl")


def test_eval_takes_a_task_source_of_only_heldout_tasks(trained, monkeypatch, capsys):
    monkeypatch.setattr(ToyEnvironment, "tasks", _only_split("heldout"))
    assert main(["eval", str(trained), "k=1"]) == 0
    assert json.loads(capsys.readouterr().out)["pass_at"]["1"]["mean"] >= 0


# --- 7. names a TRL or verl user can find -------------------------------------------------------


def test_the_metric_name_table_names_only_what_coderl_logs(trained):
    """docs/training.md's table of coderl -> TRL / verl names: every coderl name in its first
    column is logged by a toy run, or is one of the metrics logged only when measured."""
    import re

    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## Metric names for TRL and verl users", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = {n for row in rows for n in re.findall(r"`([^`]+)`", row.split("|")[1])}
    logged = {k for r in read_jsonl(trained / "metrics.jsonl") for k in r}
    conditional = {"kl", "approx_kl", "value_loss", "reward/<term>", "eval/pass@1", "eval/pass@k"}
    conditional |= {"clip_frac_low", "clip_frac_high", "dual_clip_frac"}  # a ratio that can move
    assert len(rows) >= 20 and "reward/mean" in names
    assert names - logged - conditional == set(), names - logged - conditional
    assert "kl" not in logged and "value_loss" not in logged  # not measured: absent
    # a verl cell is a name, or says (footnote 1) that verl's source was read and has none
    bare = [row for row in rows if row.split("|")[3].strip() in ("", "-")]
    assert not bare and "\n¹ verl logs no such number" in section, bare


def test_wandb_project_and_mode_come_from_the_environment_unless_configured(monkeypatch):
    from coderl.config import load_config
    from coderl.metrics import wandb_settings

    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = load_config(TOY, ["logging.wandb.enabled=true"])
    assert wandb_settings(cfg.logging.wandb) == ("theirs", "disabled")
    cfg = load_config(TOY, ["logging.wandb.project=mine", "logging.wandb.mode=online"])
    assert wandb_settings(cfg.logging.wandb) == ("mine", "online")
    monkeypatch.delenv("WANDB_PROJECT")
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_settings(load_config(TOY).logging.wandb) == ("coderl", "offline")


def test_the_end_of_train_prints_the_held_out_summary_demo_prints(tmp_path, capsys):
    assert _train(tmp_path / "run", "eval.before_after=true", "trainer.steps=1") == 0
    out = capsys.readouterr().out
    assert "held-out summary (heldout split, 95% CIs)" in out, out
    assert "pass@1, start" in out and "RL only: pass@1 change" in out, out


def test_online_report_takes_the_run_directory(tmp_path, monkeypatch, capsys):
    import coderl.cli.online as online_cli

    rows = [{"cycle": 1}, {"cycle": 2}]
    (tmp_path / "cycles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown = []
    monkeypatch.setattr(online_cli, "print_report", shown.append)
    assert main(["online", "report", str(tmp_path)]) == 0, capsys.readouterr()
    assert shown == [{"cycle": 2}]  # the last cycle's report, no preset needed


def test_online_continue_line_runs_the_cycles_left(tmp_path):
    import argparse

    from coderl.cli.online import continue_command

    args = argparse.Namespace(
        config="configs/online-demo.yaml", overrides=["online.cycles=5", "a=1"]
    )
    assert continue_command(args, 3) == (
        "coderl online run configs/online-demo.yaml a=1 online.cycles=3"
    )


def test_an_adapter_given_as_the_model_is_refused_naming_what_to_give(tmp_path):
    from coderl.policy.loading import load_policy

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="give model.name the model it was trained on"):
        load_policy(str(tmp_path))


def test_a_runs_task_file_is_the_one_it_trained_on_from_any_directory(tmp_path, monkeypatch):
    """config.yaml holds the task file absolute: a relative tasks_file named where the run was
    started is the same file for eval, export and --resume run elsewhere."""
    from coderl.config import anchored, dump_config, load_config

    repair = str(ROOT / "configs" / "repair.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(repair, ["tasks.options.tasks_file=mine/tasks.jsonl.gz"])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(anchored(cfg)))
    monkeypatch.chdir(ROOT)  # somewhere else
    back = load_config(saved)
    assert back.tasks.options["tasks_file"] == str(tmp_path / "mine" / "tasks.jsonl.gz")
    assert anchored(back) == back  # absolute paths stay as they are
    globbed = anchored(load_config(repair, ["tasks.options.tasks_file=[a/*.jsonl, /b.jsonl]"]))
    assert globbed.tasks.options["tasks_file"] == [str(ROOT / "a" / "*.jsonl"), "/b.jsonl"]
