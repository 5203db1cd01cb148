"""SFT warm start: oracle episodes rendered by the real harness, NLL goes down."""

from pathlib import Path

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
