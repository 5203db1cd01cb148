"""The embedded default model from its GGUF (slow: ~1 min to dequantize on 2 busy cores)."""

import pytest
import torch

from coderl.policy import SamplingParams, collate, load_policy, smollm2_gguf_path
from coderl.policy.episode import EpisodeBuilder


@pytest.mark.slow
def test_smollm2_gguf_loads_samples_exactly_and_saves(tmp_path):
    if not smollm2_gguf_path().is_file():  # raises with install instructions when missing
        pytest.fail("unreachable")
    policy = load_policy("smollm2-135m", reference=False)
    assert not hasattr(policy.model.config, "quantization_config")  # rebuilt as a plain model
    assert policy.pad_token_id == policy.tokenizer.eos_token_id  # SmolLM2: pad == EOS
    ep = EpisodeBuilder(policy.tokenizer, [{"role": "user", "content": "Say hi."}])
    c = policy.generate([ep.prompt_ids()], SamplingParams(max_new_tokens=16, seed=0))[0]
    ep.add_completion(c)
    batch = collate(ep.trajectory.segments, policy.pad_token_id)
    with torch.no_grad():
        logp = policy.forward_logprobs(batch)
    m = batch.loss_mask.bool()
    assert (logp[m] - batch.behavior_logprobs[m]).abs().max() < 1e-3
    policy.save(tmp_path)  # transformers refuses to save the GGUF-flagged original
    again = load_policy(tmp_path, reference=False)
    with torch.no_grad():
        assert torch.allclose(again.forward_logprobs(batch), logp, atol=1e-5)
