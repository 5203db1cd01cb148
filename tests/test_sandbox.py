"""The sandbox runtime: the interface, the workspace diff, and the attacks that must fail.

All tests use real bubblewrap sandboxes (root and ``bwrap`` are required, as in CI) over a tiny
repository made in ``tmp_path``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coderl.sandbox import Limits, Sandbox, SandboxError, seccomp
from coderl.sandbox.local import UnisolatedSandboxWarning
from coderl.sandbox.pool import SandboxPool

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="the bwrap backend needs root and bubblewrap (make sysdeps)",
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    base = tmp_path / "repo"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "__init__.py").write_text("")
    (base / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    (base / "README.md").write_text("hello\n")
    (base / "data.bin").write_bytes(b"\x00\x01\x02")
    return base


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    with SandboxPool(size=8) as p:
        yield p


@pytest.fixture(params=["fresh", "pooled"])
def create(request: pytest.FixtureRequest, pool: SandboxPool) -> Callable[..., Sandbox]:
    """``Sandbox.create``, or the same through a warm pool: every attack must fail in both."""
    if request.param == "fresh":
        return Sandbox.create

    def pooled(base: Path, **kwargs: object) -> Sandbox:
        pool.prepare(base, 1, **kwargs)  # type: ignore[arg-type]
        assert pool.wait_ready(60)
        hits = pool.stats.hits
        sb = Sandbox.create(base, pool=pool, **kwargs)  # type: ignore[arg-type]
        assert pool.stats.hits == hits + 1, pool.stats  # it really was a warm sandbox
        pool.prepare(base, 0, **kwargs)  # type: ignore[arg-type]
        return sb

    return pooled


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def procs_of(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``, zombies (already dead) left out."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(x.split(":", 1) for x in status.splitlines() if ":" in x)
        if fields["State"].strip().startswith("Z"):  # exited; its parent has yet to reap it
            continue
        if int(fields["Uid"].split()[0]) == uid:
            pids.append(int(entry))
    return pids


# --- the interface -------------------------------------------------------------------------


def test_exec_is_a_terminal_cd_and_env_persist(repo: Path) -> None:
    with Sandbox.create(repo) as sb:
        r = sb.exec("pwd; echo out; echo err >&2; exit_status=7; (exit 3)")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "/testbed\nout\n", "err\n")
        assert not r.timed_out and not r.truncated and r.duration_s >= 0
        sb.exec("cd pkg && export GREETING=hi && LOCAL=x")
        r = sb.exec("pwd; echo $GREETING $LOCAL; python3 -c 'import mod; print(mod.add(2, 3))'")
        assert r.stdout == "/testbed/pkg\nhi x\n5\n", r
        assert sb.exec("cat").stdout == ""  # stdin is /dev/null, not the protocol pipe
        r = sb.exec("echo h > ~/.rc && cat ~/.rc && echo t > /tmp/t && cat /tmp/t && echo $HOME")
        assert r.stdout == "h\nt\n/home/sandbox\n", r  # a writable home and /tmp
        pool = "import multiprocessing as m; print(m.Pool(2).map(abs, [-1, -2]))"
        assert sb.exec(f"python3 -c '{pool}'").stdout == "[1, 2]\n"  # semaphores in /dev/shm


def test_read_write_list_and_errors(repo: Path) -> None:
    with Sandbox.create(repo) as sb:
        assert sb.read_text("pkg/mod.py").startswith("def add")
        assert sb.read_text("/testbed/README.md") == "hello\n"
        sb.write_text("new/deep/file.txt", "é ünïcode\nline 2 with 'quotes' and $dollar\n")
        assert sb.read_text("new/deep/file.txt") == "é ünïcode\nline 2 with 'quotes' and $dollar\n"
        assert sb.exec("cat new/deep/file.txt").stdout.startswith("é ünïcode")
        assert sb.list() == ["README.md", "data.bin", "new/", "pkg/"]
        assert sb.list("pkg") == ["__init__.py", "mod.py"]
        sb.exec("cd pkg")  # relative paths stay relative to /testbed
        assert sb.read_text("README.md") == "hello\n"
        with pytest.raises(FileNotFoundError):
            sb.read_text("missing.py")
        with pytest.raises(IsADirectoryError):
            sb.read_text("pkg")
        with pytest.raises(NotADirectoryError):
            sb.list("README.md")
        with pytest.raises(FileNotFoundError):
            sb.list("nope")
        with pytest.raises(PermissionError):
            sb.write_text("/usr/evil.txt", "x")
        assert sb.exec("pwd").stdout == "/testbed/pkg\n"


def test_diff_applies_to_base_and_base_never_changes(repo: Path, tmp_path: Path) -> None:
    before = snapshot(repo)
    with Sandbox.create(repo) as sb:
        sb.write_text("pkg/mod.py", "def add(a, b):\n    return a + b + 0\n")
        sb.exec("printf 'no newline' > new.txt && rm README.md && chmod +x pkg/__init__.py")
        sb.exec("mkdir -p pkg/__pycache__ && echo junk > pkg/__pycache__/mod.pyc")
        sb.exec("printf '\\x00\\x03' > data.bin && mkdir gone && rm -r gone")
        patch = sb.diff()
    assert snapshot(repo) == before
    assert "__pycache__" not in patch
    assert "Binary files a/data.bin and b/data.bin differ" in patch
    assert "-    return a + b\n+    return a + b + 0\n" in patch
    assert "deleted file mode 100644\n--- a/README.md\n+++ /dev/null" in patch
    assert "old mode 100644\nnew mode 100755" in patch
    # the text part of the patch applies cleanly to a copy of the base (binary part left out)
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    text_patch = "diff --git" + "diff --git".join(
        p for p in patch.split("diff --git") if p and "Binary files" not in p
    )
    subprocess.run(["git", "apply", "-"], input=text_patch.encode(), cwd=copy, check=True)
    assert (copy / "new.txt").read_text() == "no newline"
    assert not (copy / "README.md").exists()
    assert (copy / "pkg" / "mod.py").read_text().endswith("a + b + 0\n")
    assert os.access(copy / "pkg" / "__init__.py", os.X_OK)


def test_diff_of_replaced_directory_lists_every_deleted_file(repo: Path) -> None:
    with Sandbox.create(repo) as sb:
        sb.exec("rm -r pkg && echo now-a-file > pkg")
        patch = sb.diff()
    assert "deleted file mode 100644\n--- a/pkg/mod.py" in patch
    assert "--- a/pkg/__init__.py" not in patch  # an empty file: header only
    assert "deleted file mode 100644" in patch.split("diff --git a/pkg/__init__.py")[1]
    assert "new file mode 100644\n--- /dev/null\n+++ b/pkg\n@@ -0,0 +1 @@\n+now-a-file" in patch


def test_mounts_python_and_venv(repo: Path, tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "helper.py").write_text("VALUE = 41\n")
    results = tmp_path / "results"
    results.mkdir()
    with Sandbox.create(
        repo,
        ro_mounts={"/opt/tools": str(tools)},
        rw_mounts={"/results": str(results)},
        env={"PYTHONPATH": "/opt/tools"},
    ) as sb:
        r = sb.exec("python3 -c 'import helper; print(helper.VALUE + 1)' > /results/out.txt")
        assert r.exit_code == 0, r
        assert sb.exec("touch /opt/tools/x").exit_code != 0
    assert (results / "out.txt").read_text() == "42\n"
    assert (results / "out.txt").stat().st_uid == results.stat().st_uid  # host ownership kept
    assert sorted(os.listdir(tools)) == ["helper.py"]


def test_system_site_packages_and_vendored_trees_are_hidden(repo: Path, tmp_path: Path) -> None:
    """Installed and vendored copies of PyPI libraries are empty, read-only directories in a
    sandbox without network (they hold pristine copies of task sources); a networked sandbox
    (an environment build: pip needs them) still sees them."""
    import glob
    import sysconfig

    venv = tmp_path / "venv"
    vendor = venv / "lib" / "python3.11" / "site-packages" / "pip" / "_vendor"
    vendor.mkdir(parents=True)
    (vendor / "six.py").write_text("# a vendored copy\n")
    (vendor.parent / "__init__.py").write_text("")
    system = [
        p
        for p in [
            *glob.glob("/usr/lib/python3/dist-packages"),
            sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"],
        ]
        if os.path.isdir(p) and os.listdir(p)
    ]
    assert system  # this host has at least one non-empty system site directory
    with Sandbox.create(repo, ro_mounts={"/venv": str(venv)}) as sb:
        for path in [*system, "/venv/lib/python3.11/site-packages/pip/_vendor"]:
            r = sb.exec(f"ls -A {path}")
            assert r.exit_code == 0 and r.stdout.strip() == "", (path, r.stdout[:200])
            assert sb.exec(f"touch {path}/x").exit_code != 0
        assert sb.exec("cat /venv/lib/python3.11/site-packages/pip/_vendor/six.py").exit_code != 0
        assert sb.exec("ls /venv/lib/python3.11/site-packages/pip/__init__.py").exit_code == 0
        assert sb.exec("python3 -I -c 'import json'").exit_code == 0
    with Sandbox.create(repo, ro_mounts={"/venv": str(venv)}, network=True) as sb:
        r = sb.exec("cat /venv/lib/python3.11/site-packages/pip/_vendor/six.py")
        assert r.stdout == "# a vendored copy\n"


def test_bad_input_is_a_clear_error(repo: Path) -> None:
    with pytest.raises(ValueError, match="valid: \\['bwrap', 'container', 'local'\\]"):
        Sandbox.create(repo, backend="docker")
    with pytest.raises(FileNotFoundError):
        Sandbox.create(repo / "missing")
    with pytest.raises(ValueError, match="absolute"):
        Sandbox.create(repo, ro_mounts={"relative": str(repo)})
    with pytest.raises(ValueError, match="reserved"):
        Sandbox.create(repo, rw_mounts={"/proc/x": str(repo)})
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    sb = Sandbox.create(repo)
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")


def test_local_backend_must_be_asked_for_and_warns(repo: Path) -> None:
    with pytest.warns(UnisolatedSandboxWarning, match="WITHOUT ISOLATION"):
        sb = Sandbox.create(repo, backend="local")
    with sb:
        sb.exec("cd pkg && export X=1")
        assert sb.exec("echo $X; basename $PWD").stdout == "1\npkg\n"
        sb.write_text("/testbed/n.txt", "n\n")
        assert sb.read_text("n.txt") == "n\n"
        assert "+++ b/n.txt" in sb.diff()
        r = sb.exec("sleep 5", timeout=0.5)
        assert r.timed_out and r.exit_code == 124
    assert not (repo / "n.txt").exists()


# --- attacks that must fail ----------------------------------------------------------------


def test_no_network_and_no_dns(repo: Path, create: Callable[..., Sandbox]) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
        "except OSError as e: print('refused', e)\n"
        "try:\n"
        "    socket.getaddrinfo('pypi.org', 443); print('resolved')\n"
        "except OSError as e: print('nodns', e)\n"
    )
    try:
        with create(repo) as sb:
            sb.write_text("probe.py", probe)
            r = sb.exec("python3 probe.py")
            assert "refused" in r.stdout and "nodns" in r.stdout, r
            assert "connected" not in r.stdout and "resolved" not in r.stdout
        with create(repo, network=True) as sb:  # the install-step escape hatch works
            sb.write_text("probe.py", probe)
            assert "connected" in sb.exec("python3 probe.py").stdout
    finally:
        server.close()


def test_writes_outside_testbed_never_reach_the_host(
    repo: Path, tmp_path: Path, create: Callable[..., Sandbox]
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    with create(repo) as sb:
        for target in ("/usr/evil", "/etc/evil", "/evil", "/root/evil", f"{victim}/evil"):
            r = sb.exec(f"echo pwned > {target}")
            assert r.exit_code != 0, (target, r)
        assert sb.exec("echo ok > /tmp/scratch && cat /tmp/scratch").stdout == "ok\n"
        sb.exec("ln -s /etc/passwd /testbed/link && ln -s / /testbed/rootlink")
        assert "root:x:0:0" in sb.read_text("link")  # the sandbox's own /etc/passwd
        assert "sandbox:x:" in sb.read_text("link")
        patch = sb.diff()
    assert "new file mode 120000" in patch and "+/etc/passwd" in patch
    assert not Path("/usr/evil").exists() and not Path("/etc/evil").exists()
    assert not Path("/evil").exists() and not (victim / "evil").exists()


def test_host_home_and_environment_are_invisible(
    repo: Path, monkeypatch, create: Callable[..., Sandbox]
) -> None:
    home = Path.home()
    secret = home / "coderl-sandbox-test-secret.txt"
    secret.write_text("s3cret")
    monkeypatch.setenv("CODERL_TEST_SECRET", "leaked-value")
    try:
        with create(repo) as sb:
            r = sb.exec(f"cat {secret}; ls {home}; env; cat /proc/1/environ")
            assert "s3cret" not in r.stdout and "leaked-value" not in r.stdout + r.stderr
            assert "CODERL_TEST_SECRET" not in r.stdout
            assert sb.exec("echo $HOME").stdout != f"{home}\n"
            names = sb.exec("ps -e -o comm=").stdout.split()
            assert sorted(set(names)) == ["bash", "bwrap", "ps"], names  # bwrap: the init
    finally:
        secret.unlink()


def test_fork_bomb_is_contained(repo: Path, create: Callable[..., Sandbox]) -> None:
    with create(repo, limits=Limits(processes=64)) as sb:
        uid = sb.uid  # type: ignore[attr-defined]
        counts: list[int] = []
        done = threading.Event()

        def sample() -> None:  # the host watches the sandbox uid while the bomb runs
            while not done.is_set():
                counts.append(len(procs_of(uid)))
                time.sleep(0.05)

        watcher = threading.Thread(target=sample)
        watcher.start()
        r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 10", timeout=2)
        done.set()
        watcher.join()
        assert r.timed_out
        assert 32 <= max(counts) <= 64, max(counts)  # it did explode, up to the limit only
        assert sb.exec("echo alive").stdout == "alive\n"  # the sandbox recovers
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    assert procs_of(uid) == []


def test_memory_bomb_is_killed(repo: Path, create: Callable[..., Sandbox]) -> None:
    with create(repo, limits=Limits(memory_bytes=256 * 1024**2)) as sb:
        r = sb.exec("python3 -c 'x = [bytearray(2**20) for _ in range(4096)]'", timeout=20)
        assert r.exit_code != 0 and not r.timed_out
        assert "MemoryError" in r.stderr


def test_busy_loop_times_out_and_leaves_no_process(
    repo: Path, create: Callable[..., Sandbox]
) -> None:
    with create(repo) as sb:
        sb.exec("cd pkg; export KEPT=yes")
        start = time.monotonic()
        r = sb.exec('python3 -c "while True: pass"', timeout=2)
        elapsed = time.monotonic() - start
        assert r.timed_out and r.exit_code == 124
        assert 2 <= elapsed < 3.5, elapsed
        assert procs_of(sb.uid) == []  # type: ignore[attr-defined]
        # the next command gets a fresh shell that kept the terminal's cwd and exports
        assert sb.exec("pwd; echo $KEPT").stdout == "/testbed/pkg\nyes\n"


def test_delayed_write_after_timeout_never_appears(
    repo: Path, create: Callable[..., Sandbox]
) -> None:
    with create(repo) as sb:
        start = time.monotonic()
        r = sb.exec("sleep 5; touch /testbed/flag", timeout=1)
        assert r.timed_out
        time.sleep(max(0.0, 5.5 - (time.monotonic() - start)))
        assert sb.exec("ls /testbed/flag").exit_code != 0
        assert "flag" not in sb.diff()


def test_output_flood_is_truncated(repo: Path, create: Callable[..., Sandbox]) -> None:
    limits = Limits(output_bytes=64 * 1024)
    with create(repo, limits=limits) as sb:
        r = sb.exec("head -c 100000000 /dev/zero | tr '\\0' x; echo END", timeout=30)
        assert r.exit_code == 0 and r.truncated and not r.timed_out
        assert len(r.stdout) < 64 * 1024 + 100
        assert r.stdout.startswith("xxx") and r.stdout.endswith("xxxEND\n")
        # 100_000_000 x + "END\n" = 100_000_004 bytes; 32_768 head + 32_768 tail kept
        assert "[... 99934468 bytes truncated ...]" in r.stdout
        assert sb.exec("echo next").stdout == "next\n"


def test_two_sandboxes_on_one_base_are_isolated(repo: Path, create: Callable[..., Sandbox]) -> None:
    with create(repo) as a, create(repo) as b:
        assert a.uid != b.uid  # type: ignore[attr-defined]
        a.write_text("README.md", "from a\n")
        a.exec("echo a > /tmp/a && sleep 60 &")
        assert b.read_text("README.md") == "hello\n"
        assert b.exec("ls /tmp").stdout == ""
        assert "sleep" not in b.exec("ps -e -o comm=").stdout
        assert "README.md" not in b.diff()
    assert (repo / "README.md").read_text() == "hello\n"


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
def test_eight_parallel_busy_loops_all_come_back_in_time(
    repo: Path, pool: SandboxPool, pooled: bool
) -> None:
    if pooled:
        pool.prepare(repo, 8)
        assert pool.wait_ready(60)
    hits = pool.stats.hits

    def run(_: int) -> tuple[bool, float]:
        with Sandbox.create(repo, pool=pool if pooled else None) as sb:
            r = sb.exec("while true; do :; done", timeout=2)
            return r.timed_out, r.duration_s

    start = time.monotonic()
    with ThreadPoolExecutor(8) as threads:
        results = list(threads.map(run, range(8)))
    assert all(timed_out for timed_out, _ in results)
    assert all(duration < 3.5 for _, duration in results), results
    assert time.monotonic() - start < 8  # creating and closing 8 sandboxes included
    assert pool.stats.hits == hits + (8 if pooled else 0)
    pool.prepare(repo, 0)


def test_close_leaves_no_process_and_no_file(repo: Path, create: Callable[..., Sandbox]) -> None:
    sb = create(repo)
    sb.exec("sleep 100 & (setsid sleep 100 &) ; echo x > /tmp/x")
    uid, scratch = sb.uid, sb.scratch  # type: ignore[attr-defined]
    assert len(procs_of(uid)) >= 3
    assert str(scratch) not in Path("/proc/self/mounts").read_text()  # its mounts: in its stage
    assert mounted_anywhere(str(scratch))
    sb.close()
    assert procs_of(uid) == []
    assert not scratch.exists()
    assert not mounted_anywhere(str(scratch))  # no process sees a mount of it any more


def mounted_anywhere(path: str) -> bool:
    """Whether any process's mount namespace has a mount at or below ``path``."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and f" {path}" in Path(f"/proc/{entry}/mountinfo").read_text():
                return True
        except OSError:
            continue
    return False


DIE_PROBE = """
import sys
sys.path.insert(0, {root!r})
from coderl.sandbox import Sandbox
sb = Sandbox.create({base!r})
print(sb.uid, flush=True)
sb.exec("sleep 60 & sleep 60")  # busy: the shell does not read its input any more
"""


def test_sandbox_dies_with_a_killed_host_process(repo: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    probe = DIE_PROBE.format(root=root, base=str(repo))
    child = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    uid = int(child.stdout.readline())
    deadline = time.monotonic() + 10
    while len(procs_of(uid)) < 3 and time.monotonic() < deadline:  # bash and two sleeps
        time.sleep(0.05)
    assert len(procs_of(uid)) >= 3
    child.kill()
    child.wait()
    while procs_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs_of(uid) == []


TTY_PROBE = """
import sys
sys.path.insert(0, {root!r})
from coderl.sandbox import Sandbox
from coderl.sandbox.spawn import has_controlling_terminal
with Sandbox.create({base!r}) as sb:
    r = sb.exec("(exec 3</dev/tty) 2>/dev/null && echo tty-open || echo no-tty")
    print(has_controlling_terminal(), r.stdout.strip())
"""


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_the_callers_terminal_is_out_of_reach(repo: Path) -> None:
    """With a controlling terminal the sandbox gets its own session (bwrap --new-session);
    without one it shares a terminal-less session: either way /dev/tty does not open."""
    root = str(Path(__file__).resolve().parents[1])
    probe = Path(tempfile.mkdtemp()) / "probe.py"
    probe.write_text(TTY_PROBE.format(root=root, base=str(repo)))
    try:
        with_tty = subprocess.run(
            ["script", "-qec", f"{sys.executable} {probe}", "/dev/null"],
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
        )
        without = subprocess.run(
            [sys.executable, str(probe)],
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
        )
    finally:
        shutil.rmtree(probe.parent)
    assert with_tty.stdout.split() == ["True", "no-tty"], with_tty
    assert without.stdout.split() == ["False", "no-tty"], without


def test_sandbox_made_in_a_finished_thread_survives(repo: Path) -> None:
    box: list[Sandbox] = []
    t = threading.Thread(target=lambda: box.append(Sandbox.create(repo)))
    t.start()
    t.join()
    with box[0] as sb:
        assert sb.exec("echo still here").stdout == "still here\n"


def test_any_command_text_survives_quoting(repo: Path) -> None:
    nasty = "tab\there 'single' \"double\" $HOME `id` \\back\\slash é 中文 \x01\x7f !x ${y}"
    with Sandbox.create(repo) as sb:
        sb.write_text("nasty.txt", nasty)
        r = sb.exec("cat <<'EOF'\n" + nasty + "\nEOF")
        assert r.stdout == nasty + "\n"
        assert sb.read_text("nasty.txt") == nasty


def test_exit_and_exec_in_a_command_restart_the_shell(repo: Path) -> None:
    with Sandbox.create(repo) as sb:
        sb.exec("cd pkg; export A=1")
        assert sb.exec("exit 7").exit_code == 7
        assert sb.exec("pwd; echo $A").stdout == "/testbed/pkg\n1\n"
        assert sb.exec("exec echo replaced").stdout == "replaced\n"
        assert sb.exec("echo $A").stdout == "1\n"


def test_copy_workspace_when_idmapped_mounts_are_refused(repo: Path, monkeypatch) -> None:
    import errno

    from coderl.sandbox import mounts

    real = mounts.idmapped_bind

    def refuse_base(source: str, *args, **kwargs) -> None:
        if Path(source) == repo.resolve():
            raise OSError(errno.EINVAL, "no idmapped mounts here")
        real(source, *args, **kwargs)

    monkeypatch.setattr(mounts, "idmapped_bind", refuse_base)
    with Sandbox.create(repo) as sb:
        assert sb.workspace_mode == "copy"  # type: ignore[attr-defined]
        sb.exec("echo extra >> README.md && rm pkg/mod.py && touch new.py")
        patch = sb.diff()
        assert sb.exec("id -un; stat -c %U README.md").stdout == "sandbox\nsandbox\n"
    assert "+extra" in patch and "--- a/pkg/mod.py" in patch and "b/new.py" in patch
    assert (repo / "pkg" / "mod.py").exists()


def test_private_host_trees_mount_readable(repo: Path, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "hidden_test.py").write_text("assert True\n")
    (private / "hidden_test.py").chmod(0o600)
    with Sandbox.create(repo, ro_mounts={"/coderl/hidden": str(private)}) as sb:
        assert sb.exec("python3 /coderl/hidden/hidden_test.py").exit_code == 0
        assert sb.exec("rm /coderl/hidden/hidden_test.py").exit_code != 0
    assert (private / "hidden_test.py").exists()


ROOTLESS_PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
from coderl.sandbox import Limits, Sandbox
out = {{}}
with Sandbox.create({base!r}, limits=Limits(processes=40)) as sb:
    out["mode"] = sb.workspace_mode
    out["id"] = sb.exec("id -u").stdout.strip()
    out["userns"] = sb.exec("unshare -U true").exit_code
    sb.exec("echo more >> README.md; mkdir locked; chmod 000 locked")
    out["diff"] = sb.diff()
    out["bomb"] = sb.exec("bomb() {{ bomb | bomb & }}; bomb; sleep 10", timeout=1.5).timed_out
    out["after"] = sb.exec("echo ok").stdout
    scratch = sb.scratch
out["scratch_left"] = scratch.exists()
print(json.dumps(out))
"""


def test_rootless_mode_runs_as_the_callers_uid(repo: Path) -> None:
    """A non-root caller gets a user-namespace sandbox over a copy of the base."""
    uid = 4321
    # an interpreter the unprivileged uid can run (ours may live in root's home directory)
    python = next(
        (
            p
            for p in ("/usr/bin/python3.11", "/usr/local/bin/python3.11", "/usr/bin/python3")
            if os.path.exists(p)
            and subprocess.run(
                [p, "-c", "import sys; assert sys.version_info >= (3, 11)"], user=uid
            ).returncode
            == 0
        ),
        None,
    )
    if python is None:
        pytest.skip("no Python >= 3.11 that an unprivileged user can run")
    work = Path(tempfile.mkdtemp(prefix="coderl-rootless-"))
    try:
        shutil.copytree(repo, work / "repo")
        script = work / "probe.py"
        root = str(Path(__file__).resolve().parents[1])
        script.write_text(ROOTLESS_PROBE.format(root=root, base=str(work / "repo")))
        for p in [work, *work.rglob("*")]:
            p.chmod(0o755)
        r = subprocess.run(
            [python, str(script)],
            user=uid,
            group=uid,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["mode"] == "copy" and out["id"] == str(uid)
        assert out["userns"] != 0  # no nested user namespaces
        assert "+more" in out["diff"]
        assert out["bomb"] and out["after"] == "ok\n"
        assert not out["scratch_left"]
        assert procs_of(uid) == []
    finally:
        shutil.rmtree(work)


def test_diff_through_directory_rename_and_rewrite(repo: Path) -> None:
    """A renamed directory (copy + opaque directory in the overlay) and unchanged rewrites."""
    with Sandbox.create(repo) as sb:
        sb.exec(
            "mv pkg lib && mkdir pkg && cp lib/mod.py pkg/mod.py && cp README.md R && mv R README.md"
        )
        patch = sb.diff()
    # pkg/mod.py came back identical: not in the diff; pkg/__init__.py is gone; lib/ is new
    assert "a/pkg/mod.py" not in patch and "README.md" not in patch
    assert "diff --git a/pkg/__init__.py b/pkg/__init__.py\ndeleted file mode 100644\n" in patch
    assert "new file mode 100644\n--- /dev/null\n+++ b/lib/mod.py" in patch
    with Sandbox.create(repo) as sb, pytest.raises(ValueError, match="NUL"):
        sb.exec("echo \0")


def test_cpu_file_size_and_disk_limits(repo: Path, create: Callable[..., Sandbox]) -> None:
    limits = Limits(cpu_s=1, file_size_bytes=1024**2, disk_bytes=8 * 1024**2)
    with create(repo, limits=limits) as sb:
        r = sb.exec('python3 -c "while True: pass"', timeout=20)
        assert not r.timed_out and r.exit_code == 128 + 9  # RLIMIT_CPU hard limit: SIGKILL
        r = sb.exec("head -c 2000000 /dev/zero > big; echo $?; stat -c %s big")
        assert r.stdout.split() == ["153", "1048576"]  # SIGXFSZ (128 + 25) at 1 MiB
        r = sb.exec(
            "for i in 1 2 3 4 5 6 7 8 9; do head -c 1000000 /dev/zero > f$i || exit 9; done"
        )
        assert r.exit_code == 9 and "No space left on device" in r.stderr  # the 8 MiB tmpfs
        assert sb.exec("rm -f f* big && echo ok").stdout == "ok\n"  # and it recovers


def test_file_count_is_bounded_in_every_writable_tree(
    repo: Path, create: Callable[..., Sandbox]
) -> None:
    """Each file costs the host kernel memory that ``disk_bytes`` does not count (issue 47,
    class 7): empty files, directories and symlinks, in the workspace, /tmp, /dev/shm and the
    home directory, all draw on one inode budget and stop at it; the sandbox then recovers."""
    limits = Limits(disk_bytes=8 * 1024**2, inodes=4096)
    assert Limits(disk_bytes=1024**2).inode_limit == 4096  # small sandboxes get few by default
    assert Limits().inode_limit == 4 * 1024**3 // (16 * 1024)
    with pytest.raises(ValueError, match="inodes"):
        Limits(inodes=10)
    makers = {  # python, not one process per file: the budget is reached in well under a second
        "empty files in the workspace": "open(f'/testbed/f{i}', 'w').close()",
        "directories in /tmp": "os.mkdir(f'/tmp/d{i}')",
        "symlinks in /dev/shm": "os.symlink('/x', f'/dev/shm/l{i}')",
        "empty files in home": "open(os.path.expanduser(f'~/h{i}'), 'w').close()",
        "hard links in /tmp": "os.link('/tmp/ok', f'/tmp/k{i}')",  # /tmp/ok: the clean-up's; no new inode
    }
    with create(repo, limits=limits) as sb:
        for what, make in makers.items():
            r = sb.exec(f'python3 -c "import os\nfor i in range(6000): {make}"', timeout=60)
            assert r.exit_code == 1 and "No space left on device" in r.stderr, (what, r)
            made = sb.exec("ls -A /testbed /tmp /dev/shm ~ | wc -l").stdout
            assert int(made) < 4096, (what, made)
            clean = (
                "rm -rf /testbed/f* /tmp/d* /tmp/k* /dev/shm/l* ~/h* && touch /tmp/ok && echo ok"
            )
            assert sb.exec(clean, timeout=60).stdout == "ok\n", what  # and it recovers


def test_no_memory_outside_the_tmpfs_outlives_a_process_or_escapes_its_limit(
    repo: Path, create: Callable[..., Sandbox]
) -> None:
    """Issue 47, class 7, beyond files: System V segments, queues and semaphore sets outlive
    every process of the sandbox, and a memfd written with ``write`` is never mapped, so
    neither ``disk_bytes`` nor ``memory_bytes`` bounds them (an 8 MiB sandbox pinned 1.3 GB of
    segments and 1 GB of memfds). The filter refuses them; POSIX shared memory lives in
    ``/dev/shm``, the bounded tmpfs, and still works."""
    probe = (
        "import ctypes, os, mmap\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def errno_of(r): return ctypes.get_errno() if r == -1 else 0\n"
        "print('shmget', errno_of(libc.shmget(0, 1 << 20, 0o1600)))\n"
        "print('msgget', errno_of(libc.msgget(0, 0o1600)))\n"
        "print('semget', errno_of(libc.semget(0, 1, 0o1600)))\n"
        "try:\n    os.memfd_create('x'); print('memfd 0')\n"
        "except OSError as e:\n    print('memfd', e.errno)\n"
        "fd = os.open('/dev/shm/posix', os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096); m[:2] = b'ok'; print('posix', m[:2].decode())\n"
    )
    if not seccomp.supported():
        pytest.skip("no seccomp syscall table for this machine")
    with create(repo) as sb:
        sb.write_text("/tmp/probe.py", probe)
        r = sb.exec("python3 /tmp/probe.py")
        eperm = str(errno.EPERM)
        assert r.stdout.split("\n")[:5] == [
            f"{k} {eperm}" for k in ("shmget", "msgget", "semget", "memfd")
        ] + ["posix ok"], r


def test_seccomp_refuses_user_namespaces_and_kernel_extras(
    repo: Path, create: Callable[..., Sandbox]
) -> None:
    probe = (
        "import ctypes, os, threading, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(nr, *args):\n"
        "    return libc.syscall(nr, *args), ctypes.get_errno()\n"
        "print('unshare', call(272, 0x10000000))\n"  # unshare(CLONE_NEWUSER) on x86_64
        "print('keyctl', call(250, 0, 0, 0, 0, 0))\n"
        "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
        "print(subprocess.run(['echo', 'child ok'], capture_output=True, text=True).stdout)\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    with create(repo) as sb:
        sb.write_text("/tmp/probe.py", probe)
        out = sb.exec("python3 /tmp/probe.py").stdout
        assert "unshare (-1, 1)" in out and "keyctl (-1, 1)" in out  # EPERM from the filter
        assert "thread ok" in out and "child ok" in out  # clone3 -> ENOSYS -> clone fallback
        assert "Seccomp:\t2" in sb.exec("grep Seccomp: /proc/self/status").stdout


def test_workspace_reads_never_block_on_a_fifo_swapped_in(tmp_path: Path) -> None:
    """A regular file replaced by a FIFO between the host's stat and its open (the sandbox
    may still run while the host diffs) is read as empty instead of blocking forever."""
    from coderl.sandbox import workspace

    (tmp_path / "f").write_text("x")
    st = os.stat(tmp_path / "f")
    os.unlink(tmp_path / "f")
    os.mkfifo(tmp_path / "f")
    dirfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert workspace._entry("f", dirfd, st).data == b""
    finally:
        os.close(dirfd)


def test_diff_of_odd_names_and_deep_trees(repo: Path) -> None:
    """Names that are not UTF-8 are quoted the way git writes them, and a tree 1,100 levels
    deep does not crash the walk (os.fwalk recursed once per level): files within
    ``MAX_DEPTH`` levels are in the diff, deeper ones are left out; the diff applies back."""
    from coderl.grading.apply import apply_to_copy
    from coderl.sandbox import workspace

    deep = "/".join(["d"] * 1100)
    near = "/".join(["e"] * (workspace.MAX_DEPTH - 1))
    with Sandbox.create(repo, backend="bwrap") as sb:
        res = sb.exec(
            f"mkdir -p {deep} {near} && echo y > {deep}/x && echo w > {near}/w"
            " && printf 'z\\n' > $'caf\\xe9.txt'"
        )
        assert res.exit_code == 0, res.stderr
        diff = sb.diff()
    diff.encode("ascii")  # quoted: always encodable
    assert '"b/caf\\351.txt"' in diff
    tree = repo.parent / "applied"
    tree.mkdir()
    changed, _ = apply_to_copy(repo, diff, lambda p: False, tree)
    assert os.fsdecode(b"caf\xe9.txt") in changed and f"{near}/w" in changed
    assert f"{deep}/x" not in changed  # past MAX_DEPTH: left out of the diff, not a crash
    from coderl.grading.apply import remove_tree

    remove_tree(tree)


def test_works_with_descriptors_past_fd_setsize(repo: Path) -> None:
    """A process holding many sandboxes (SFT on hundreds of demonstrations) has descriptors past
    select's FD_SETSIZE (1024); creating, running and closing a sandbox must still work there
    (it raised "filedescriptor out of range in select()" when the pidfd was waited on by select)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1200, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with Sandbox.create(repo) as sb:
            assert sb.exec("echo ok").stdout == "ok\n"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
