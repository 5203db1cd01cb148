"""The sharded trainer launched on Ray (``trainer.distributed.launcher=ray``, one actor per
rank, coderl.train.ray_launch) on a local Ray of 2 CPUs: a two-rank ``coderl train`` equals one
plain process and its checkpoint resumes on Ray; a failing rank, a rank that returns an error
status and ranks the cluster cannot place are errors, not hangs; bad settings are one line.

Tolerance: that of tests/test_distributed.py (rewards equal, loss and gradient norm to 1e-4
relative; the weights saved after a step within 1e-3 of that step's move in one process: entry by
entry fails on an entry whose gradient is of the order of AdamW's eps, seen 1.8e-5 against 1e-5
allowed on one entry of 65536 at step 2).
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file
from test_distributed import (
    REPO,
    TOY,
    _assert_same_update,
    _coderl,
    _free_port,
    assert_same_metrics,
)

ray = pytest.importorskip("ray", reason="the ray extra is installed by `make test`")

from coderl.cli import main  # noqa: E402
from coderl.ray_cluster import ensure_ray, shutdown_owned_ray  # noqa: E402
from coderl.train.ray_launch import RankFailed, rank_envs, run_ranks  # noqa: E402

ON_RAY = [
    "trainer.distributed.enabled=true",
    "trainer.distributed.launcher=ray",
    "trainer.distributed.world_size=2",
]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray of 2 CPUs started by this process, its GCS address; one more try if the
    node timed out starting (Ray waits a fixed 30 s for its raylet, which an overloaded machine
    can exceed; a failed start shuts down what it started)."""
    assert not ray.is_initialized()
    try:
        ensure_ray(None, num_cpus=2)
    except Exception as err:
        if "timed out during startup" not in str(err):
            raise
        ensure_ray(None, num_cpus=2)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        shutdown_owned_ray()
    assert not ray.is_initialized()


@pytest.mark.timeout(900)
def test_coderl_train_on_ray_equals_one_process_and_resumes_on_ray(cluster, tmp_path):
    # configs/toy.yaml (full fine-tuning, 2 tasks x G=8): two steps on two Ray-launched ranks,
    # then step 3 resumed by `coderl train --resume` (its config.yaml relaunches on Ray),
    # against one rank under torchrun (one process; split rollouts seed each task group's
    # rollout on its own, so the reference is a sharded run of one rank, not a plain one);
    # the coderl commands join this test's Ray by its address (the path of a multi-node
    # cluster) rather than each starting one
    on_ray = [*ON_RAY, f"async.ray_address={cluster}"]
    ckpt = ["trainer.checkpoint_every=1", "trainer.keep_checkpoints=3"]
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    _coderl(["train", *TOY, "trainer.steps=2", *ckpt, f"run_dir={sharded}", *on_ray], nproc=None)
    assert (sharded / "ranks" / "rank-1").is_dir()  # a second rank ran
    _coderl(["train", "--resume", str(sharded), "trainer.steps=3"], nproc=None)
    one_rank = [*ckpt, f"run_dir={plain}", "trainer.distributed.enabled=true"]
    _coderl(["train", *TOY, "trainer.steps=3", *one_rank], nproc=1)
    assert_same_metrics(sharded, plain, steps=3)

    def saved(run, step):
        return load_file(run / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors")

    for step in (2, 3):  # each step's update as one process's, to 1e-3 of its move
        _assert_same_update(saved(sharded, step), saved(plain, step), saved(plain, step - 1))
        assert (sharded / "checkpoints" / f"step-{step:06d}" / "dcp" / ".metadata").is_file()
    state = json.loads((sharded / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 3  # resumed on two Ray ranks


@pytest.mark.timeout(300)  # without the launcher's kill: gloo's 30-minute barrier timeout
def test_a_failing_rank_is_an_error_and_the_others_are_stopped(cluster, tmp_path):
    # the entries are defined here so that Ray pickles them by value (the ranks cannot import
    # this test module)
    def fail_on_rank_1() -> int:
        """Rank 1 raises once the group is up; rank 0 then waits in a barrier (for gloo's 30
        minutes, were it not killed)."""
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        (tmp_path / f"rank-{rank}.pid").write_text(str(os.getpid()))
        dist.init_process_group("gloo")
        if rank == 1:
            raise ZeroDivisionError("rank 1 breaks on purpose")
        dist.barrier()
        return 0

    def status_2_on_rank_0() -> int:
        """Rank 0 returns coderl's status for a one-line user error; rank 1 would run on."""
        if os.environ["RANK"] == "0":
            return 2
        time.sleep(3600)
        return 0

    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: ZeroDivisionError: rank 1"):
        run_ranks(2, fail_on_rank_1)
    pids = [int((tmp_path / f"rank-{r}.pid").read_text()) for r in (0, 1)]
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=30)  # rank 0 was in its barrier: killed
    assert not alive
    with pytest.raises(RankFailed, match=r"rank 0 of 2 exited with status 2"):
        run_ranks(2, status_2_on_rank_0)
    with pytest.raises(RankFailed, match=r"3 rank actors of 1 CPUs each were not all placed"):
        run_ranks(3, lambda: 0, start_timeout_s=5)  # 2 CPUs in this Ray


def test_rank_environment():
    nodes = [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("a", "10.0.0.1")]
    envs = rank_envs(nodes, 29500)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "1", "2"]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {
        ("3", "10.0.0.1", "29500")
    }


def _one_line_error(capsys, *overrides: str) -> str:
    toy = str(REPO / "configs" / "toy.yaml")
    assert main(["train", toy, *overrides, "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "CODERL_TRACEBACK" in err[1], err  # the error, then the hint
    return err[0]


def test_bad_launch_settings_are_one_line_errors(capsys, monkeypatch, tmp_path):
    # none of these starts Ray
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = f"run_dir={tmp_path / 'run'}"
    ray_on = [run, "trainer.distributed.enabled=true", "trainer.distributed.launcher=ray"]
    line = _one_line_error(capsys, *ray_on, "trainer.distributed.world_size=0")
    assert "trainer.distributed.world_size" in line and "must be at least 1" in line
    line = _one_line_error(capsys, *ray_on)
    assert "needs trainer.distributed.world_size=N" in line
    line = _one_line_error(capsys, run, "trainer.distributed.launcher=ray")
    assert "needs trainer.distributed.enabled=true" in line
    with_two = [*ray_on, "trainer.distributed.world_size=2"]
    port = _free_port()  # nothing listens there
    line = _one_line_error(capsys, *with_two, f"async.ray_address=127.0.0.1:{port}")
    assert f"async.ray_address='127.0.0.1:{port}': no Ray cluster reachable" in line
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    line = _one_line_error(capsys, *with_two)
    assert "needs Ray: pip install 'coderl[ray]'" in line
    assert not (tmp_path / "run").exists()
