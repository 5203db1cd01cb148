"""SFT warm start: oracle episodes rendered by the real harness, NLL goes down."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from coderl.config import load_config
from coderl.envs import build_environment
from coderl.train.batch import build_batch
from coderl.train.optim import build_optimizer
from coderl.train.run import build_policy
from coderl.train.sft import nll_step, oracle_segments

DEFAULT = Path(__file__).parent.parent / "configs" / "default.yaml"


def test_oracle_episodes_show_the_gold_solution_and_sft_lowers_nll(tmp_path):
    cfg = load_config(DEFAULT, [f"run_dir={tmp_path}", "model.name=tiny-random", "sft.lr=0.003"])
    policy = build_policy(cfg)
    tasks = build_environment(cfg).tasks("train")[:1]
    assert all(t.split == "train" for t in tasks)  # never the held-out split
    segs = oracle_segments(cfg, policy, tasks)
    assert len(segs) == 1
    for seg, task in zip(segs, tasks, strict=True):
        sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
        text = policy.tokenizer.decode(sampled)
        assert "write_file" in text and "submit" in text
        assert task.extra["entry_point"] in text
    batch = build_batch(segs, [1.0], policy.pad_token_id)
    tcfg = cfg.trainer.model_copy(update={"lr": cfg.sft.lr})
    optimizer, _ = build_optimizer([{"params": policy.trainable_parameters()}], tcfg)
    losses = [nll_step(policy, batch, optimizer, micro=1) for _ in range(3)]
    assert losses[-1] < losses[0], losses


class _Recorder(torch.optim.SGD):
    """SGD at lr 0 that keeps the gradient it was stepped with (nll_step zeroes it after)."""

    def step(self, closure=None):  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.seen = torch.cat([p.grad.flatten().clone() for p in params])
        return super().step(closure)


def test_bf16_sft_is_mixed_precision_close_to_the_fp32_step(tmp_path):
    cfg = load_config(DEFAULT, [f"run_dir={tmp_path}", "model.name=tiny-random"])
    grads, losses = {}, {}
    for bf16 in (False, True):
        policy = build_policy(cfg)
        tasks = build_environment(cfg).tasks("train")[:2]
        batch = build_batch(oracle_segments(cfg, policy, tasks), [1.0, 1.0], policy.pad_token_id)
        params = policy.trainable_parameters()
        optimizer = _Recorder(params, lr=0.0)
        losses[bf16] = nll_step(policy, batch, optimizer, micro=1, bf16=bf16)
        assert all(p.dtype == torch.float32 for p in params)  # the weights stay fp32
        grads[bf16] = optimizer.seen
    assert grads[False].abs().sum() > 0
    assert not torch.equal(grads[False], grads[True])  # autocast did run in bf16
    cos = torch.nn.functional.cosine_similarity(grads[False], grads[True], dim=0)
    assert cos > 0.95, cos
    assert abs(losses[True] - losses[False]) < 0.05 * losses[False]


def test_packed_checkpointed_sft_step_has_the_padded_steps_gradient(tmp_path):
    """The trainer's levers in SFT: micro-batches cut by a token budget and packed, with
    activation checkpointing, give the padded row micro-batches' loss and gradient."""
    cfg = load_config(DEFAULT, [f"run_dir={tmp_path}", "model.name=tiny-random"])
    grads, losses = [], []
    for kw in ({}, {"max_tokens": 1, "checkpoint": True}, {"max_tokens": 10_000}):
        torch.manual_seed(0)
        policy = build_policy(cfg)
        tasks = build_environment(cfg).tasks("train")[:3]
        segs = oracle_segments(cfg, policy, tasks)
        batch = build_batch(segs, [1.0] * len(segs), policy.pad_token_id)
        assert len(set(int(n) for n in batch.tokens.attention_mask.sum(-1))) > 1  # padding
        optimizer = _Recorder(policy.trainable_parameters(), lr=0.0)
        losses.append(nll_step(policy, batch, optimizer, micro=2, **kw))
        grads.append(optimizer.seen)
    assert grads[0].abs().sum() > 0
    for g, loss in zip(grads[1:], losses[1:], strict=True):
        torch.testing.assert_close(g, grads[0], rtol=1e-4, atol=1e-6)
        assert loss == pytest.approx(losses[0], rel=1e-5)


DEMO_REPO = Path(__file__).parent.parent / "configs" / "demo-repo.yaml"


@pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
def test_repo_oracle_episodes_are_multi_turn_summarise_and_sft_lowers_nll(tmp_path):
    """`coderl sft` on the repository preset: oracle episodes of a training repository, through
    the harness, one segment per context window; the summary the expert writes when the window
    is full is trained like its tool calls."""
    from coderl.envbuild.build import build_env
    from coderl.tasks.repos import repo_of as repository
    from coderl.tasks.spec import dump_tasks, load_tasks

    tasks = load_tasks(Path(__file__).parent.parent / "data" / "tasks" / "toolz.jsonl.gz")
    task = min(tasks, key=lambda t: len(t.problem_statement))
    build_env(task.source.removeprefix("pypi:"))
    dump_tasks([task], tmp_path / "one.jsonl")
    cfg = load_config(
        DEMO_REPO,
        [
            f"run_dir={tmp_path}",
            "model.name=tiny-random",
            "sft.lr=0.003",
            f"tasks.options.tasks_file={tmp_path / 'one.jsonl'}",
            # the tiny tokenizer spends ~3 tokens per word: a window that holds the opening
            # and a few turns, not the code the expert reads as well (the whole episode is
            # ~3,100 tokens: with 1,024-token turns 4096 never fills, 3584 summarises twice)
            "rollout.max_context_tokens=3584",
            "rollout.max_new_tokens=1024",
        ],
    )
    policy = build_policy(cfg)
    train = build_environment(cfg).tasks(cfg.tasks.train_split)
    assert [t.id for t in train] == [task.id] and repository(task) == "toolz"
    segs = oracle_segments(cfg, policy, train)
    assert len(segs) >= 2  # the expert summarised at least once
    texts = [
        policy.tokenizer.decode([t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m])
        for s in segs
    ]
    assert "Progress so far:" in texts[0] and "<function=search>" in texts[0]
    assert "<function=submit>" in texts[-1] and "<function=edit>" in "".join(texts)
    batch = build_batch(segs, [1.0] * len(segs), policy.pad_token_id)
    tcfg = cfg.trainer.model_copy(update={"lr": cfg.sft.lr})
    optimizer, _ = build_optimizer([{"params": policy.trainable_parameters()}], tcfg)
    losses = [nll_step(policy, batch, optimizer, micro=1) for _ in range(3)]
    assert losses[-1] < losses[0], losses
