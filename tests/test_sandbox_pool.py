"""The warm sandbox pool: hands each sandbox out once, stays bounded, leaves nothing behind.

The attacks of ``tests/test_sandbox.py`` run against pooled sandboxes too (its ``create``
fixture); these tests cover what only the pool does. Root and ``bwrap`` are required, as in CI.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from coderl.sandbox import Limits, Sandbox, SandboxError
from coderl.sandbox import bwrap as bwrap_mod
from coderl.sandbox.pool import SandboxPool, _Key

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="the bwrap backend needs root and bubblewrap (make sysdeps)",
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    base = tmp_path / "repo"
    base.mkdir()
    (base / "README.md").write_text("hello\n")
    return base


def sandbox_procs() -> set[int]:
    """Host pids running as any sandbox uid (zombies left out)."""
    low, high = bwrap_mod.UID_BASE, bwrap_mod.UID_BASE + bwrap_mod.UID_SLOTS
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(x.split(":", 1) for x in status.splitlines() if ":" in x)
        uid = int(fields["Uid"].split()[0])
        if low <= uid < high and not fields["State"].strip().startswith("Z"):
            pids.add(int(entry))
    return pids


def scratch_dirs() -> set[str]:
    root = bwrap_mod.SCRATCH_ROOT
    return {p.name for p in root.iterdir() if p.name[0].isdigit()} if root.is_dir() else set()


def test_each_warm_sandbox_is_handed_out_once(repo: Path) -> None:
    with SandboxPool(size=3) as pool:
        pool.prepare(repo, 3)
        assert pool.wait_ready(60)
        assert pool.ready(repo) == 3
        boxes = [Sandbox.create(repo, pool=pool) for _ in range(3)]
        assert pool.stats.hits == 3 and pool.stats.misses == 0
        assert len({sb.uid for sb in boxes}) == 3  # type: ignore[attr-defined]
        assert len({sb.scratch for sb in boxes}) == 3  # type: ignore[attr-defined]
        boxes[0].write_text("README.md", "changed by 0\n")
        boxes[0].exec("echo 0 > /tmp/mine")
        for other in boxes[1:]:
            assert other.read_text("README.md") == "hello\n"
            assert other.exec("ls /tmp").stdout == ""
            assert other.diff() == ""
        for sb in boxes:
            sb.close()
        pool.prepare(repo, 0)
    assert (repo / "README.md").read_text() == "hello\n"


def test_refill_after_a_hit_and_start_on_the_spot_after_a_miss(repo: Path) -> None:
    with SandboxPool(size=2) as pool:
        with Sandbox.create(repo, pool=pool) as sb:  # nothing prepared: a miss, started now
            assert sb.exec("echo cold").stdout == "cold\n"
        assert (pool.stats.hits, pool.stats.misses, pool.stats.started) == (0, 1, 0)
        pool.prepare(repo, 1)
        assert pool.wait_ready(60)
        with Sandbox.create(repo, pool=pool) as sb:
            assert sb.exec("echo warm").stdout == "warm\n"
        assert pool.wait_ready(60)
        assert pool.ready(repo) == 1  # the slot was refilled in the background
        assert (pool.stats.hits, pool.stats.started) == (1, 2)
        other = Limits(timeout_s=5)  # other arguments: another key, not served by this one
        with Sandbox.create(repo, pool=pool, limits=other) as sb:
            assert sb.limits == other  # type: ignore[attr-defined]
        assert pool.stats.misses == 2


def test_pool_is_bounded_and_evicts_the_least_recently_used_base(
    repo: Path, tmp_path: Path
) -> None:
    second = tmp_path / "second"
    second.mkdir()
    with SandboxPool(size=3) as pool:
        pool.prepare(repo, 2)
        assert pool.wait_ready(60)
        pool.prepare(second, 2)  # 4 > 3: one of repo's goes
        assert pool.wait_ready(60)
        assert (pool.ready(repo), pool.ready(second)) == (1, 2)
        assert pool.stats.evicted == 1
        pool.prepare(second, 10)  # capped at size, evicting the rest of repo's
        assert pool.wait_ready(60)
        assert (pool.ready(repo), pool.ready(second)) == (0, 3)


def descends_from_this_process(pid: int) -> bool:
    """Whether ``pid``'s parent chain reaches this test process."""
    me = os.getpid()
    while pid > 1:
        try:
            fields = dict(
                x.split(":", 1) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            return False
        pid = int(fields["PPid"])
        if pid == me:
            return True
    return False


def test_close_leaves_no_process_and_no_file(repo: Path) -> None:
    # only this process's sandboxes: under xdist the other worker starts and stops its own
    procs = sandbox_procs()
    mine = f"{os.getpid()}-"
    dirs = {d for d in scratch_dirs() if d.startswith(mine)}
    pool = SandboxPool(size=4)
    pool.prepare(repo, 4)
    assert pool.wait_ready(60)
    started = {p for p in sandbox_procs() - procs if descends_from_this_process(p)}
    assert len(started) >= 4
    pool.close()
    pool.close()  # idempotent
    assert sandbox_procs() & started == set()
    assert {d for d in scratch_dirs() if d.startswith(mine)} - dirs == set()
    with pytest.raises(SandboxError, match="closed"):
        pool.create(repo)


PROBE = """
import os, sys
sys.path.insert(0, {root!r})
from coderl.sandbox.pool import SandboxPool
pool = SandboxPool(size=3)
pool.prepare({base!r}, 3)
assert pool.wait_ready(60)
def parent(pid):
    for line in open(f"/proc/{{pid}}/status"):
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0
def mine(pid):
    while pid > 1:
        try:
            pid = parent(pid)
        except OSError:
            return False
        if pid == os.getpid():
            return True
    return False
print("ready", *sorted(p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if mine(p)))
"""  # exits without closing the pool: prints its descendants' pids


def test_pool_is_closed_at_interpreter_exit(repo: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    probe = textwrap.dedent(PROBE.format(root=root, base=str(repo)))
    child = subprocess.Popen(
        [sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0 and out.startswith("ready"), err
    started = {int(p) for p in out.split()[1:]}  # the child's own processes (not another worker's)
    assert len(started) >= 3
    assert sandbox_procs() & started == set()
    assert not [d for d in scratch_dirs() if d.startswith(f"{child.pid}-")]


def test_failed_background_start_is_counted_and_raised_to_the_caller(
    repo: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: _Key) -> Sandbox:
        raise SandboxError("no bwrap today")

    monkeypatch.setattr(_Key, "start", broken)
    caplog.set_level(logging.WARNING, logger="coderl.sandbox.pool")
    with SandboxPool(size=2) as pool:
        pool.prepare(repo, 2)
        assert pool.wait_ready(60)
        assert pool.stats.failed >= 1 and "no bwrap today" in pool.stats.last_error
        assert pool.ready(repo) == 0
        with pytest.raises(SandboxError, match="no bwrap today"):
            Sandbox.create(repo, pool=pool)
    # the stats keep only the message; the log has the traceback, where the start raised
    assert any(r.exc_info and "no bwrap today" in str(r.exc_info[1]) for r in caplog.records)


def test_a_bug_in_a_background_start_ends_its_worker_loudly(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only what a start raises when a sandbox cannot start (``START_FAULTS``) is a failed
    start; a bug in the start code is not swallowed as one: it ends its worker with its
    traceback (``threading.excepthook``), and the pool's accounts stay straight."""

    def buggy(self: _Key) -> Sandbox:
        raise TypeError("a bug in the start code")

    seen: list[BaseException | None] = []
    monkeypatch.setattr(_Key, "start", buggy)
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    with SandboxPool(size=2) as pool:
        pool.prepare(repo, 1)
        assert pool.wait_ready(60)
        assert pool.stats.failed == 1 and "the worker raised" in pool.stats.last_error
    assert [type(e) for e in seen] == [TypeError]


def test_bad_input_is_a_clear_error(repo: Path) -> None:
    with pytest.raises(ValueError, match="size and workers"):
        SandboxPool(size=0)
    with SandboxPool(size=1) as pool:
        with pytest.raises(ValueError, match="bwrap sandboxes only"):
            Sandbox.create(repo, backend="local", pool=pool)
        with pytest.raises(ValueError, match="count"):
            pool.prepare(repo, -1)
        with pytest.raises(FileNotFoundError):
            pool.prepare(repo / "missing")
