"""The sharded trainer (FSDP2, gloo, CPU) against one process: two ranks give the loss, the
reduced gradients and the updated weights of one process on the same global batch; its DCP
checkpoints resume exactly, also across a change of world size (2 -> 1, 1 -> 2).

Every outcome comes from one module fixture: the plain steps and the one-rank runs in this
process, the two-rank runs in one spawn of two processes (tests/distributed_cases.py), so the
process start-up (~10 s of imports each) is paid once.

Tolerance: fp32 sums in another order (the ranks' partial gradients added by the
reduce-scatter, the batch normaliser summed over ranks) differ by ~1e-7 of a gradient's scale;
gradients are compared entry by entry to 1e-5 of the largest one, the weights' move in the
AdamW step to 1e-3 of its norm (see :func:`_assert_same_update`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_cases import (
    CASES,
    RESUME_CASE,
    SFT_FILE,
    Trainer,
    resume_outcome,
    setup,
    sft_outcome,
    step_case,
    two_rank_worker,
    write_sft_weights,
)
from safetensors.torch import load_file

from coderl.metrics import read_jsonl
from coderl.train.export import export_run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _one_rank() -> Iterator[None]:
    """This process as the only rank of a gloo group (what torchrun --nproc-per-node 1 sets)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_free_port())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("distributed")
    res: dict[str, Any] = {"plain": {c: step_case(c, shard=False) for c in CASES}}
    res["sft_file"] = write_sft_weights(out / SFT_FILE)
    with _one_rank():  # one rank: step 1, checkpoint w1, the uninterrupted step 2
        t = Trainer()
        t.train()
        t.save(out / "w1")
        res["one_rank"] = resume_outcome(t)
        res["one_rank_sft"] = sft_outcome(out / SFT_FILE)
    ctx = mp.get_context("spawn")
    port = _free_port()
    ranks = [ctx.Process(target=two_rank_worker, args=(r, port, str(out))) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0, 0], "a rank failed (its traceback is above)"
    res["two"] = torch.load(out / "two_ranks.pt", weights_only=False)
    with _one_rank():  # the two-rank checkpoint read back by one rank
        t = Trainer()
        t.load(out / "w2")
        res["from_two_ranks"] = resume_outcome(t)
    res["dir"] = out
    return res


def _assert_close_by_name(got: dict, want: dict, what: str) -> None:
    """Entry by entry, within 1e-5 of the largest entry (gradients: this is what tests the
    reduction; a mean of per-rank means instead of the global token-mean moves them by the
    ranks' token shares)."""
    assert sorted(got) == sorted(want), what
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0, what
    for n in want:
        torch.testing.assert_close(
            got[n], want[n], rtol=1e-5, atol=1e-5 * scale,
            msg=lambda m, n=n: f"{what} {n}: {m}",
        )  # fmt: skip


def _assert_same_update(got: dict, want: dict, before: dict) -> None:
    """The weights after the step: their move from ``before`` within 1e-3 of the move's norm.
    Not entry by entry: AdamW's first step moves an entry by ``lr * g / (|g| + eps)``, which
    for a gradient of the order of eps amplifies its float error (seen: 7e-4 on one entry of
    a million, 7% of that step)."""
    assert sorted(got) == sorted(want) == sorted(before)
    moved = torch.cat([(want[n] - before[n]).flatten() for n in want])
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want])
    assert float(moved.norm()) > 0
    assert float(diff.norm()) <= 1e-3 * float(moved.norm())


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_single_process_step(outcomes, case):
    plain, two = outcomes["plain"][case], outcomes["two"][case]
    for k in ("loss", "pg_loss", "kl", "value_loss", "grad_norm", "clip_frac_high"):
        assert (k in two["metrics"]) == (k in plain["metrics"]), k  # kl, value_loss: if measured
        if k in plain["metrics"]:
            assert two["metrics"][k] == pytest.approx(plain["metrics"][k], rel=1e-5, abs=1e-7), k
    assert two["metrics"]["sequences"] == plain["metrics"]["sequences"]
    assert two["metrics"]["trained_tokens"] == plain["metrics"]["trained_tokens"]
    _assert_close_by_name(two["grads"], plain["grads"], "gradient")
    _assert_same_update(two["weights"], plain["weights"], plain["before"])
    _assert_close_by_name(two["before"], plain["before"], "weights before the step")


def test_the_cases_test_what_they_name(outcomes):
    plain = outcomes["plain"]
    assert plain["lora-kl"]["metrics"]["kl"] > 0 and plain["full-kl"]["metrics"]["kl"] > 0
    assert plain["ppo"]["metrics"]["value_loss"] > 0
    assert "kl" not in plain["ppo"]["metrics"] and "value_loss" not in plain["lora-kl"]["metrics"]
    assert any(n.startswith("value_head.") for n in plain["ppo"]["grads"])
    assert any("lora_A" in n for n in plain["lora-kl"]["grads"])
    assert not any("lora" in n for n in plain["full-kl"]["grads"])


def _assert_same_outcome(got: dict, want: dict, *, exact: bool) -> None:
    """The resumed run's step 2 against the uninterrupted one's: exactly (same world size) or
    to float-order tolerance (another world size; the weights entry by entry within 1e-5 of
    the largest weight)."""
    assert got["step"] == want["step"] == 1
    assert got["sched"] == want["sched"]
    assert torch.equal(got["rng"], want["rng"])
    if exact:
        for n, w in want["weights"].items():
            assert torch.equal(got["weights"][n], w), n
    else:
        _assert_close_by_name(got["weights"], want["weights"], "weights after the resumed step")


def test_a_sharded_checkpoint_resumes_exactly(outcomes):
    two = outcomes["two"]
    _assert_same_outcome(two["resumed"], two["uninterrupted"], exact=True)
    ckpt = outcomes["dir"] / "w2" / "checkpoints" / "step-000001"
    assert (ckpt / "dcp" / ".metadata").is_file()
    assert (ckpt / "trainable.safetensors").is_file() and (
        ckpt / "value_head.safetensors"
    ).is_file()


def test_a_two_rank_checkpoint_resumes_on_one_rank(outcomes):
    _assert_same_outcome(outcomes["from_two_ranks"], outcomes["two"]["uninterrupted"], exact=False)


def test_a_one_rank_checkpoint_resumes_on_two_ranks(outcomes):
    _assert_same_outcome(outcomes["two"]["from_one_rank"], outcomes["one_rank"], exact=False)


def test_resuming_without_the_optimizer_state_would_differ(outcomes):
    # the resume tests can fail: a run restarted from the weights alone (fresh AdamW moments)
    # ends its next step visibly elsewhere
    with _one_rank():
        t = Trainer()
        t.load(outcomes["dir"] / "w1")
        fresh = Trainer()
        fresh.step = t.step
        for p_fresh, p in zip(fresh.root.parameters(), t.root.parameters(), strict=True):
            with torch.no_grad():
                p_fresh.copy_(p)
        t.train()
        fresh.train()
        gap = max(float((fresh.weights()[n] - w).abs().max()) for n, w in t.weights().items())
    assert gap > 1e-4


REPO = Path(__file__).resolve().parent.parent
TOY = ["configs/toy.yaml", "progress=false", "tensorboard=false", "eval.before_after=false"]


def _coderl(args: list[str], nproc: int | None) -> None:
    """``coderl ARGS`` in a subprocess, under ``torchrun --nproc-per-node nproc`` if given."""
    # --standalone: a free rendezvous port, not torchrun's fixed 29500 (another test file's
    # torchrun may be running beside this one under xdist)
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *launch, "-m", "coderl", *args, "--no-report"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=240)


def _same_metrics(got: list[dict], want: list[dict]) -> None:
    """Step by step: the same rollouts (rewards exactly), the trainer's loss and gradient norm
    to float order (sums over ranks in another order: ~1e-7 relative seen)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g["reward/mean"] == w["reward/mean"], g["step"]
        for k in ("loss", "grad_norm", "trained_tokens"):
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k)


def assert_same_metrics(run: Path, plain: Path, *, steps: int) -> None:
    """``run``'s steps 1..steps against ``plain``'s, as :func:`_same_metrics` compares them."""
    got, want = (read_jsonl(d / "metrics.jsonl") for d in (run, plain))
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    _same_metrics(got, want)


def _episodes_this_rank(run_dir: Path) -> list[float]:
    return [r["dist/episodes_this_rank"] for r in read_jsonl(run_dir / "metrics.jsonl")]


SPLIT = [  # 3 tasks x G=8 per step: the ranks take 2 and 1 groups (16 and 8 episodes);
    # 6 held-out tasks in batches of 2 (8 episodes // 4 samples): the ranks evaluate 2 and 1
    "tasks.tasks_per_step=3", "trainer.checkpoint_every=1", "trainer.distributed.enabled=true",
    "eval.before_after=true", "eval.every=2", "eval.tasks=6", "eval.batch_episodes=8",
]  # fmt: skip


def test_split_rollouts_on_two_ranks_equal_one_process_and_resume_on_one_rank(tmp_path):
    # two ranks, each rolling out and grading its share of the groups (and of the held-out
    # batches), against one rank (one process) rolling out every group, three steps; the
    # two-rank run stops after step 2 and resumes on one rank for step 3
    two, one = tmp_path / "two", tmp_path / "one"
    _coderl(["train", *TOY, *SPLIT, "trainer.steps=2", f"run_dir={two}"], nproc=2)
    assert (two / "checkpoints" / "step-000002" / "dcp" / ".metadata").is_file()
    # a sharded checkpoint exports in one process: its gathered weights, checked by the export
    manifest = export_run(two / "checkpoints" / "step-000002", tmp_path / "hf")
    assert manifest["step"] == 2 and manifest["checks"]["model"]["max_logprob_gap"] <= 1e-4
    _coderl(["train", "--resume", str(two), "trainer.steps=3"], nproc=1)
    _coderl(["train", *TOY, *SPLIT, "trainer.steps=3", f"run_dir={one}"], nproc=1)
    _same_metrics(read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl"))
    assert _episodes_this_rank(two) == [16, 16, 24]  # rank 0 (step 3: the resumed one rank)
    assert _episodes_this_rank(two / "ranks" / "rank-1") == [8, 8]
    assert _episodes_this_rank(one) == [24, 24, 24]
    evals = [read_jsonl(d / "eval.jsonl") for d in (two, one)]
    assert [e["step"] for e in evals[0]] == [e["step"] for e in evals[1]] == [0, 2, 3]
    for got, want in zip(*evals, strict=True):
        assert len(got["per_task"]) == 6
        assert got["per_task"] == want["per_task"] and got["pass_at"] == want["pass_at"]
    # the weights after steps 2 and 3: within 2.5e-4 (lr 5e-3: 5% of one AdamW move; float
    # order, amplified by AdamW where a gradient is of the order of its eps: seen 4.8e-5 with
    # the old tiny tokenizer, 1.02e-4 on one of 62,848 embedding entries with the Qwen2 one);
    # the losses and gradient norms above are the tight check (rel 1e-4)
    for step in ("step-000002", "step-000003"):
        got, want = (
            load_file(d / "checkpoints" / step / "trainable.safetensors") for d in (two, one)
        )
        assert sorted(got) == sorted(want)
        for n, w in want.items():
            torch.testing.assert_close(
                got[n], w, rtol=0, atol=2.5e-4, msg=lambda m, n=n: f"{n}: {m}"
            )
    state = json.loads((two / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["world_size"] == 1 and state["step"] == 3


def test_replicated_rollouts_on_two_ranks_equal_one_plain_process(tmp_path):
    # trainer.distributed.split_rollouts=false: every rank rolls out the whole step, the very
    # batch of one plain process (one rollout call per round, not one per group)
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    dist_on = ["trainer.distributed.enabled=true", "trainer.distributed.split_rollouts=false"]
    _coderl(["train", *TOY, "trainer.steps=2", f"run_dir={sharded}", *dist_on], nproc=2)
    _coderl(["train", *TOY, "trainer.steps=2", f"run_dir={plain}"], nproc=None)
    got = read_jsonl(sharded / "metrics.jsonl")
    _same_metrics(got, read_jsonl(plain / "metrics.jsonl"))
    assert not any("dist/episodes_this_rank" in r for r in got)
    assert (sharded / "checkpoints" / "step-000002" / "dcp" / ".metadata").is_file()


@pytest.mark.parametrize("where", ["one_rank", "two"])
def test_an_sft_warm_start_loads_into_the_shards(outcomes, where):
    # the whole tensors of a warm start's trainable.safetensors, loaded into a sharded policy
    # (each rank keeps its shard) and gathered back: exactly the file's values
    got = outcomes["one_rank_sft"] if where == "one_rank" else outcomes["two"]["sft"]
    want = {f"model.{n}": t for n, t in outcomes["sft_file"].items()}
    assert sorted(got) == sorted(want)
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_a_warm_start_that_does_not_match_the_model_is_refused():
    from coderl.train.distributed import load_full_trainable

    with _one_rank():
        t = Trainer()
        good = {
            n.removeprefix("model."): w for n, w in t.weights().items() if n.startswith("model.")
        }
        name = sorted(good)[0]
        with pytest.raises(ValueError, match="missing"):
            load_full_trainable(t.root, {n: w for n, w in good.items() if n != name})
        with pytest.raises(ValueError, match="checkpoint shape"):
            load_full_trainable(t.root, {**good, name: torch.zeros(3)})


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_zero_runs_the_sft_warm_start(monkeypatch, tmp_path, rank):
    # a sharded `coderl train` with sft.enabled: rank 0 runs SFT alone, the others go straight
    # to joining the process group (where they wait for rank 0) and load its weights there
    import coderl.train.loop
    import coderl.train.warmstart
    from coderl.cli import main

    ran: list[str] = []
    monkeypatch.setenv("RANK", rank)
    # the warm start itself (its demonstration check refuses the toy source, which has none)
    monkeypatch.setattr(coderl.train.warmstart, "warm_start", lambda cfg: ran.append("sft"))
    monkeypatch.setattr(coderl.train.loop, "train", lambda cfg, **kw: Path(cfg.run_dir))
    args = ["train", "configs/toy.yaml", "sft.enabled=true", f"run_dir={tmp_path / 'run'}"]
    assert main([*args, "--no-report"]) == 0
    assert ran == (["sft"] if rank == "0" else [])


def test_ranks_that_disagree_stop(outcomes):
    assert outcomes["two"]["disagree"] == "ranks disagree on the rank: rank 1 differs from rank 0"


def test_the_sharded_device_check_runs_on_cpu(tmp_path):
    # bench/device_check.py --sharded 2 on a CPU: two gloo ranks, two steps, a DCP checkpoint
    # and a split held-out evaluation, every tensor (each rank's shards) on the CPU
    cmd = [sys.executable, "bench/device_check.py", "--sharded=2", "--device=cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*cmd, f"--run-dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ran on: gloo, world size 2: cpu (CPU), cpu (CPU)" in out.stdout
    assert out.stdout.count("every tensor on cpu") == 2
    assert out.stdout.count("episodes this rank 8") == 4  # 2 tasks x G=8: a group per rank
    assert (tmp_path / "checkpoints" / "step-000002" / "dcp" / ".metadata").is_file()


def test_a_plain_resume_of_a_sharded_checkpoint_says_how(outcomes):
    from coderl.train.checkpoint import latest_checkpoint, load_checkpoint

    policy = setup(RESUME_CASE)[0]  # no process group: the plain, single-process path
    opt = torch.optim.AdamW(policy.trainable_parameters())
    with pytest.raises(ValueError, match="trainer.distributed.enabled=true under torchrun"):
        load_checkpoint(
            latest_checkpoint(outcomes["dir"] / "w2"), model=policy.model, optimizer=opt
        )
    state = load_checkpoint(latest_checkpoint(outcomes["dir"] / "w2"), model=policy.model)
    assert state["world_size"] == 2  # the gathered weights load without the optimizer
