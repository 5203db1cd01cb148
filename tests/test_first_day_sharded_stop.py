"""A user's first day (issue 48), class 3 in a sharded run: Ctrl-C or SIGTERM to ``torchrun``
checkpoints the last completed step on every rank together, rank 0 alone prints the line with the
command that resumes, and the resume continues exactly.

The ranks cannot stop where the signal lands (a checkpoint is a collective, and a rank blocked in
one does not see the signal): each marks it, and at the end of each step they agree to stop
(:class:`coderl.train.interrupt.AgreedStop`). The end-to-end tests run a real two-rank gloo
``torchrun`` on the CPU with the tiny model (a minute or two each under load)."""

from __future__ import annotations

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
from coderl.metrics import read_jsonl
from coderl.rundir import list_checkpoints
from coderl.train import interrupt
from coderl.train.interrupt import AgreedStop

ROOT = Path(__file__).parent.parent
STEPS = 6
ARGS = [str(ROOT / "configs" / "toy.yaml"), "progress=false", "tensorboard=false"]
ARGS += ["eval.before_after=false", "rollout.group_size=4", "rollout.max_new_tokens=4"]
ARGS += [f"trainer.steps={STEPS}", "trainer.checkpoint_every=50"]  # none before the end
ARGS += ["trainer.distributed.enabled=true"]
# each rank runs `coderl` as `python -m coderl` does, and says how it exited
RANK = "import sys\nfrom coderl.cli import main\ncode = main()\nprint(f'rank exit {code}', flush=True)\nsys.exit(code)\n"  # fmt: skip


def _torchrun(tmp_path: Path, argv: list[str]) -> subprocess.Popen[str]:
    """Two gloo ranks of ``coderl ARGV`` under ``torchrun``, in a session of their own (so a
    test can signal the group as a terminal's Ctrl-C does)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return subprocess.Popen(
        [*launch, str(script), *argv, "--no-report"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``): torchrun's ranks."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


def _rows(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(900)  # sigterm: three torchrun runs (about 5 min on the loaded 2-core box)
@pytest.mark.parametrize(
    "to, sig, code",
    [("launcher", signal.SIGTERM, 143), ("all", signal.SIGTERM, 143)],
    ids=["sigterm", "sigterm-to-every-process"],
)  # fmt: skip
# SIGINT takes the same path: the agreement delivers the strongest mark (SIGINT among them, in
# one process below), and Ctrl-C exits 130 as a single-process run does: one torchrun run less
def test_a_signal_to_torchrun_checkpoints_the_last_completed_step(
    tmp_path, monkeypatch, capsys, to, sig, code
):
    run = tmp_path / "run"
    proc = _torchrun(tmp_path, ["train", *ARGS, f"run_dir={run}"])
    deadline = time.time() + 300
    while _rows(run) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, _finish(proc)[-3000:]
    # a scheduler that signals every process of the job (Slurm's scancel) reaches torchrun and
    # each rank, and torchrun passes it on again: one stop, not a second signal
    for pid in [proc.pid, *(_children(proc.pid) if to == "all" else [])]:
        os.kill(pid, sig)
    out = _finish(proc)
    said = [x for x in out.splitlines() if "interrupted" in x]
    assert len(said) == 1, out[-3000:]  # rank 0 speaks for the run
    assert out.count(f"rank exit {code}") == 2, out[-3000:]
    assert "KeyboardInterrupt" not in out and str(ROOT / "coderl") not in out, out[-3000:]
    done = _rows(run)  # the step in progress was finished and logged by both ranks
    assert 2 <= done < STEPS, out[-3000:]
    ckpt = run / "checkpoints" / f"step-{done:06d}"
    assert list_checkpoints(run) == [ckpt]
    assert json.loads((ckpt / "state.json").read_text())["step"] == done
    assert _rows(run / "ranks" / "rank-1") == done
    resume = f"torchrun --nproc-per-node 2 -m coderl train --resume {run}"
    assert said[0].endswith(f"last checkpoint {ckpt} (step {done}); resume with: {resume}")
    if to != "launcher" or sig != signal.SIGTERM:
        return  # the resume is checked once (each torchrun run costs a minute)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # as a plain command: refused, says how
    assert main(["train", "--resume", str(run)]) == 2
    assert f"; run: {resume}\n" in capsys.readouterr().err
    ref = tmp_path / "ref"
    for argv in (["train", "--resume", str(run)], ["train", *ARGS, f"run_dir={ref}"]):
        out = _finish(_torchrun(tmp_path, argv))
        assert out.count("rank exit 0") == 2, out[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert_same_metrics(read_jsonl(ref / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl"))


# --- the agreement, in one process -------------------------------------------------------------


class Handled(Exception):
    """What the test's own SIGTERM handler raises (the CLI's raises KeyboardInterrupt)."""


def _sigterm_raises(signum, frame):
    raise Handled(signum)


@pytest.fixture
def sigterm_handler():
    """SIGTERM raises ``Handled``; SIGINT is Python's own handler (an xdist worker starts with
    it ignored)."""
    previous = signal.signal(signal.SIGTERM, _sigterm_raises)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous)
    signal.signal(signal.SIGINT, previous_int)


def test_a_signal_is_held_until_the_ranks_agree_and_a_late_second_one_stops_at_once(
    sigterm_handler, monkeypatch
):
    monkeypatch.setattr(interrupt, "REPEAT_S", 0.2)
    with AgreedStop(True):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # at once: the same stop passed on by torchrun
        time.sleep(0.3)
        with pytest.raises(Handled):
            os.kill(os.getpid(), signal.SIGTERM)  # later: a second signal, delivered now


@pytest.mark.parametrize("marks, delivered", [([0, 0], None), ([0, 2], 2), ([2, 15], 15)])
def test_every_rank_stops_with_the_strongest_signal_any_rank_got(
    sigterm_handler, monkeypatch, marks, delivered
):
    import coderl.train.distributed as distributed

    monkeypatch.setattr(distributed, "gather", lambda mine: marks)  # this rank: no signal
    with AgreedStop(True) as stop:
        if delivered is None:
            stop.check()
            assert not stop.agreed
            return
        want = KeyboardInterrupt if delivered == signal.SIGINT else Handled
        with pytest.raises(want):
            stop.check()
        assert stop.agreed


def test_a_single_process_run_is_left_as_it_was(sigterm_handler):
    stop = AgreedStop(False)
    with stop:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is _sigterm_raises
        stop.check()  # no process group: nothing gathered
    assert not stop.agreed


@pytest.mark.parametrize(
    "env, launcher, want",
    [
        ({}, "torchrun", "coderl train --resume runs/x"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "torchrun", "torchrun --nproc-per-node 2 -m coderl train --resume runs/x"),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "torchrun", "torchrun --nnodes 2 --nproc-per-node 4 -m coderl train --resume runs/x"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "ray", "coderl train --resume runs/x"),
    ],
    ids=["one-process", "torchrun", "torchrun-two-nodes", "ray"],
)  # fmt: skip
def test_the_resume_and_start_over_commands_are_launched_as_the_run_was(
    monkeypatch, tmp_path, env, launcher, want
):
    import argparse

    monkeypatch.chdir(tmp_path)  # runs/x: no logs there

    from coderl.cli.train import over, resume_command
    from coderl.config import load_config

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dist = ["trainer.distributed.enabled=true", f"trainer.distributed.launcher={launcher}"]
    dist += ["trainer.distributed.world_size=2"] if launcher == "ray" else []
    cfg = load_config(ARGS[0], ["run_dir=runs/x", *dist])
    assert resume_command(cfg) == want
    args = argparse.Namespace(resume=None, config="toy.yaml", overrides=["trainer.steps=3"])
    again = over(args, cfg)
    assert again == want.replace("--resume runs/x", "toy.yaml trainer.steps=3")


def test_a_sharded_run_started_without_torchrun_is_refused_with_the_command(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    assert main(["train", *ARGS, f"run_dir={run}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "Traceback" not in err[0], err  # the line and the traceback hint
    want = "torchrun --nproc-per-node N -m coderl train " + " ".join(ARGS)
    assert err[0].endswith(f"run: {want} run_dir={run}"), err[0]
    assert not run.exists()  # before anything is written (and before the model loads)
