"""Asymmetric precision: bf16 detection, a bf16 sampler next to the fp32 trainer, and the
importance weights that correct the gap between them (on the tiny model; torch runs bf16 on any
CPU, slowly without bf16 units)."""

import pytest
import torch

from coderl.config import AlgorithmConfig
from coderl.policy import SamplingParams, load_policy
from coderl.policy import precision as P
from coderl.policy.local import LoraSpec
from coderl.train.batch import build_batch
from coderl.train.step import accumulate_gradients
from coderl.trajectory import Segment

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
PARAMS = SamplingParams(max_new_tokens=12, seed=1)


def test_bf16_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 avx512_bf16\n")
    assert P.bf16_flags(info) == ["avx512_bf16", "amx_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")  # a typical AVX2 CI runner
    assert P.bf16_flags(info) == []
    assert P.bf16_flags(tmp_path / "missing") == []


def test_cpu_info_reads_the_model_name_and_flags_of_the_first_core(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 amx_tile\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    assert P.cpu_info(info) == ("Some Xeon", {"fpu", "avx2", "amx_tile"})
    assert P.cpu_info(tmp_path / "missing") == ("unknown", set())


def test_auto_is_bf16_exactly_when_units_are_detected(monkeypatch):
    monkeypatch.setattr(P, "bf16_flags", lambda: [])
    assert P.resolve_precision("auto") == torch.float32
    monkeypatch.setattr(P, "bf16_flags", lambda: ["amx_bf16"])
    assert P.resolve_precision("auto") == torch.bfloat16
    assert P.resolve_precision("float32") == torch.float32
    assert P.resolve_precision("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="valid"):
        P.resolve_precision("fp16")


@pytest.fixture(params=["static", "hf"])
def lora_policy(request):
    torch.manual_seed(0)
    policy = load_policy(
        "tiny-random", lora=LoraSpec(rank=4, alpha=8.0), reference=False, engine=request.param
    )
    with torch.no_grad():  # a non-zero adapter, so the copy has something to keep current
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def _segments(prompts, completions):
    segs = []
    for p, c in zip(prompts, completions, strict=True):
        seg = Segment()
        seg.append_context(list(p), kind="prompt")
        seg.append_sampled(c.token_ids, c.logprobs, c.policy_version)
        segs.append(seg)
    return segs


def test_bf16_sampler_records_its_own_logprobs_and_tracks_the_trainer(lora_policy):
    policy = lora_policy
    assert policy.set_sampler_precision("bfloat16") == torch.bfloat16
    assert policy.sampler_dtype == torch.bfloat16
    assert next(policy.model.parameters()).dtype == torch.float32  # the trainer stays fp32
    out = policy.generate(PROMPTS, PARAMS)
    gap = policy.logprob_gap(PROMPTS, out)
    # bf16 (8 mantissa bits) vs fp32: a gap far above fp32's ~1e-6, far below a wrong model's.
    assert 1e-4 < gap["logprob_gap"] < 0.1

    # an optimizer step on the trainer's weights reaches the sampler at its next call
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
    for p in policy.trainable_parameters():
        p.grad = torch.randn_like(p) * 0.5
    opt.step()
    moved = policy.logprob_gap(PROMPTS, out)["logprob_gap"]  # old samples vs the new weights
    assert moved > 10 * gap["logprob_gap"]
    fresh = policy.generate(PROMPTS, PARAMS)
    assert policy.logprob_gap(PROMPTS, fresh)["logprob_gap"] < moved / 10  # a stale copy: = moved

    policy.set_sampler_precision("float32")  # back to the trainer's own weights
    assert policy.low_precision is None
    assert policy.logprob_gap(PROMPTS, policy.generate(PROMPTS, PARAMS))["logprob_gap"] < 1e-3


def test_importance_weights_correct_the_bf16_sampler_gap(lora_policy):
    policy = lora_policy
    policy.set_sampler_precision("bfloat16")
    out = policy.generate(PROMPTS, PARAMS)
    batch = build_batch(_segments(PROMPTS, out), [1.0, -0.5, 0.25], policy.pad_token_id)
    behaviour = batch.tokens.behavior_logprobs
    mask = batch.loss_mask
    assert torch.equal(behaviour[mask], torch.tensor([x for c in out for x in c.logprobs]))
    with torch.no_grad():
        trainer = policy.forward_logprobs(batch.tokens)  # fp32
    assert (trainer - behaviour)[mask].abs().max() > 1e-4  # the recorded logprobs are bf16's

    cfg = AlgorithmConfig(old_logp="trainer")  # default: truncated IS, cap 2
    m = accumulate_gradients(policy.model, batch, cfg, micro_batch_size=2, temperature=1.0,
                             max_len=PARAMS.max_new_tokens)  # fmt: skip
    w = (trainer - behaviour)[mask].exp().clamp(max=cfg.importance.cap)  # TIS, Yao et al. 2025
    assert m["iw_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
    assert m["iw_max"] == pytest.approx(float(w.max()), rel=1e-4)
    assert m["iw_mean"] != pytest.approx(1.0, abs=1e-5)
    assert m["logprob_gap"] == pytest.approx(float((trainer - behaviour)[mask].abs().mean()), 1e-4)


def test_engine_dtype_sets_the_torch_samplers_precision(monkeypatch):
    from coderl.config import Config
    from coderl.policy.rollout import build_engine

    policy = load_policy("tiny-random", lora=LoraSpec(rank=4), reference=False)
    build_engine(Config(engine={"dtype": "bfloat16"}), policy)
    assert policy.sampler_dtype == torch.bfloat16
    monkeypatch.setattr(P, "bf16_flags", lambda: [])  # an AVX2-only CPU: auto stays fp32
    build_engine(Config(engine={"dtype": "auto"}), policy)
    assert policy.sampler_dtype == torch.float32 and policy.low_precision is None
    assert Config().engine.dtype == "float32"  # the default samples from the trainer's weights


def test_a_version_bump_refreshes_the_copy_even_without_version_counters(lora_policy):
    policy = lora_policy
    policy.set_sampler_precision("bfloat16")
    policy.generate(PROMPTS, PARAMS)
    with torch.no_grad():  # what a fused optimizer does: new values, no version-counter bump
        for p in policy.trainable_parameters():
            p.data.add_(torch.randn_like(p) * 0.5)
    stale = policy.generate(PROMPTS, PARAMS)
    moved = policy.logprob_gap(PROMPTS, stale)["logprob_gap"]
    policy.bump_version()  # the loop's contract after every optimizer step
    fresh = policy.generate(PROMPTS, PARAMS)
    assert policy.logprob_gap(PROMPTS, fresh)["logprob_gap"] < moved / 10
