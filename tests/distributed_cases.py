"""Cases of tests/test_distributed.py: one trainer step (or two) on the tiny random model, run
by one plain process, by one rank and by two ranks (gloo, spawned), whose outcomes the tests
compare. Importable by a spawned rank (only the worker's imports)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from coderl.config import AlgorithmConfig, DistributedConfig, TrainerConfig
from coderl.policy.loading import load_policy
from coderl.policy.local import LocalPolicy, LoraSpec
from coderl.train.batch import StepBatch, build_batch
from coderl.train.optim import build_optimizer
from coderl.train.step import train_step
from coderl.trajectory import Segment

CASES = ("lora-kl", "full-kl", "ppo", "lora-packed")
"""LoRA with the KL term (reference = adapter off), full fine-tuning with the KL term
(reference = a frozen copy), PPO with the value head and two update epochs, and LoRA with
token-budget packing (ranks run different micro-batch counts)."""
ROWS = 7  # odd: the ranks get 4 and 3 rows, and (3 rows per micro-batch) 2 and 1 micro-batches


def _segments(n: int, seed: int) -> list[Segment]:
    g = torch.Generator().manual_seed(seed)
    segs = []
    for i in range(n):
        ids = torch.randint(3, 100, (6 + 2 * i,), generator=g).tolist()
        seg = Segment()
        seg.append_context(ids[:3])
        seg.append_sampled(ids[3:], [-1.0 - 0.1 * j for j in range(len(ids) - 3)], 0)
        segs.append(seg)
    return segs


def setup(case: str) -> tuple[LocalPolicy, nn.Module | None, AlgorithmConfig, TrainerConfig]:
    """The policy, value head (PPO) and configs of ``case``, the same in every process."""
    torch.manual_seed(0)
    lora = None if case.startswith("full") else LoraSpec(rank=4)
    policy = load_policy("tiny-random", lora=lora)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the policy off its reference (LoRA B starts at 0): KL > 0
        for p in policy.trainable_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    head = None
    if case == "ppo":
        torch.manual_seed(0)
        head = nn.Linear(policy.model.config.hidden_size, 1)
    kl = {"coef": 0.1} if case.endswith("kl") else {}
    alg = AlgorithmConfig(advantage="gae" if head else "grpo", kl=kl)
    trainer = TrainerConfig(
        lr=1e-2,
        micro_batch_size=3,
        update_epochs=2 if case == "ppo" else 1,
        max_tokens_per_micro_batch=30 if case == "lora-packed" else None,
    )
    return policy, head, alg, trainer


def batch(policy: LocalPolicy, case: str, seed: int = 1) -> StepBatch:
    """``ROWS`` rows of made-up rollouts (no reference logprobs yet: see :func:`with_reference`);
    PPO: per-token advantages, value targets and old values."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(ROWS, generator=g).tolist()
    b = build_batch(_segments(ROWS, seed), adv, policy.pad_token_id)
    if case == "ppo":
        shape = b.tokens.input_ids.shape
        b.advantages = torch.randn(shape, generator=g) * b.tokens.loss_mask
        b.returns = torch.randn(shape, generator=g)
        b.old_values = torch.randn(shape, generator=g) * 0.1
    return b


def with_reference(policy: LocalPolicy, b: StepBatch, case: str) -> StepBatch:
    if case.endswith("kl"):
        with torch.no_grad():
            b.ref_logp = policy.reference_logprobs(b.tokens)
    return b


def _optimizer(
    policy: LocalPolicy, head: nn.Module | None, alg: AlgorithmConfig, trainer: TrainerConfig
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer groups of :func:`coderl.train.run.setup_run` (after sharding, the
    parameters are the sharded ones)."""
    groups: list[dict[str, Any]] = [{"params": policy.trainable_parameters()}]
    if head is not None:
        groups.append({"params": list(head.parameters()), "lr": alg.value_lr})
    return build_optimizer(groups, trainer)


def _named(policy: LocalPolicy, head: nn.Module | None) -> dict[str, Any]:
    named = {f"model.{n}": p for n, p in policy.model.named_parameters() if p.requires_grad}
    if head is not None:
        named.update({f"value_head.{n}": p for n, p in head.named_parameters()})
    return named


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _capture_grads(opt: torch.optim.Optimizer, named: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Record every gradient the first optimizer step sees (reduced, clipped)."""
    grads: dict[str, torch.Tensor] = {}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not grads:
            grads.update({n: _full(p.grad) for n, p in named.items()})

    opt.register_step_pre_hook(hook)
    return grads


def _world() -> Any:
    from coderl.train.distributed import init_distributed

    return init_distributed(DistributedConfig(enabled=True), torch.device("cpu"))


def step_case(case: str, *, shard: bool) -> dict[str, Any]:
    """One trainer step of ``case``: plain (:func:`coderl.train.step.train_step` in one
    process) or sharded (:func:`coderl.train.distributed.sharded_train_step` on this rank, the
    reference logprobs computed with the weights gathered). Returns the metrics, the
    gradients the optimizer saw (first epoch) and the weights after the step, by name."""
    from coderl.train.distributed import gathered, shard_policy, sharded_train_step

    policy, head, alg, trainer = setup(case)
    b = batch(policy, case)
    if shard:
        root = shard_policy(policy.model, head, _world().mesh)
        with gathered(root):
            b = with_reference(policy, b, case)
    else:
        b = with_reference(policy, b, case)
    opt, sched = _optimizer(policy, head, alg, trainer)
    named = _named(policy, head)
    grads = _capture_grads(opt, named)
    before = {n: _full(p) for n, p in named.items()}
    kw: dict[str, Any] = {"temperature": 1.0, "max_len": 20}
    if shard:
        m = sharded_train_step(root, opt, sched, b, alg, trainer, **kw)
    else:
        m = train_step(policy.model, opt, sched, b, alg, trainer, value_head=head, **kw)
    after = {n: _full(p) for n, p in named.items()}
    return {"metrics": m, "grads": grads, "weights": after, "before": before}


# --- checkpoints: the PPO case (LoRA + value head, two optimizer groups), two steps ----------

RESUME_CASE = "ppo"


class Trainer:
    """A sharded trainer of :data:`RESUME_CASE` on this rank: steps on batches of seed
    1, 2, ...; save and load through :mod:`coderl.train.distributed`'s DCP checkpoints."""

    def __init__(self) -> None:
        from coderl.train.distributed import shard_policy

        self.policy, self.head, self.alg, self.trainer = setup(RESUME_CASE)
        self.root = shard_policy(self.policy.model, self.head, _world().mesh)
        self.opt, self.sched = _optimizer(self.policy, self.head, self.alg, self.trainer)
        self.step = 0

    def train(self) -> None:
        from coderl.train.distributed import sharded_train_step

        self.step += 1
        b = batch(self.policy, RESUME_CASE, seed=self.step)
        sharded_train_step(
            self.root, self.opt, self.sched, b, self.alg, self.trainer, temperature=1.0, max_len=20
        )

    def save(self, run_dir: Path) -> None:
        from coderl.train.distributed import save_sharded_checkpoint

        torch.manual_seed(100 + self.step)  # an RNG state the resumed run must get back
        save_sharded_checkpoint(
            run_dir, self.step, root=self.root, optimizer=self.opt, scheduler=self.sched,
            state={"cursor": self.step},
        )  # fmt: skip

    def load(self, run_dir: Path) -> None:
        from coderl.train.checkpoint import latest_checkpoint
        from coderl.train.distributed import load_sharded_checkpoint

        torch.manual_seed(999)  # not the saved state
        state = load_sharded_checkpoint(
            latest_checkpoint(run_dir), root=self.root, optimizer=self.opt, scheduler=self.sched
        )
        self.step = int(state["step"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: _full(p) for n, p in _named(self.policy, self.head).items()}


def resume_outcome(trainer: Trainer) -> dict[str, Any]:
    """What a resumed run must equal the uninterrupted one in: the RNG's next draw, the step,
    the scheduler's, and the weights after the next step."""
    probe = torch.rand(4)
    step, last_epoch = trainer.step, trainer.sched.last_epoch
    trainer.train()
    return {"rng": probe, "step": step, "sched": last_epoch, "weights": trainer.weights()}


SFT_FILE = "sft.safetensors"


def write_sft_weights(path: Path) -> dict[str, torch.Tensor]:
    """A warm start's ``trainable.safetensors`` for :data:`RESUME_CASE`'s policy: its trainable
    weights, each moved by seeded noise (so a load that keeps the initial weights fails)."""
    from safetensors.torch import save_file

    from coderl.train.checkpoint import trainable_state

    policy, _, _, _ = setup(RESUME_CASE)
    g = torch.Generator().manual_seed(7)
    warm = {
        n: t + torch.randn(t.shape, generator=g) for n, t in trainable_state(policy.model).items()
    }
    save_file(warm, str(path))
    return warm


def sft_outcome(path: Path) -> dict[str, torch.Tensor]:
    """The policy's whole trainable weights (``model.``-prefixed) after a sharded trainer on
    this rank loaded the warm start at ``path``."""
    from safetensors.torch import load_file

    from coderl.train.distributed import load_full_trainable

    t = Trainer()
    load_full_trainable(t.root, load_file(str(path)))
    return {n: w for n, w in t.weights().items() if n.startswith("model.")}


def _disagreement(rank: int) -> str | None:
    """What :func:`coderl.train.distributed.check_same_on_ranks` raises when the ranks hold
    different values (after it let an equal one pass); None if it raised nothing."""
    from coderl.train.distributed import check_same_on_ranks

    check_same_on_ranks(repr([1.0, float("nan")]), "an equal value")  # NaN: by repr
    try:
        check_same_on_ranks(rank, "the rank")
    except RuntimeError as e:
        return str(e)
    return None


def two_rank_worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of two (gloo): every equivalence case, then the checkpoint runs (save after
    step 1 into ``out/w2``, the uninterrupted step 2, the resumed step 2 from ``out/w2`` and
    from the one-rank ``out/w1``); rank 0 writes ``out/two_ranks.pt``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    res: dict[str, Any] = {c: step_case(c, shard=True) for c in CASES}
    res["disagree"] = _disagreement(rank)
    t = Trainer()
    t.train()
    t.save(Path(out) / "w2")
    res["uninterrupted"] = resume_outcome(t)
    for name, src in (("resumed", "w2"), ("from_one_rank", "w1")):
        t = Trainer()
        t.load(Path(out) / src)
        res[name] = resume_outcome(t)
    res["sft"] = sft_outcome(Path(out) / SFT_FILE)
    if rank == 0:
        torch.save(res, Path(out) / "two_ranks.pt")
    dist.destroy_process_group()
