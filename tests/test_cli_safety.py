"""No command overwrites or deletes user data unasked; the refusal names the flag."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.cli import main
from coderl.config.graders import JudgeConfig


def test_synth_refuses_to_replace_an_existing_task_file(tmp_path, capsys):
    out = tmp_path / "toolz.jsonl.gz"
    out.write_bytes(gzip.compress(b'{"id": "keep-me"}\n'))
    before = out.read_bytes()
    # refused before the environment is looked up (no environment needs to exist)
    assert main(["tasks", "synth", "no-such-env", "--n", "40", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--append" in err and "--force" in err
    assert out.read_bytes() == before
    # with a flag the refusal is gone: the next complaint is the missing environment
    assert main(["tasks", "synth", "no-such-env", "--out", str(out), "--append"]) == 2
    assert "--append" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["tasks", "humaneval", "--split", "heldout", "--out"],
        ["tasks", "export", "x.jsonl", "--out"],
        ["tasks", "import", "x.jsonl", "--out"],
        ["tasks", "validate", "x.jsonl", "--out"],
    ],
)
def test_task_writers_refuse_an_existing_out_without_force(tmp_path, capsys, argv):
    out = tmp_path / "mine.jsonl"
    out.write_text("precious\n")
    assert main([*argv, str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "precious\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "no-such-run", "--episodes-out"],
        ["agent", "--model", "no-such-model", "--workspace", "no-such-dir", "--task", "t", "--out"],
        ["rm", "train", "--episodes", "no-such.jsonl", "--backbone", "no-such-model", "--out"],
    ],
)
def test_episode_and_checkpoint_writers_refuse_an_existing_out_first(tmp_path, capsys, argv):
    """Refused before anything else is looked at: the run, model and inputs named do not exist,
    so any other order would end in a different complaint (or a model load)."""
    out = tmp_path / "mine"
    out.write_text("precious\n")
    assert main([*argv, str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--force" in err, err
    assert out.read_text() == "precious\n"
    # with --force the refusal is gone and the next complaint is about the missing input
    assert main([*argv, str(out), "--force"]) != 0
    assert "--force" not in capsys.readouterr().err


def test_humaneval_force_replaces(tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text("precious\n")
    assert main(["tasks", "humaneval", "--split", "heldout", "--out", str(out), "--force"]) == 0
    assert out.read_text() != "precious\n"


def test_the_judge_cache_is_not_under_the_working_directory(tmp_path):
    path = JudgeConfig().cache
    assert path is not None and not path.startswith("runs")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    code = "from coderl.graders.cache import JudgementCache as C; print(C('~/c/x.sqlite').path)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert Path(out.stdout.strip()) == tmp_path / "home" / "c" / "x.sqlite", out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "~").exists()
