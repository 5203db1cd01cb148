"""``build-env --from`` as a pipeline: a ledger row per repository, bounded parallelism, and a run
killed mid-way (SIGKILL) then restarted builds each repository exactly once (fast fake builder)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coderl.envbuild.build import BuildError
from coderl.envbuild.ledger import Ledger, build_many, finished, read_ledger, summary
from coderl.tasks.env import EnvRecord

REPO = Path(__file__).parent.parent


def fake_record(spec: str, plan: str = "test-imports") -> EnvRecord:
    return EnvRecord(
        env_id=f"{spec}-000",
        spec=spec,
        name=spec,
        version="1",
        snapshot_digest="0" * 64,
        snapshot="/nonexistent",
        venv="/nonexistent",
        install_plan=plan,
        install_commands=[],
        test_paths=["tests"],
        test_command="pytest tests",
        passing=["t::a", "t::b"],
        failing=["t::c"],
        flaky=["t::d"],
        attempts=[{"plan": "project+extras", "step": "install[0]"}, {"plan": plan, "step": "test"}],
    )


def test_rows_report_status_time_attempts_builder_and_tests(tmp_path):
    def build(spec: str) -> EnvRecord:
        if spec == "bad":
            raise BuildError(
                spec,
                "install[0]",
                "pip said\nNo matching distribution",
                [{"plan": "model[0]", "step": "install[0]"}],
            )
        return fake_record(spec, "model[1]" if spec == "helped" else "test-imports")

    ledger = tmp_path / "ledger.jsonl"
    rows = build_many(["a", "helped", "bad", "a"], build, ledger)
    by = {r["spec"]: r for r in rows}
    assert len(rows) == 3  # the duplicate is built once
    assert by["a"]["status"] == "built" and by["a"]["builder"] == "rules"
    assert (by["a"]["tests_collected"], by["a"]["passing"], by["a"]["flaky_dropped"]) == (4, 2, 1)
    assert by["a"]["attempts"] == 2 and by["a"]["plans"][0] == {
        "plan": "project+extras",
        "step": "install[0]",
    }
    assert by["helped"]["builder"] == "model" and by["helped"]["plan"] == "model[1]"
    assert by["bad"] == by["bad"] | {"status": "failed", "step": "install[0]", "builder": "model"}
    assert by["bad"]["error"] == "No matching distribution"
    assert all(r["time_s"] >= 0 for r in rows)
    # a second run builds nothing; --retry-failed builds only the failure again
    assert build_many(["a", "helped", "bad"], build, ledger) == []
    again = build_many(["a", "helped", "bad"], build, ledger, retry_failed=True)
    assert [r["spec"] for r in again] == ["bad"]
    s = summary(list(finished(ledger).values()))
    assert (s["repositories"], s["built"], s["failed"]) == (3, 2, 1)
    assert (s["built_by_rules"], s["built_with_model"]) == (1, 1)


def test_at_most_jobs_builds_run_at_once(tmp_path):
    running, peak, lock = 0, 0, threading.Lock()

    def build(spec: str) -> EnvRecord:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return fake_record(spec)

    rows = build_many([f"r{i}" for i in range(8)], build, tmp_path / "l.jsonl", jobs=3)
    assert len(rows) == 8 and peak == 3
    with pytest.raises(ValueError, match="jobs"):
        build_many(["x"], build, tmp_path / "l.jsonl", jobs=0)


def test_a_torn_last_line_is_ignored(tmp_path):
    ledger = tmp_path / "l.jsonl"
    Ledger(ledger).append({"spec": "a", "status": "built", "time_s": 1.0})
    with open(ledger, "a") as f:
        f.write('{"spec": "b", "status": "bu')  # the kill landed mid-write
    assert [r["spec"] for r in read_ledger(ledger)] == ["a"]
    assert list(finished(ledger)) == ["a"]


DRIVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_tasks_ledger import fake_record
from coderl.envbuild.ledger import build_many

log, hang = Path(sys.argv[1]), sys.argv[2]

def build(spec):
    with open(log, "a") as f:
        f.write(f"start {{spec}}\\n")
    time.sleep(60 if spec == hang else 0.05)
    with open(log, "a") as f:
        f.write(f"done {{spec}}\\n")
    return fake_record(spec)

build_many([f"r{{i}}" for i in range(6)], build, sys.argv[3], jobs=int(sys.argv[4]))
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_killed_mid_way_and_restarted_builds_each_repository_once(tmp_path, jobs):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(tests=str(Path(__file__).parent)))
    log, ledger = tmp_path / "builds.log", tmp_path / "ledger.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(driver), str(log), "r3", str(ledger), str(jobs)], env=env
    )
    deadline = time.monotonic() + 60
    while "start r3" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "driver never reached r3"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-build of r3
    proc.wait()
    before = finished(ledger)
    assert "r3" not in before and len(before) < 6
    assert any(r["spec"] == "r3" and r["status"] == "started" for r in read_ledger(ledger))

    subprocess.run(
        [sys.executable, str(driver), str(log), "none", str(ledger), str(jobs)],
        env=env,
        check=True,
        timeout=120,
    )
    done = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("done")]
    assert sorted(done) == [f"r{i}" for i in range(6)]  # each finished exactly once
    starts = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("start")]
    assert starts.count("r3") == 2  # the killed build ran again; nothing finished ran twice
    rows = [r for r in read_ledger(ledger) if r["status"] == "built"]
    assert sorted(r["spec"] for r in rows) == [f"r{i}" for i in range(6)]
    assert json.loads(ledger.read_text().splitlines()[-1])["status"] == "built"


def test_cli_refuses_unknown_builders_and_parallel_model_builds(tmp_path, capsys):
    from coderl.cli import main

    repos = tmp_path / "repos.txt"
    repos.write_text("# a comment\nsix==1.17.0\n")
    assert main(["tasks", "build-env", "--from", str(repos), "--builder", "llm"]) == 2
    assert "--builder: unknown builder 'llm'; valid: ['model', 'rules']" in capsys.readouterr().err
    argv = ["tasks", "build-env", "--from", str(repos), "--builder", "model", "--jobs", "2"]
    assert main(argv) == 2
    assert "one repository at a time" in capsys.readouterr().err
    assert not (tmp_path / "repos.txt.ledger.jsonl").exists()
