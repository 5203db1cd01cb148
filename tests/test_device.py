"""``trainer.device``: every training tensor (policy, reference, value head, optimizer state,
batches) follows the one setting. Tested by construction on CPU, and on the ``meta`` device, where
a tensor created without the configured device would show up on the CPU instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coderl.config import ConfigError, load_config
from coderl.train import loop
from coderl.train import pipeline as P
from coderl.train.run import resolve_device, setup_run
from coderl.trajectory import Segment, Trajectory

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false"]


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _trajectories(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        seg = Segment()
        seg.append_context([5, 6, 7 + i])
        seg.append_sampled([9, 10], [-1.0, -2.0], 0)
        out.append(Trajectory(segments=[seg]))
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.lora=true", "algorithm.kl.coef=0.1"],  # reference = adapter disabled, KL batch
        ["model.lora=false", "algorithm.kl.coef=0.1"],  # reference = a frozen copy
        ["algorithm.advantage=gae", "rollout.group_size=1"],  # value head and its optimizer
    ],
)
def test_a_cpu_step_keeps_every_tensor_on_the_configured_device(tmp_path, monkeypatch, overrides):
    cfg = load_config(
        TOY,
        [*FAST, f"run_dir={tmp_path}", "trainer.device=cpu", "rollout.max_new_tokens=4",
         "rollout.group_size=2", *overrides],
    )  # fmt: skip
    seen = []
    import coderl.train.run as run_module  # the one update both drivers call

    real = run_module.train_step

    def spy(model, optimizer, scheduler, batch, *a, **k):
        seen.append(batch)
        return real(model, optimizer, scheduler, batch, *a, **k)

    monkeypatch.setattr(run_module, "train_step", spy)
    run = setup_run(cfg)
    loop.training_step(run)
    want = torch.device("cpu")
    assert run.policy.device == want
    assert all(p.device == want for p in run.policy.model.parameters())
    if run.policy.reference_model is not None:
        assert all(p.device == want for p in run.policy.reference_model.parameters())
    if run.value_head is not None:
        assert all(p.device == want for p in run.value_head.parameters())
    state = _optimizer_tensors(run.optimizer)
    assert state and all(t.device == want for t in state)  # exp_avg, exp_avg_sq, step
    assert len(seen) == 1 and all(t.device == want for t in seen[0].tensors().values())
    if "algorithm.kl.coef=0.1" in overrides:
        assert seen[0].ref_logp is not None


@pytest.mark.parametrize("lora", ["true", "false"])
def test_on_the_meta_device_nothing_lands_on_the_cpu(tmp_path, lora):
    cfg = load_config(
        TOY,
        [*FAST, f"run_dir={tmp_path}", "trainer.device=meta", f"model.lora={lora}",
         "algorithm.advantage=gae", "rollout.group_size=1"],
    )  # fmt: skip
    run = setup_run(cfg, engine=False)
    meta = torch.device("meta")
    models = [run.policy.model, run.value_head]
    if run.policy.reference_model is not None:
        models.append(run.policy.reference_model)
    for m in models:
        assert m is not None
        assert {p.device for p in m.parameters()} == {meta}
        assert {b.device for b in m.buffers()} <= {meta}
    # optimizer state is created on its parameters' device
    for p in run.policy.trainable_parameters() + list(run.value_head.parameters()):
        p.grad = torch.zeros_like(p)
    run.optimizer.step()
    assert {t.device for t in _optimizer_tensors(run.optimizer) if t.dim() > 0} == {meta}
    # the step's batch: built from Python lists, moved to the device (no forward on meta: grpo)
    grpo = cfg.model_copy(
        update={"algorithm": cfg.algorithm.model_copy(update={"advantage": "grpo"})}
    )
    batch = P.make_batch(
        grpo, run.policy, None, _trajectories(4), [0.0, 1.0, 0.0, 1.0], [True] * 4,
        ["a", "a", "b", "b"],
    )  # fmt: skip
    assert batch is not None
    assert {n: t.device for n, t in batch.tensors().items()} == {n: meta for n in batch.tensors()}


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="trainer.device"):
        load_config(TOY, ["trainer.device=gpu"])
