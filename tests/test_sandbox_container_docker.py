"""The container backend with Docker's CLI (``sandbox.cli: docker``). Docker is not installed here
and cannot be: these tests run the backend against ``tests/docker_standin.py``, a ``docker`` that
refuses every option and form Docker's CLI does not take (podman's ``--preserve-fds``,
``--cgroup-manager``, ``--runtime``, ``--read-only-tmpfs``, overlay volumes, ``notmpcopyup``, ``rm
--time``, ``image exists``, ``.Labels`` as a map) and runs the rest with podman. What they show:
the command lines the backend builds for docker are Docker's, and the docker code path (a host
overlay for the workspace, FIFOs for the shell's channels) works end to end on a container
engine. What they cannot show: how a real docker daemon runs them.

Needs root, podman and the Debian base image (``make sysdeps container-image``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coderl.sandbox import Limits, Sandbox
from coderl.sandbox.base import SandboxError
from coderl.sandbox.container import (
    CLI_ENV,
    IMAGE_ENV,
    LABEL,
    OWNER_LABEL,
    cli_kind,
    container_cli,
    reap,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None,
    reason="container sandbox needs root and podman (make sysdeps)",
)
STANDIN = Path(__file__).parent / "docker_standin.py"


@pytest.fixture(scope="module")
def image() -> str:
    from coderl.sandbox.images import base_image

    return base_image()


@pytest.fixture
def docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image: str) -> Path:
    """``CODERL_CONTAINER_CLI`` = a program named ``docker`` (the stand-in); returns its log."""
    podman = " ".join(container_cli())  # podman with this host's flags, found before the switch
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "docker"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    program.chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("DOCKER_STANDIN_LOG", str(log))
    monkeypatch.setenv("DOCKER_STANDIN_PODMAN", podman)
    monkeypatch.setenv(CLI_ENV, str(program))
    monkeypatch.setenv(IMAGE_ENV, image)
    return log


def _calls(log: Path) -> list[list[str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    assert not [x for x in lines if x.startswith("REFUSED")], lines
    return [json.loads(x) for x in lines]


def test_the_cli_is_found_and_docker_gets_no_podman_flags(docker: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", os.environ["PATH"])  # put back after the test
    assert container_cli() == [os.environ[CLI_ENV]] and cli_kind() == "docker"
    os.environ[CLI_ENV] = "podman"
    assert cli_kind() == "podman" and Path(container_cli()[0]).name == "podman"
    os.environ[CLI_ENV] = "no-such-container-cli"
    with pytest.raises(SandboxError, match="no container CLI: 'no-such-container-cli'"):
        container_cli()
    del os.environ[CLI_ENV]  # none named: podman when installed, else docker
    assert Path(container_cli()[0]).name == "podman"
    os.environ["PATH"] = str(docker.parent / "bin")
    assert container_cli() == [str(docker.parent / "bin" / "docker")]


def test_the_stand_in_refuses_what_docker_does_not_take(docker: Path) -> None:
    """Not vacuous: podman's forms of the same calls are refused."""
    program = os.environ[CLI_ENV]
    for argv in (
        ["--cgroup-manager", "cgroupfs", "ps"],
        ["run", "--preserve-fds", "3", "img"],
        ["run", "-v", "/a:/testbed:O,upperdir=/u,workdir=/w", "img"],
        ["run", "--read-only-tmpfs=false", "img"],
        ["run", "--tmpfs", "/x:ro,size=4k,notmpcopyup", "img"],
        ["rm", "-f", "--time", "0", "c"],
        ["image", "exists", "img"],
        ["import", "--change", "CMD=/bin/bash", "t.tar", "img"],
        ["ps", "--format", '{{index .Labels "x"}}'],
    ):
        done = subprocess.run([program, *argv], capture_output=True, text=True)
        assert done.returncode == 125 and "refused" in done.stderr, argv
    assert len(docker.read_text().splitlines()) == 9


def test_a_sandbox_through_docker(docker: Path, tmp_path: Path) -> None:
    base = tmp_path / "repo"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    box = Sandbox.create(base, backend="container", limits=Limits(timeout_s=20))
    try:
        scratch = box.scratch  # type: ignore[attr-defined]
        assert os.path.ismount(scratch / "merged")  # the host's overlay, not podman's
        r = box.exec("pwd; id -u; cat pkg/mod.py; export X=7; cd pkg; echo err >&2")
        assert (r.exit_code, r.stdout, r.stderr) == (
            0,
            "/testbed\n0\ndef f():\n    return 1\n",
            "err\n",
        )
        assert box.exec("echo $X; pwd; ls /run/coderl-channels").stdout == "7\n/testbed/pkg\n"
        assert box.exec("exit 3").exit_code == 3  # the shell ended: its FIFOs read end of file
        box.write_text("pkg/mod.py", "def f():\n    return 2\n")
        assert "-    return 1\n+    return 2" in box.diff()
        slow = box.exec("sleep 30", timeout=1)
        assert slow.timed_out  # the container was killed; the next command starts a new one
        assert box.read_text("pkg/mod.py").endswith("return 2\n")
        child = box.fork()
        try:
            child.exec("echo forked > new.txt")
            assert "new.txt" in child.diff() and "new.txt" not in box.diff()
        finally:
            child.close()
    finally:
        box.close()
    assert not scratch.exists()
    runs = [c for c in _calls(docker) if c[0] == "run"]
    assert len(runs) == 4  # first shell, after the exit, after the timeout, the fork
    assert all(f"{scratch}/merged:/testbed" in c for c in runs[:3])


def test_images_and_the_reaper_through_docker(docker: Path, image: str) -> None:
    from coderl.sandbox.images import build_layer, image_exists

    assert image_exists(image) and not image_exists("localhost/coderl-none:0")
    tag = build_layer("docker-test", image, "RUN echo ok > /ok\n", pip=False)
    assert image_exists(tag)
    program = os.environ[CLI_ENV]
    dead = f"{LABEL}=1", f"{OWNER_LABEL}=999999999:1"  # an owner that cannot exist
    limits = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=64:64"]  # runc as root here
    cid = subprocess.run(
        [program, "run", "-d", "--rm", *limits, "--label", dead[0], "--label", dead[1], tag]
        + ["sleep", "60"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    removed, _ = reap()
    assert removed >= 1
    listing = subprocess.run([program, "ps", "-a", "--format", "{{.ID}}"], capture_output=True)
    assert cid[:12] not in listing.stdout.decode()
    assert any(c[:2] == ["ps", "-a"] for c in _calls(docker))  # the reaper listed, refused nothing


def test_sandbox_cli_is_set_for_the_run_and_put_back(monkeypatch) -> None:
    """``sandbox.cli`` reaches the backend through ``use_backend`` (``setup_run``), and the run's
    end puts the process's own choice back."""
    from coderl.sandbox.settings import restore_backend, use_backend

    monkeypatch.setenv(CLI_ENV, "podman")
    before = use_backend("container", image="localhost/x:1", cli="docker")
    assert os.environ[CLI_ENV] == "docker" and os.environ[IMAGE_ENV] == "localhost/x:1"
    restore_backend(before)
    assert os.environ[CLI_ENV] == "podman"
