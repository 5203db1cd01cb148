"""``coderl train --resume RUN``: the run's own config, overrides on top, refusals, Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from metrics_compare import assert_same_metrics

from coderl.cli import main
from coderl.config import load_config
from coderl.metrics import read_jsonl
from coderl.train import loop

ROOT = Path(__file__).parent.parent
TOY, PPO = ROOT / "configs" / "toy.yaml", ROOT / "configs" / "ppo.yaml"
COMMON = [
    "progress=false",
    "tensorboard=false",
    "eval.before_after=false",
    "trainer.steps=4",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=5",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
]


def _stopped_run(run_dir: Path, monkeypatch, at: int = 2) -> None:
    """A toy run with trainer.steps=4 stopped by Ctrl-C after its step-``at`` checkpoint."""
    real = loop.training_step

    def step(run):
        if run.step == at:
            raise KeyboardInterrupt
        return real(run)

    monkeypatch.setattr(loop, "training_step", step)
    with pytest.raises(KeyboardInterrupt):
        loop.train(load_config(TOY, [*COMMON, f"run_dir={run_dir}"]))
    monkeypatch.setattr(loop, "training_step", real)


def test_resume_without_overrides_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    loop.train(load_config(TOY, [*COMMON, f"run_dir={ref_dir}"]))
    _stopped_run(cut_dir, monkeypatch)
    saved = (cut_dir / "config.yaml").read_text()
    # no preset, no trainer.steps=4: the run's own config.yaml says 4 (toy.yaml says 10)
    assert main(["train", "--resume", str(cut_dir), "--no-report"]) == 0
    ref, cut = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(cut_dir / "metrics.jsonl")
    assert [r["step"] for r in cut] == [1, 2, 3, 4]  # finishes at 4/4, not 4/10
    assert_same_metrics(ref, cut)
    assert (cut_dir / "config.yaml").read_text() == saved  # nothing changed, nothing rewritten
    assert not (cut_dir / "resume.jsonl").exists()
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resume:")]
    assert said == [f"resume: from {cut_dir / 'checkpoints' / 'step-000002'} (step 2)"], said


def test_resume_overrides_are_printed_and_recorded(tmp_path, monkeypatch, capsys):
    _stopped_run(tmp_path, monkeypatch)
    assert main(["train", "--resume", str(tmp_path), "trainer.steps=5", "--no-report"]) == 0
    assert "resume: trainer.steps 4 -> 5" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")][-1] == 5
    log = [json.loads(x) for x in (tmp_path / "resume.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 2 and log[0]["changes"] == {"trainer.steps": [4, 5]}
    assert load_config(tmp_path / "config.yaml").trainer.steps == 5


@pytest.mark.parametrize(
    "argv, said",
    [
        ([str(PPO)], "algorithm.advantage 'grpo' -> 'gae'"),  # the PPO preset over a GRPO run
        (["model.lora=true"], "model.lora False -> True"),
        (["trainer.steps=2"], "the run is at step 2 and trainer.steps=2"),
        (["run_dir=elsewhere"], "names the run"),
    ],
)
def test_resume_refuses_what_the_checkpoint_holds(tmp_path, monkeypatch, capsys, argv, said):
    _stopped_run(tmp_path, monkeypatch)
    saved = (tmp_path / "config.yaml").read_text()
    assert main(["train", "--resume", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # the error and the CODERL_TRACEBACK hint
    assert (tmp_path / "config.yaml").read_text() == saved  # refused: untouched
    assert not (tmp_path / "resume.jsonl").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("command, tail", [("train", []), ("train-async", ["--resume"])])
def test_ctrl_c_or_sigterm_prints_the_resume_command(tmp_path, command, tail, sig, code):
    """Ctrl-C, and SIGTERM (preemption, ``timeout``) alike: one line with the last checkpoint
    and the resume command."""
    run_dir = tmp_path / "run"
    words = [str(TOY), *COMMON, "trainer.steps=100000", f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coderl", command, *words],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    marker = run_dir / "checkpoints" / "step-000001" / "state.json"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    line = [x for x in out.splitlines() if "interrupted" in x]
    assert len(line) == 1, out
    again = f"resume with: coderl {command} --resume {run_dir}"
    assert "last checkpoint" in line[0] and again in line[0], line[0]


def test_ctrl_c_in_online_run_says_what_is_kept_and_exits_130(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "online"
    words = [str(ROOT / "configs" / "online-demo.yaml"), f"run_dir={run_dir}", "online.cycles=50"]
    words.append(f"online.serve.port={port}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coderl", "online", "run", *words],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    marker = run_dir / "cycles.jsonl"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    line = [x for x in out.splitlines() if "interrupted" in x]
    assert len(line) == 1, out[-3000:]
    # the line goes on with the cycles left, not all 50 again
    finished = int(line[0].split(" finished cycles")[0].rsplit(" ", 1)[-1])
    kept = " ".join(w for w in words if not w.startswith("online.cycles="))
    again = f"continue with: coderl online run {kept} online.cycles={50 - finished}"
    assert again in line[0], line[0]


def test_train_async_resume_continues_the_runs_own_config(tmp_path, monkeypatch, capsys):
    # started with trainer.steps=3, resumed naming only the run: the saved 3 steps hold, and
    # a refused override leaves config.yaml untouched
    run_dir = tmp_path / "run"
    words = [str(TOY), *COMMON, "trainer.steps=3", f"run_dir={run_dir}"]
    assert main(["train-async", *words[:-2], "trainer.steps=2", f"run_dir={run_dir}"]) == 0
    saved = (run_dir / "config.yaml").read_text()
    assert main(["train-async", "--resume", str(run_dir), "algorithm.advantage=rloo"]) == 2
    assert (run_dir / "config.yaml").read_text() == saved
    assert main(["train-async", "--resume", str(run_dir), "trainer.steps=3"]) == 0
    assert "resume: trainer.steps 2 -> 3" in capsys.readouterr().out
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r]
    assert max(steps) == 3
    assert load_config(run_dir / "config.yaml").trainer.steps == 3
