"""The container backend (``coderl.sandbox.container``): the ``Sandbox`` contract in a podman
container, its limits, fork, and cleanup after the owner is killed with SIGKILL.

Needs root, podman and the Debian base image (``make sysdeps container-image``; built here on the
first run and cached in podman's storage by its input hash).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coderl.sandbox import Limits, Sandbox
from coderl.sandbox.container import CONTAINER_ROOT, IMAGE_ENV, LABEL, OWNER_LABEL, reap

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None,
    reason="container sandbox needs root and podman (make sysdeps)",
)


@pytest.fixture(scope="module")
def image() -> str:
    from coderl.sandbox.images import base_image

    return base_image()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "README").write_text("hello\n")
    return root


@pytest.fixture
def sb(base: Path, image: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(IMAGE_ENV, image)
    box = Sandbox.create(base, backend="container", limits=Limits(timeout_s=20))
    yield box
    box.close()


def _containers(owner_pid: int | None = None) -> list[dict]:
    out = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label={LABEL}", "--format", "json"],
        capture_output=True,
        check=True,
    ).stdout
    found = json.loads(out or b"[]")
    if owner_pid is None:
        return found
    return [
        c for c in found if (c.get("Labels") or {}).get(OWNER_LABEL, "").startswith(f"{owner_pid}:")
    ]


def test_shell_files_and_diff(sb, base: Path) -> None:
    r = sb.exec("pwd; id -u; cat README; export X=7; cd pkg")
    assert (r.exit_code, r.stdout) == (0, "/testbed\n0\nhello\n")
    assert sb.exec("echo $X; pwd").stdout == "7\n/testbed/pkg\n"
    sb.write_text("pkg/mod.py", "def f():\n    return 2\n")
    sb.write_text("new.txt", "n\n")
    sb.exec("rm /testbed/README")
    assert sb.list() == ["new.txt", "pkg/"]
    assert sb.read_text("/testbed/pkg/mod.py").endswith("return 2\n")
    diff = sb.diff()
    assert "-    return 1\n+    return 2" in diff
    assert "diff --git a/new.txt b/new.txt\nnew file mode 100644" in diff
    assert "diff --git a/README b/README\ndeleted file mode 100644" in diff
    assert (base / "README").read_text() == "hello\n"  # the base is never written


def test_timeout_kills_and_the_workspace_survives(sb) -> None:
    sb.exec("echo kept > f; export Y=1")
    r = sb.exec("sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 124 and r.duration_s < 10
    r = sb.exec("cat f; echo $Y")
    assert (r.exit_code, r.stdout) == (0, "kept\n1\n")


def test_no_network_no_capabilities_read_only_image(sb) -> None:
    r = sb.exec(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\""
    )
    assert r.exit_code != 0 and "unreachable" in r.stderr
    assert "CapEff:\t0000000000000000" in sb.exec("grep CapEff /proc/self/status").stdout
    assert sb.exec("touch /etc/x").exit_code != 0
    assert sb.exec("touch /tmp/x ~/y").exit_code == 0


def test_limits(base: Path, image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMAGE_ENV, image)
    lim = Limits(
        timeout_s=30,
        cpu_s=1,
        processes=32,
        memory_bytes=256 * 1024**2,
        disk_bytes=16 * 1024**2,
        output_bytes=1000,
    )
    with Sandbox.create(base, backend="container", limits=lim) as box:
        spin = box.exec("python3 -c 'while True: pass'")
        assert spin.exit_code == 128 + signal.SIGKILL and not spin.timed_out  # RLIMIT_CPU hard
        big = box.exec("python3 -c 'b = bytearray(512 * 1024 * 1024)'")
        assert big.exit_code != 0 and "MemoryError" in big.stderr
        disk = box.exec("head -c 32M /dev/zero > /testbed/blob")
        assert disk.exit_code != 0 and "No space left" in disk.stderr
        procs = box.exec("for i in $(seq 64); do sleep 5 & done; wait")
        assert "fork" in procs.stderr or "retry" in procs.stderr
        out = box.exec("head -c 100000 /dev/zero | tr '\\0' a")
        assert out.truncated and len(out.stdout) < 1100


def test_fork_is_a_live_copy(sb) -> None:
    sb.exec("echo parent > f; mkdir -p /tmp/t; echo tmp > /tmp/t/x; export Z=3; cd pkg")
    child = sb.fork()
    try:
        r = child.exec("cat /testbed/f /tmp/t/x; echo $Z; pwd")
        assert r.stdout == "parent\ntmp\n3\n/testbed/pkg\n"
        child.exec("echo child > /testbed/f")
        sb.exec("echo other > /testbed/g")
        assert sb.read_text("f") == "parent\n" and child.read_text("f") == "child\n"
        assert "g" not in child.list() and "g" in sb.list()
        assert "+child" in child.diff() and "+parent" in sb.diff()
    finally:
        child.close()


def test_close_removes_container_and_mount(base: Path, image: str, monkeypatch) -> None:
    monkeypatch.setenv(IMAGE_ENV, image)
    box = Sandbox.create(base, backend="container")
    scratch = box.scratch
    assert os.path.ismount(scratch) and _containers(os.getpid())
    box.close()
    assert not scratch.exists() and not _containers(os.getpid())


_VICTIM = textwrap.dedent(
    """
    import sys
    from coderl.sandbox import Sandbox
    box = Sandbox.create(sys.argv[1], backend="container")
    box.exec("echo work > /testbed/w")
    print(box.scratch, flush=True)
    box.exec("sleep 600", timeout=900)  # mid-rollout: a command is running when the kill comes
    """
)


def test_kill_9_mid_rollout_leaves_nothing_after_the_reaper(base: Path, image: str) -> None:
    """The owner is killed with SIGKILL while its container runs a command: the container and the
    scratch tmpfs outlive it; the reaper (run by the next process's first container sandbox, here
    called directly) removes both, and no container, mount or image layer of it remains (other
    processes' containers may run meanwhile: only the victim's are looked for)."""
    env = os.environ | {IMAGE_ENV: image, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, str(base)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert proc.stdout is not None
        scratch = Path(proc.stdout.readline().strip())
        assert scratch.parent == CONTAINER_ROOT and os.path.ismount(scratch)
        time.sleep(0.5)  # the sleep is running
        (victim,) = _containers(proc.pid)
        layer = subprocess.run(
            ["podman", "inspect", "--format", "{{.GraphDriver.Data.MergedDir}}", victim["Id"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert layer in _mounts()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # nothing of the owner is left to end its container: it outlives it (another process's
    # reaper, starting meanwhile, could remove it too; ours runs now)
    assert _containers(proc.pid), "the killed owner's container ended by itself"
    reap()
    assert not _containers(proc.pid)
    assert not scratch.exists()
    left = [m for m in _mounts() if victim["Id"] in m or m == layer or m == str(scratch)]
    assert not left and not Path(layer).parent.exists()  # no mount, no layer directory


def _mounts() -> set[str]:
    """Mount points of this mount namespace (the host's: podman mounts its layers there)."""
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}


def test_two_builds_of_one_layer_at_once_build_it_once(image: str, monkeypatch) -> None:
    """A second build of a tag would re-point it to another image id (and every layer hashed
    over the first id would be built again): the build lock makes the second builder wait and
    find the image."""
    import threading
    import uuid

    import coderl.sandbox.images as images

    builds: list[str] = []
    real = images._build

    def slow(tag, *args):  # type: ignore[no-untyped-def]
        builds.append(tag)
        time.sleep(2)  # both builders are past their first look before this one ends
        real(tag, *args)

    monkeypatch.setattr(images, "_build", slow)
    body = f"RUN echo {uuid.uuid4().hex} > /token\n"  # a new tag every run, removed below
    tags: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: tags.append(images.build_layer("lock-test", image, body, pip=False))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(tags) == 2 and tags[0] == tags[1] and builds == tags[:1]
    finally:
        subprocess.run(["podman", "rmi", "-f", *set(tags)], capture_output=True)
