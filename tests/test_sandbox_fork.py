"""``Sandbox.fork()``: a child that starts where its parent is and then diverges from it.

Real bubblewrap sandboxes (root and ``bwrap`` are required, as in CI) and the ``local`` backend
over a tiny repository made in ``tmp_path``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest
from test_sandbox import mounted_anywhere, procs_of

from coderl.sandbox import Limits, Sandbox, SandboxError, WorkspaceError, bwrap
from coderl.sandbox.bwrap import SCRATCH_ROOT
from coderl.sandbox.fork import copy_tree

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("bwrap") is None,
        reason="the bwrap backend needs root and bubblewrap (make sysdeps)",
    ),
    pytest.mark.filterwarnings("ignore::coderl.sandbox.local.UnisolatedSandboxWarning"),
]

BACKENDS = ["bwrap", "local"]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    base = tmp_path / "repo"
    (base / "pkg" / "sub").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    (base / "pkg" / "sub" / "deep.txt").write_text("deep\n")
    (base / "README.md").write_text("hello\n")
    (base / "gone.txt").write_text("to delete\n")
    return base


def tree(sb: Sandbox) -> dict[str, str]:
    """Every file of the workspace -> its content (newlines as ``|``), read inside the sandbox."""
    out = sb.exec(
        "find . -type f -printf '%P\\n' | sort | while read f; do echo \"$f=$(tr '\\n' '|' < $f)\"; done"
    )
    assert out.exit_code == 0, out
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize("backend", BACKENDS)
def test_parent_and_child_diverge_without_seeing_each_other(repo: Path, backend: str) -> None:
    with Sandbox.create(repo, backend=backend) as parent:
        # before the fork: an edit, a delete (whiteout), a replaced directory (opaque), new dirs
        setup = "echo edited >> README.md && rm gone.txt && rm -r pkg/sub && mkdir -p pkg/sub new/a"
        parent.exec(f"{setup} && echo fresh > pkg/sub/f.txt && echo n > new/a/n.txt")
        at_fork, diff_at_fork = tree(parent), parent.diff()
        with parent.fork() as child:
            assert tree(child) == at_fork
            assert child.diff() == diff_at_fork
            parent.exec("echo p >> README.md && rm new/a/n.txt && echo p > p.txt && mkdir pd")
            child.exec("echo c > pkg/mod.py && rm pkg/sub/f.txt && rm -r new/a && echo c > c.txt")
            assert child.read_text("README.md") == "hello\nedited\n"
            assert child.list(".") == ["README.md", "c.txt", "new/", "pkg/"]
            assert parent.read_text("pkg/mod.py").startswith("def add")
            assert parent.list(".") == ["README.md", "new/", "p.txt", "pd/", "pkg/"]
            assert parent.list("pkg/sub") == ["f.txt"] and child.list("pkg/sub") == []
            # the child's diff is the parent's at fork time plus the child's own edits
            with Sandbox.create(repo, backend=backend) as replay:
                replay.exec(f"{setup} && echo fresh > pkg/sub/f.txt && echo n > new/a/n.txt")
                replay.exec(
                    "echo c > pkg/mod.py && rm pkg/sub/f.txt && rm -r new/a && echo c > c.txt"
                )
                assert child.diff() == replay.diff()
            assert "b/p.txt" not in child.diff() and "b/c.txt" not in parent.diff()
    assert (repo / "README.md").read_text() == "hello\n"  # the base is never written


@pytest.mark.parametrize("backend", BACKENDS)
def test_cwd_and_exported_variables_carry_over_not_processes(repo: Path, backend: str) -> None:
    with Sandbox.create(repo, backend=backend) as parent:
        parent.exec("cd pkg/sub && export GREETING='hi there' WHERE=$PWD && LOCAL=x")
        parent.exec("sleep 100 & echo $! > ~/bg.pid")
        with parent.fork() as child:
            r = child.exec('pwd; echo "$WHERE|$GREETING|$LOCAL"; head -1 ../mod.py')
            cwd, line, head = r.stdout.splitlines()
            assert (
                cwd.endswith("/pkg/sub") and line == f"{cwd}|hi there|" and head == "def add(a, b):"
            )
            # WHERE points into the child's own workspace (local: its own copy of the tree)
            child.exec('echo child > "$WHERE/w.txt"')
            assert parent.exec("ls").stdout == "deep.txt\n"
            if backend == "bwrap":  # a private home: copied; the background job: not running
                pid = child.exec("cat ~/bg.pid").stdout.strip()
                assert pid and child.exec(f"kill -0 {pid}").exit_code != 0
                assert parent.exec(f"kill -0 {pid}").exit_code == 0


def test_each_child_has_its_own_limits(repo: Path) -> None:
    with Sandbox.create(repo) as parent:
        parent.exec("cd pkg")
        small = Limits(timeout_s=0.5, memory_bytes=128 * 1024**2)
        with parent.fork(limits=small) as child, parent.fork() as twin:
            # reserve 256 MiB of address space without touching it: over the child's RLIMIT_AS
            alloc = "python3 -c 'import mmap; mmap.mmap(-1, 256 << 20)' && echo ok"
            assert child.exec(alloc).exit_code != 0
            assert parent.exec(alloc).stdout == "ok\n" and twin.exec(alloc).stdout == "ok\n"
            assert child.exec("ulimit -v").stdout == f"{128 * 1024}\n"
            r = child.exec("sleep 5")
            assert r.timed_out and r.exit_code == 124
            assert child.exec("pwd").stdout == "/testbed/pkg\n"  # the restarted shell is back
            assert parent.exec("sleep 0.6; echo ok").stdout == "ok\n"  # its 30 s default holds
            uids = {parent.uid, child.uid, twin.uid}  # type: ignore[attr-defined]
            assert len(uids) == 3  # each child holds its own uid lease


def lease_free(uid: int) -> bool:
    fd = os.open(SCRATCH_ROOT / "uids" / str(uid), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.mark.parametrize("parent_first", [True, False])
def test_close_in_either_order_leaves_nothing(repo: Path, parent_first: bool) -> None:
    parent = Sandbox.create(repo)
    parent.exec("echo 1 > one.txt; sleep 100 &")  # the write, then a process left running
    child = parent.fork()
    child.exec("echo 2 > two.txt; sleep 100 &")  # (`a && b &` would background the write too)
    grandchild = child.fork()  # a fork of a fork
    assert grandchild.read_text("one.txt") == "1\n" and grandchild.read_text("two.txt") == "2\n"
    assert "two.txt" not in parent.list(".")
    family = [parent, child, grandchild]
    sandboxes = [(sb.uid, sb.scratch) for sb in family]  # type: ignore[attr-defined]
    for sb in family if parent_first else family[::-1]:
        sb.close()
        if sb is parent and parent_first:  # the children stand on their own copies
            assert child.read_text("one.txt") == "1\n" and grandchild.exec("true").exit_code == 0
    for uid, scratch in sandboxes:
        assert procs_of(uid) == [] and lease_free(uid)
        assert not scratch.exists() and not mounted_anywhere(str(scratch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_of_a_closed_sandbox_raises(repo: Path, backend: str) -> None:
    sb: Sandbox = Sandbox.create(repo, backend=backend)
    sb.close()
    with pytest.raises(SandboxError, match="cannot fork a closed sandbox"):
        sb.fork()


def test_local_child_gets_its_own_tree_and_cleanup(repo: Path) -> None:
    parent = Sandbox.create(repo, backend="local")
    child = parent.fork()
    roots: list[Path] = [parent.root, child.root]  # type: ignore[attr-defined]
    inodes = {os.stat(root / "README.md").st_ino for root in roots}
    assert roots[0] != roots[1] and len(inodes) == 2  # copies, not links
    for sb in (parent, child):
        sb.close()
    assert not any(root.exists() for root in roots)


# --- a failed copy is attributed by its cause; the parent is frozen while it is copied ------

LONG = "d" * 200


def deep_tree(where: str) -> str:
    """Shell that makes a tree under ``where`` whose deepest path is past PATH_MAX (25 levels of
    200-character names: 5,025 bytes); every step is an ordinary relative mkdir and cd."""
    return f"cd {where} && for i in $(seq 25); do mkdir {LONG} && cd {LONG} || exit 1; done; echo x > f"


@pytest.mark.parametrize(
    ("backend", "where"),
    [("bwrap", "/tmp"), ("bwrap", "/testbed"), ("bwrap", "~"), ("local", ".")],
)
def test_a_tree_past_path_max_is_the_workspaces_failure(
    repo: Path, backend: str, where: str
) -> None:
    with Sandbox.create(repo, backend=backend) as parent:
        assert parent.exec(deep_tree(where)).exit_code == 0
        with pytest.raises(WorkspaceError, match="File name too long"):
            parent.fork()
        assert parent.exec("echo still here").stdout == "still here\n"


def test_a_child_disk_too_small_for_the_parents_files_is_the_workspaces_failure(repo: Path) -> None:
    with Sandbox.create(repo, limits=Limits(disk_bytes=16 << 20)) as parent:
        assert parent.exec("head -c 6M /dev/urandom > /tmp/big").exit_code == 0
        with pytest.raises(WorkspaceError, match="No space left"):
            parent.fork(limits=Limits(disk_bytes=4 << 20))


def test_a_copy_that_fails_for_another_reason_stays_infrastructure(tmp_path: Path) -> None:
    with pytest.raises(SandboxError) as info:
        copy_tree(str(tmp_path / "missing"), str(tmp_path))
    assert not isinstance(info.value, WorkspaceError)
    # a full disk is the workspace's doing only on the child's own bounded tmpfs, else the host's
    assert not isinstance(_classified("No space left on device", bounded=False), WorkspaceError)
    assert isinstance(_classified("No space left on device", bounded=True), WorkspaceError)
    assert not isinstance(_classified("Input/output error", bounded=True), WorkspaceError)
    assert isinstance(
        _classified("Too many levels of symbolic links", bounded=False), WorkspaceError
    )


def _classified(message: str, *, bounded: bool) -> SandboxError:
    """The error ``copy_tree`` raises when ``cp`` fails with ``message``."""
    from unittest import mock

    done = mock.Mock(returncode=1, stderr=f"/usr/bin/cp: cannot create 'x': {message}".encode())
    with mock.patch("coderl.sandbox.fork.subprocess.run", return_value=done):
        try:
            copy_tree("a", "b", bounded=bounded)
        except SandboxError as e:
            return e
    raise AssertionError("copy_tree did not raise")


def test_the_parents_processes_are_stopped_while_it_is_copied(repo: Path, monkeypatch) -> None:
    """A background job of the parent rewrites /tmp/c without pause; during the copy it must not
    move (SIGSTOP to the parent's uid), and after the fork it runs again (SIGCONT)."""
    seen: list[tuple[str, str]] = []

    def watching_copy(src: str, dst: str, **kw) -> None:
        if src.endswith("/tmp"):
            first = Path(f"{src}/c").read_text()
            time.sleep(0.3)
            seen.append((first, Path(f"{src}/c").read_text()))
        copy_tree(src, dst, **kw)

    monkeypatch.setattr(bwrap, "copy_tree", watching_copy)
    with Sandbox.create(repo) as parent:
        job = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; done) &"
        parent.exec(f"{job} sleep 0.3")
        with parent.fork() as child:
            assert child.exec("test -s /tmp/c").exit_code == 0
        assert len(seen) == 1 and seen[0][0] == seen[0][1]  # frozen through the copy
        moving = parent.exec("a=$(cat /tmp/c); sleep 0.3; b=$(cat /tmp/c); echo $a $b").stdout
        a, b = moving.split()
        assert int(b) > int(a)  # and running again after it
