"""The work counts a FLOP profile reads (``bench/demo_profile.py``): the trainer forward's token
positions and causal query-key pairs (:func:`coderl.policy.forward.work`, hand-worked), and the
sampler's prefill and decode counters (``TorchEngine.prefill_stats``) on the tiny model."""

import pytest
import torch

from coderl.policy import SamplingParams, load_policy
from coderl.policy.batch import TrainBatch
from coderl.policy.forward import forward, work

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def two_rows() -> TrainBatch:
    # row 0: 3 real tokens and one pad; row 1: 4 real; both start with tokens 1, 2
    ids = torch.tensor([[1, 2, 3, 0], [1, 2, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    loss = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.float32)
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        loss_mask=loss,
        behavior_logprobs=torch.zeros(2, 4),
        policy_versions=torch.zeros(2, 4, dtype=torch.long),
    )


def test_work_counts_positions_and_causal_pairs_by_hand():
    b = two_rows()
    # packed, no shared prefix: 3 + 4 positions; pairs 3*4/2 + 4*5/2 = 6 + 10
    assert work(b, 0, True) == (7, 16)
    # packed, 2 shared tokens run once: 2 + 1 + 2 positions; pairs: the prefix 1 + 2, row 0's
    # own token (position 2) sees 3, row 1's two (positions 2, 3) see 3 + 4: 3 + 3 + 7
    assert work(b, 2, True) == (5, 13)
    # padded: every 2 x 4 position, 2 x (1 + 2 + 3 + 4) pairs
    assert work(b, 0, False) == (8, 20)
    # padded after a 2-token prefix run once: 2 + 2 x 2 positions; 3 + 2 x (3 + 4) pairs
    assert work(b, 2, False) == (6, 17)


def test_the_trainer_forward_reports_the_work_of_the_path_it_took():
    policy = load_policy("tiny-random", reference=False)
    b = two_rows()
    packed = forward(policy.model, b, temperature=1.0, pack=True)
    assert (packed.positions, packed.attended) == (7, 16)  # 2 shared tokens < the minimum 16
    plain = forward(policy.model, b, temperature=1.0)
    assert (plain.positions, plain.attended) == (8, 20)


@pytest.mark.parametrize(
    "engine, prefill",
    [
        # distinct prompts prefilled once each, unpadded: 3 + 9 + 1 + 4 tokens,
        # 6 + 45 + 1 + 10 pairs (the repeated first prompt is copied, not run)
        ("static", (17, 62)),
        # left-padded to 9: 5 x 9 positions, 5 x 45 pairs
        ("hf", (45, 225)),
    ],
)
def test_the_sampler_counts_prefill_and_decode_work(engine, prefill):
    policy = load_policy("tiny-random", reference=False, engine=engine)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33], [5, 6, 7]]
    stats = policy.engine.prefill_stats
    before = dict(stats)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0, ignore_eos=True)
    policy.generate(prompts, params)
    got = {k: v - before[k] for k, v in stats.items()}
    assert (got["prefilled_tokens"], got["prefill_attended"]) == prefill
    assert (got["prompts"], got["prompt_tokens"]) == (5, 20)  # every prompt asked for
    # 4 tokens sampled per row, the first from the prefill's logits: 3 decode steps x 5 rows;
    # the token sampled at step s sits at position P + s and attends P + s + 1 positions:
    # sum over rows of 3 P + (1 + 2 + 3) = 3 x (3 + 9 + 1 + 4 + 3) + 5 x 6
    assert got["decoded_tokens"] == 15
    assert got["decode_attended"] == 90


def test_a_shared_prefix_is_counted_once_and_the_rest_attends_to_it():
    policy = load_policy("tiny-random", reference=False, engine="static")
    common = list(range(40, 57))  # 17 tokens: at least MIN_SHARED_PREFIX, run once
    prompts = [common + [60, 61, 62], common + [70, 71, 72]]
    stats = policy.engine.prefill_stats
    before = dict(stats)
    policy.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=1, seed=0))
    got = {k: v - before[k] for k, v in stats.items()}
    # the prefix: 17 positions, 17 x 18 / 2 = 153 pairs; each row's 3 own tokens at positions
    # 17, 18, 19 attend 18 + 19 + 20 = 57 positions
    assert (got["prefilled_tokens"], got["prefill_attended"]) == (17 + 3 + 3, 153 + 2 * 57)
    assert got["decoded_tokens"] == 0  # one token per row: sampled from the prefill's logits


def _bench(name: str):
    """A ``bench/`` script as a module (imported by name, as the scripts import each other)."""
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).parent.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


def test_the_profiles_flop_formulas_by_hand():
    prof = _bench("demo_profile")
    shape = dict(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    full = prof.ModelShape(**shape, decoder_linear_params=100, lora_params=0, linears=())
    lora = prof.ModelShape(**shape, decoder_linear_params=100, lora_params=5, linears=())
    # 3 positions, 6 causal pairs, 2 rows of logits: 2 N P + 4 L H d_h A + 2 d V S
    # = 2*100*3 + 4*2*2*2*6 + 2*4*10*2 = 600 + 192 + 160
    assert prof.forward_flops(full, 3, 6, 2) == 952
    # full fine-tuning: 3x the forward (Kaplan et al. 2020, Sec. 2.1)
    assert prof.train_flops(full, 3, 6, 2) == 3 * 952
    # LoRA: (4 N + 6 N_lora) P + 12 L H d_h A + 4 d V S = 1200 + 90 + 576 + 320
    assert prof.train_flops(lora, 3, 6, 2) == 2186


def test_the_floor_reads_the_models_shapes():
    gemm = _bench("gemm_floor")
    from coderl.policy.local import LoraSpec

    policy = load_policy("tiny-random", reference=False, lora=LoraSpec(rank=16))
    shape = gemm.model_shape(policy.model)  # the adapters' matrices are not model shapes
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (
        4, 128, 4, 2, 32,
    )  # fmt: skip
    # per layer q, o 128x128, k, v 128x64, gate, up 128x512, down 512x128
    assert shape.decoder_linear_params == 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512)
    assert gemm.Linear("head", 128, shape.vocab, 1) in shape.linears
    # r (in + out) per adapted projection: q, o 16 x 256, k, v 16 x 192, gate, up, down 16 x 640
    assert shape.lora_params == 4 * 16 * (2 * 256 + 2 * 192 + 3 * 640)
