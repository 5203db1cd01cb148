"""Trainer step and loop on the tiny random model and the in-process toy task."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from metrics_compare import assert_same_metrics

from coderl import algorithms as A
from coderl.config import AlgorithmConfig, load_config
from coderl.eval.audit import read_audit_records
from coderl.eval.observers import default_observers
from coderl.metrics import read_jsonl
from coderl.policy.batch import collate
from coderl.policy.loading import load_policy
from coderl.policy.local import LoraSpec
from coderl.train.batch import build_batch
from coderl.train.loop import setup_run, train, training_step
from coderl.train.step import accumulate_gradients, train_step
from coderl.trajectory import Segment

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false"]


def _segments(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    segs = []
    for i in range(n):
        ids = torch.randint(3, 100, (6 + i,), generator=g).tolist()
        seg = Segment()
        seg.append_context(ids[:3])
        seg.append_sampled(ids[3:], [-1.0 - 0.1 * j for j in range(len(ids) - 3)], 0)
        segs.append(seg)
    return segs


AGGREGATIONS = [
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]


def test_accumulated_gradient_does_not_depend_on_the_split():
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    batch = build_batch(
        _segments(), [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.0], policy.pad_token_id
    )
    for agg in AGGREGATIONS:
        cfg = AlgorithmConfig(loss_agg=agg, old_logp="behaviour")
        grads, losses = {}, {}
        for mbs in (8, 4, 2, 1):  # 1x8, 2x4, 4x2, 8x1
            policy.model.zero_grad()
            m = accumulate_gradients(
                policy.model, batch, cfg, micro_batch_size=mbs, temperature=1.0, max_len=20
            )
            grads[mbs] = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
            losses[mbs] = m["loss"]
        assert grads[8].abs().max() > 0
        # rtol 1e-5 of the gradient's scale: float32 sums in another order differ by ~1e-7 of
        # it, which an element-wise rtol on near-zero entries would call a failure
        scale = float(grads[8].abs().max())
        for mbs in (4, 2, 1):
            torch.testing.assert_close(grads[mbs], grads[8], rtol=1e-5, atol=1e-5 * scale, msg=agg)
            assert losses[mbs] == pytest.approx(losses[8], rel=1e-5), agg


def test_optimizer_steps_do_not_depend_on_segments_per_trajectory():
    # 2 segments or 8 (e.g. 2 episodes of 1 or of 4 context windows), one micro-batch per
    # segment: exactly one optimizer and scheduler step either way
    cfg = load_config(TOY, [*FAST, "trainer.micro_batch_size=1"])
    policy = load_policy("tiny-random")
    for n in (2, 8):
        opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        batch = build_batch(_segments(n), [1.0, -1.0] * (n // 2), policy.pad_token_id)
        m = train_step(
            policy.model, opt, sched, batch, cfg.algorithm, cfg.trainer, temperature=1.0, max_len=8
        )
        assert m["optimizer_steps"] == 1
        assert sched.last_epoch == 1
        assert opt.state[policy.trainable_parameters()[0]]["step"] == 1


@pytest.mark.parametrize("epochs", [1, 2, 4])
def test_the_gap_before_the_update_is_measured_before_the_first_epoch(epochs):
    # the behaviour logprobs are made up, so the gap is large; later epochs move the policy,
    # and a gap read after any of them would differ from the re-scored one
    cfg = load_config(TOY, [*FAST, f"trainer.update_epochs={epochs}", "trainer.lr=0.05"])
    policy = load_policy("tiny-random")
    batch = build_batch(_segments(4), [1.0, -1.0, 0.5, -0.5], policy.pad_token_id)
    with torch.no_grad():
        before = policy.forward(batch.tokens, 1.0).logprobs
    want = A.logprob_gap(before, batch.tokens.behavior_logprobs, batch.loss_mask)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    m = train_step(
        policy.model, opt, sched, batch, cfg.algorithm, cfg.trainer, temperature=1.0, max_len=8
    )
    assert m["optimizer_steps"] == epochs
    assert m["logprob_gap"] == pytest.approx(want["logprob_gap"], rel=1e-5)
    assert m["logprob_gap_max"] == pytest.approx(want["logprob_gap_max"], rel=1e-5)
    with torch.no_grad():
        after = policy.forward(batch.tokens, 1.0).logprobs
    assert (after - before).abs().max() > 1e-3  # the steps moved it


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage=grpo"],
        ["algorithm.advantage=dr_grpo", "algorithm.loss_agg=seq-mean-token-sum-norm"],
        ["algorithm.advantage=rloo", "algorithm.kl.coef=0.05", "model.lora=true"],
        ["algorithm.advantage=gae", "trainer.update_epochs=2", "rollout.group_size=2"],
        ["reward.terms={tests: 1.0, kl: 1.0}", "reward.kl_coef=0.01", "model.lora=true"],
    ],
    ids=["grpo", "dr_grpo", "rloo+kl-in-loss+lora", "ppo-gae", "kl-in-reward"],
)
def test_each_algorithm_completes_a_step_and_changes_parameters(overrides, tmp_path):
    cfg = load_config(TOY, [*FAST, f"run_dir={tmp_path}", *overrides])
    run = setup_run(cfg)
    before = [p.detach().clone() for p in run.policy.trainable_parameters()]
    m = training_step(run)
    after = run.policy.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert run.policy.version == 1 and run.step == 1
    assert m["optimizer_steps"] == cfg.trainer.update_epochs
    # kl is measured against reference logprobs, which the batch has only with kl.coef > 0:
    # absent otherwise, never a placeholder 0
    assert ("kl" in m) == (cfg.algorithm.kl.coef > 0), m.get("kl")
    # the ratio's metrics only where the ratio can differ from 1 (a second epoch), never a
    # placeholder 0 of a one-epoch on-policy step
    ratio = ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl")
    assert all((k in m) == (cfg.trainer.update_epochs > 1) for k in ratio), sorted(m)
    for key in (
        "loss",
        "entropy",
        "iw_mean",
        "logprob_gap",
        "grad_norm",
        "reward/mean",
        "advantage/std",
    ):
        assert key in m and m[key] == m[key], key  # present and not NaN
    if cfg.algorithm.advantage == "gae":
        assert m["value_loss"] > 0


def _class_mass(run):
    """Expected toy reward of the first sampled token: probability of the wanted class."""
    tasks = run.env.tasks("train")
    segs = []
    for t in tasks:
        s = Segment()
        s.append_context(t.prompt_ids)
        segs.append(s)
    b = collate(segs, run.policy.pad_token_id, pad_side="left")
    with torch.no_grad():
        out = run.policy.model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
        )
    p = out.logits[:, -1].float().softmax(-1)  # (tasks, V)
    ids = torch.arange(p.shape[-1])
    return float(
        sum(p[i, ids % t.modulus == t.residue].sum() for i, t in enumerate(tasks)) / len(tasks)
    )


def test_reward_goes_up_on_the_toy_task(tmp_path):
    cfg = load_config(TOY, [*FAST, f"run_dir={tmp_path}"])
    run = setup_run(cfg)
    before = _class_mass(run)  # ~0.25: a random policy hits the class 1 time in 4
    rewards = [training_step(run)["reward/mean"] for _ in range(5)]
    after = _class_mass(run)
    assert after > before + 0.02, (before, after, rewards)


def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path):
    common = [
        *FAST,
        "trainer.steps=4",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=5",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
    ]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    train(load_config(TOY, [*common, f"run_dir={ref_dir}"]), observers=default_observers())

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coderl",
            "train",
            str(TOY),
            *common,
            f"run_dir={cut_dir}",
            "--no-report",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # the reference ran in this process: the child uses its torch thread count (another
        # count sums in another order; at step 4 that moved grad_norm past rel 1e-4)
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    marker = cut_dir / "checkpoints" / "step-000002" / "state.json"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never reached its step-2 checkpoint"

    cut_cfg = load_config(TOY, [*common, f"run_dir={cut_dir}"])
    train(cut_cfg, resume=True, observers=default_observers())  # as coderl train registers
    ref, cut = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(cut_dir / "metrics.jsonl")
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    assert_same_metrics(ref, cut)
    sa = json.loads((ref_dir / "checkpoints" / "step-000004" / "state.json").read_text())
    sb = json.loads((cut_dir / "checkpoints" / "step-000004" / "state.json").read_text())
    assert sa == sb  # same step, data cursor (task order) and policy version
    # the audit records the killed run wrote after its checkpoint were cut, not duplicated
    audit = [read_audit_records(d) for d in (ref_dir, cut_dir)]
    assert [r["step"] for r in audit[1]] == [1, 1, 2, 2, 3, 3, 4, 4] and audit[0] == audit[1]
    oa = torch.load(ref_dir / "checkpoints" / "step-000004" / "optimizer.pt")
    ob = torch.load(cut_dir / "checkpoints" / "step-000004" / "optimizer.pt")
    assert [s["step"] for s in oa["state"].values()] == [s["step"] for s in ob["state"].values()]
    assert all(float(s["step"]) == 4 for s in ob["state"].values())


def test_demo_sets_a_previous_run_aside(tmp_path):
    from coderl.cli.demo import set_aside

    run_dir = tmp_path / "default"
    assert set_aside(run_dir) is None
    for n, name in ((1, "default.prev"), (2, "default.prev2"), (3, "default.prev3")):
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "eval.jsonl").write_text(f"run {n}\n")
        assert set_aside(run_dir) == tmp_path / name
        assert not run_dir.exists()
    for n, name in ((1, "default.prev"), (2, "default.prev2"), (3, "default.prev3")):
        assert (tmp_path / name / "eval.jsonl").read_text() == f"run {n}\n"  # none deleted


def test_with_an_sft_warm_start_the_model_before_it_is_evaluated_too(tmp_path):
    # The demo's "before" must be the model before the whole recipe, not only before RL: with
    # SFT weights in RUN_DIR/sft/, eval.jsonl holds the base model's eval, then the warm start's
    # (loaded in between), then the last step's.
    from safetensors.torch import save_file

    from coderl.train.checkpoint import trainable_state

    over = ["progress=false", "tensorboard=false", "trainer.steps=1"]
    cfg = load_config(TOY, [f"run_dir={tmp_path / 'run'}", "sft.enabled=true", *over])
    run = setup_run(cfg, load_sft=False)
    warm = {k: torch.zeros_like(v) for k, v in trainable_state(run.policy.model).items()}
    (tmp_path / "run" / "sft").mkdir(parents=True)
    save_file(warm, str(tmp_path / "run" / "sft" / "trainable.safetensors"))
    evals = read_jsonl(train(cfg) / "eval.jsonl")
    assert [e.get("phase") for e in evals] == ["base", "sft", None]
    assert [e["step"] for e in evals] == [0, 0, 1]
    # the all-zero warm start was loaded in between: both evaluations draw with the same seeds,
    # so only the weights can make their outcomes differ (all-zero weights sample uniformly)
    assert evals[0]["per_task"] != evals[1]["per_task"]


def test_a_shared_system_prompt_runs_once_and_changes_nothing(monkeypatch):
    # 4 rows share 30 context tokens (a system prompt): the forward runs them once and broadcasts
    # their keys/values; logprobs and LoRA gradients equal the plain forward's up to float order.
    from coderl.policy import forward as fwd

    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 100, (30,), generator=g).tolist()
    segs = []
    for i in range(4):
        ids = torch.randint(3, 100, (5 + 3 * i,), generator=g).tolist()
        seg = Segment()
        seg.append_context(system + ids[:2])
        seg.append_sampled(ids[2:], [-1.0] * (len(ids) - 2), 0)
        segs.append(seg)
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    batch = build_batch(segs, [1.0, -1.0, 0.5, 2.0], policy.pad_token_id)

    # 30 shared tokens, the last of them recomputed per row (it predicts nothing trainable here,
    # but the rule keeps every trainable token's predictor out of the shared part)
    def shared(tokens):
        return fwd._shared_context(tokens, tokens.loss_mask[:, 1:] > 0)

    assert shared(batch.tokens) == 29
    assert shared(build_batch(segs[:1], [1.0], policy.pad_token_id).tokens) == 0
    results = []
    for threshold in (16, 10**9):  # shared, then plain
        monkeypatch.setattr(fwd, "MIN_SHARED_CONTEXT", threshold)
        policy.model.zero_grad()
        out = fwd.forward(policy.model, batch.tokens, temperature=0.7)
        weights = torch.arange(out.logp.numel(), dtype=torch.float32).view_as(out.logp)
        (out.logp * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
        results.append((out.logp.detach(), grads))
    (lp_shared, g_shared), (lp_plain, g_plain) = results
    assert (lp_plain != 0).sum() == batch.loss_mask.sum()
    torch.testing.assert_close(lp_shared, lp_plain, rtol=1e-5, atol=1e-5)
    scale = float(g_plain.abs().max())
    torch.testing.assert_close(g_shared, g_plain, rtol=1e-5, atol=1e-5 * scale)


def _grads(policy):
    return torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])


def _rejecting_batch(policy):
    """3 rows (3, 4, 5 sampled tokens) whose behaviour logprobs equal the trainer's, so every
    importance weight is exp(0) = 1, except: row 0's second sampled token has weight 5 (above
    the cap 2) and every token of row 2 weight 0.1 (below the low 0.5): 6 of 12 rejected."""
    from coderl.policy.forward import forward

    batch = build_batch(_segments(3), [1.0, -1.0, 0.5], policy.pad_token_id)
    t = batch.tokens
    with torch.no_grad():
        lp = forward(policy.model, t, temperature=1.0).logp  # (3, T)
    t.behavior_logprobs.copy_(lp)
    t.behavior_logprobs[0, 4] -= math.log(5.0)  # w = exp(lp - (lp - log 5)) = 5
    t.behavior_logprobs[2] -= math.log(0.1) * t.loss_mask[2]  # w = 0.1
    rejected = torch.zeros_like(t.loss_mask)
    rejected[0, 4] = 1
    rejected[2] = t.loss_mask[2]
    return batch, rejected


MASKED_IS = {"mode": "mask", "cap": 2.0, "low": 0.5}


def test_masked_importance_sampling_worked_example():
    # kept: row 0 two tokens (A = 1), row 1 four tokens (A = -1), row 2 none; ratio 1, weight 1:
    # token-mean pg = (2 * -1 + 4 * +1) / 6 = 0.3333. Counting the 6 rejected tokens in the
    # denominator (the bug) gives (-2 + 4) / 12 = 0.1667.
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    batch, _ = _rejecting_batch(policy)
    cfg = AlgorithmConfig(old_logp="trainer", importance=MASKED_IS)
    m = accumulate_gradients(
        policy.model, batch, cfg, micro_batch_size=3, temperature=1.0, max_len=20
    )
    assert m["pg_loss"] == pytest.approx(1 / 3, rel=1e-5)
    assert m["iw_rejected_frac"] == pytest.approx(0.5)
    assert m["iw_mean"] == pytest.approx(1.0) and m["iw_max"] == pytest.approx(1.0)
    # the gap is over every sampled token: |log 5| once, |log 0.1| five times, 0 six times
    assert m["logprob_gap"] == pytest.approx((math.log(5) + 5 * math.log(10)) / 12, rel=1e-5)
    assert m["logprob_gap_max"] == pytest.approx(math.log(10), rel=1e-5)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_masked_importance_sampling_equals_training_without_the_rejected_tokens(agg):
    # rejection = the tokens were never in the loss: same gradient as the batch with their loss
    # mask set to 0 and no weights (the kept weights are exactly 1), for any micro-batch split
    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    batch, rejected = _rejecting_batch(policy)
    plain = build_batch(_segments(3), [1.0, -1.0, 0.5], policy.pad_token_id)
    plain.tokens.loss_mask.mul_(1 - rejected)
    plain.tokens.behavior_logprobs.copy_(batch.tokens.behavior_logprobs * plain.loss_mask)
    masked_cfg = AlgorithmConfig(old_logp="trainer", loss_agg=agg, importance=MASKED_IS)
    off_cfg = AlgorithmConfig(old_logp="trainer", loss_agg=agg, importance={"mode": "off"})
    results = {}
    for name, b, cfg, mbs in [
        ("plain", plain, off_cfg, 3),
        ("masked", batch, masked_cfg, 3),
        ("masked, 1 row per micro-batch", batch, masked_cfg, 1),
    ]:
        policy.model.zero_grad()
        m = accumulate_gradients(
            policy.model, b, cfg, micro_batch_size=mbs, temperature=1.0, max_len=20
        )
        results[name] = (_grads(policy), m["loss"])
    g_ref, loss_ref = results["plain"]
    assert g_ref.abs().max() > 0
    scale = float(g_ref.abs().max())
    for name in ("masked", "masked, 1 row per micro-batch"):
        g, loss = results[name]
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5 * scale, msg=name)
        assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-6), name


def test_the_trainer_kl_term_is_the_loss_estimator_k2():
    # with zero advantages the step's gradient is the KL term's alone: it must be the gradient
    # of the token-mean of k2 = 0.5 (logp - ref)^2, not of k3 (see test_algorithms for why)
    from coderl.algorithms import aggregate, kl_penalty
    from coderl.policy.forward import forward

    policy = load_policy("tiny-random", lora=LoraSpec(rank=4))
    batch = build_batch(_segments(4), [0.0] * 4, policy.pad_token_id)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        lp = forward(policy.model, batch.tokens, temperature=1.0).logp
    noise = torch.randn(lp.shape, generator=g)
    batch.ref_logp = (lp - 0.5 * noise.abs()) * batch.loss_mask  # a reference unlike the policy
    cfg = AlgorithmConfig(old_logp="behaviour", kl={"coef": 1.0})
    policy.model.zero_grad()
    m = accumulate_gradients(
        policy.model, batch, cfg, micro_batch_size=2, temperature=1.0, max_len=20
    )
    g_step = _grads(policy)
    expected = {}
    for kind in ("k2", "k3"):
        policy.model.zero_grad()
        out = forward(policy.model, batch.tokens, temperature=1.0)
        kl = aggregate(kl_penalty(out.logp, batch.ref_logp, kind), batch.loss_mask, "token-mean")
        kl.backward()
        expected[kind] = (_grads(policy), kl.item())
    scale = float(expected["k2"][0].abs().max())
    torch.testing.assert_close(g_step, expected["k2"][0], rtol=1e-5, atol=1e-5 * scale)
    assert m["kl"] == pytest.approx(expected["k2"][1], rel=1e-5)
    assert (g_step - expected["k3"][0]).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("reason", ["abort", "tool_calls", "", None])
def test_toy_environment_refuses_unknown_finish_reasons(reason):
    from coderl.envs.toy import ToyEnvironment
    from coderl.policy.base import Completion, SamplingParams

    class Engine:
        version = 0

        def generate(self, prompts, params):
            return [Completion([5, 6], [-1.0, -1.0], reason, 0) for _ in prompts]

    env = ToyEnvironment()
    with pytest.raises(ValueError, match="unknown finish_reason"):
        env.rollout(Engine(), env.tasks("train")[:1], SamplingParams(), 2)
