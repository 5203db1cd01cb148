"""A user's first day (issue 48), class 3: Ctrl-C and SIGTERM stop every phase within seconds
and say where the run stopped.

``make demo``'s SFT phase once ignored Ctrl-C until a SIGTERM: a command started in the
background by a shell without job control (``make demo &`` in a script) inherits SIGINT
ignored, and Python leaves it so. These tests start the commands the way a user does (a
subprocess), wait until SFT is training, send the signal, and bound the time to exit
generously (a liveness check, not a timing)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DEFAULT = str(ROOT / "configs" / "default.yaml")
# many short SFT batches on the tiny model: the signal lands mid-SFT
SFT = ["model.name=tiny-random", "sft.limit=2", "sft.batch_size=1", "sft.epochs=500"]
SFT += ["progress=true", "tensorboard=false"]
BOUND_S = 20.0


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts it


def _stop_mid_sft(argv: list[str], sig: int, *, inherited_ignored: bool) -> tuple[int, str, float]:
    """Start ``coderl ARGV``, wait for its first SFT batch line, send ``sig``; (exit status,
    everything it printed, seconds from the signal to its exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coderl", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_ignore_sigint if inherited_ignored else None,
    )
    assert proc.stdout is not None
    seen = []
    deadline = time.time() + 300
    for line in proc.stdout:  # until SFT is training
        seen.append(line)
        if line.startswith("sft epoch 1/500 2/") or time.time() > deadline:
            break
    assert proc.poll() is None, "".join(seen)[-3000:]
    proc.send_signal(sig)
    t0 = time.perf_counter()
    try:
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, "".join(seen) + rest, time.perf_counter() - t0


@pytest.mark.parametrize(
    "argv, sig, ignored, said",
    [
        (
            ["sft", DEFAULT, *SFT],
            signal.SIGINT,
            True,
            "coderl sft: interrupted; no SFT weights written to {run}/sft/trainable.safetensors; "
            "start again with: coderl sft {config} ",
        ),
        (
            ["train", DEFAULT, *SFT],
            signal.SIGINT,
            False,
            "coderl train: interrupted before the first checkpoint of {run}; nothing to resume; "
            "start again with: coderl train {config} ",
        ),
        (
            ["demo", "--config", DEFAULT, *SFT],
            signal.SIGTERM,
            False,
            "coderl demo: interrupted before the first checkpoint of {run}; nothing to resume; "
            "start again with: coderl demo ",
        ),
    ],
    ids=["sft-sigint-inherited-ignored", "train-sigint", "demo-sigterm"],
)
def test_a_signal_mid_sft_stops_within_seconds_with_the_line_to_go_on(
    tmp_path, argv, sig, ignored, said
):
    run = tmp_path / "run"
    code, out, waited = _stop_mid_sft([*argv, f"run_dir={run}"], sig, inherited_ignored=ignored)
    assert code == (143 if sig == signal.SIGTERM else 130), out[-3000:]
    assert waited < BOUND_S, f"{waited:.1f} s after the signal\n{out[-3000:]}"
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    lines = [x for x in out.splitlines() if "interrupted" in x]
    assert len(lines) == 1, out[-3000:]
    assert said.format(run=run, config=DEFAULT) in lines[0], lines[0]
    assert not (run / "sft" / "trainable.safetensors").exists()


def test_a_pool_left_by_an_exception_does_not_wait_for_its_queue():
    """Ctrl-C in an evaluation whose episodes are still queued for grading: the pool is left at
    once, the queued jobs never start."""
    from coderl.pools import thread_pool

    started = []

    def job(i: int) -> None:
        started.append(i)
        time.sleep(0.5)

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt), thread_pool(2) as pool:
        for i in range(20):
            pool.submit(job, i)
        raise KeyboardInterrupt
    assert time.perf_counter() - t0 < 0.4  # neither the queue (5 s) nor the running two
    time.sleep(0.7)
    assert len(started) <= 4, started  # the two running, at most one more each
    with thread_pool(2) as pool:  # without an exception: every job, as ThreadPoolExecutor
        futures = [pool.submit(lambda i=i: i * i) for i in range(5)]
    assert [f.result() for f in futures] == [0, 1, 4, 9, 16]


def test_ctrl_c_while_the_demo_still_imports_prints_the_line_not_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C in the demo's first seconds lands inside torch's import; the handler then must
    not import torch again (a half-imported module raises there: "partially initialized
    module 'torch'"). Stood in for by an interrupt before RL starts with the modules that
    need torch made unimportable: the line comes out all the same."""
    import coderl.train.warmstart as warmstart
    from coderl.cli.demo import run_demo

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(warmstart, "warm_start", interrupted)
    for name in ("coderl.train.resume", "coderl.cli.train"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    run = tmp_path / "run"
    args = ["model.name=tiny-random", "sft.enabled=true", f"run_dir={run}"]
    assert run_demo(Path(DEFAULT), args) == 130
    err = capsys.readouterr().err
    assert (
        f"coderl demo: interrupted before the first checkpoint of {run}; nothing to resume" in err
    )
    assert "start again with: coderl demo " in err
