"""``coderl export``: a 2-step toy run (tiny-random model), exported and reloaded with plain
transformers (+ peft), reproduces the trainer's token logprobs, generates, and tokenizes like
coderl's tokenizer. Tolerance: 1e-4 nats, fp32 (same weights; a merged adapter adds rounding of
``W + (alpha / r) B A``)."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from coderl.cli import main
from coderl.config import load_config
from coderl.policy.episode import encode, render
from coderl.policy.loading import gguf_tokenizer, load_policy, smollm2_gguf_path
from coderl.policy.tiny import (
    _CORPUS,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    tiny_model,
)
from coderl.train.checkpoint import load_checkpoint, resolve_checkpoint
from coderl.train.export import (
    PROBE_TEXTS,
    ExportError,
    check_dir,
    check_tokenizer,
    export_run,
    probe_ids,
)
from coderl.train.loop import train
from coderl.train.run import build_policy

TOY = Path(__file__).parent.parent / "configs" / "toy.yaml"
FAST = ["progress=false", "tensorboard=false", "eval.before_after=false"]
ATOL = 1e-4  # nats, fp32
MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "tests/test_x.py fails:\n  assert add(1, 2) == 3"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "run", "arguments": {}}]},
    {"role": "tool", "content": "1 failed"},
]
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "naïve  ÅSCII\t42 ﬁ\n\n",
    "x<|im_end|>y<|im_start|>z",
]


def _run(tmp_path_factory, name, *overrides):
    run_dir = tmp_path_factory.mktemp(name)
    cfg = load_config(
        TOY,
        [*FAST, f"run_dir={run_dir}", "trainer.steps=2", "trainer.checkpoint_every=2", *overrides],
    )
    train(cfg)
    return run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return _run(tmp_path_factory, "full")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    # lr 0.05: after two steps the adapter moves the logprobs well beyond the tolerance
    return _run(tmp_path_factory, "lora", "model.lora=true", "trainer.lr=0.05")


def _trained(run_dir):
    """The trainer's policy at the run's newest checkpoint, rebuilt independently."""
    run_dir, ckpt = resolve_checkpoint(run_dir)
    policy = build_policy(load_config(run_dir / "config.yaml"), reference=False)
    load_checkpoint(ckpt, model=policy.model, restore_rng=False)
    return policy


def _batch(tok):
    """A fixed batch: a rendered multi-turn conversation and two random id sequences."""
    g = torch.Generator().manual_seed(3)
    conv = encode(tok, render(tok, MESSAGES, add_generation_prompt=True))
    return [conv, *(torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (17, 40))]


def _hf_logprobs(model, seqs):
    out = []
    with torch.no_grad():
        for ids in seqs:
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)
            out.append(logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])  # (T-1,)
    return torch.cat(out)


def _trainer_logprobs(policy, seqs):
    return torch.cat([torch.tensor(lp[1:]) for lp in policy.logprobs(seqs)])


def _assert_tokenizer_round_trips(path, tok):
    reloaded = AutoTokenizer.from_pretrained(path)
    rendered = render(tok, MESSAGES, add_generation_prompt=True)
    assert render(reloaded, MESSAGES, add_generation_prompt=True) == rendered  # chat template
    for text in [*TEXTS, rendered]:
        assert encode(reloaded, text) == encode(tok, text), text
        assert reloaded.decode(encode(reloaded, text)) == tok.decode(encode(tok, text))


def _assert_generates(model, tok, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out.shape[1] > len(prompt) and out[0, : len(prompt)].tolist() == prompt
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_full_fine_tuning_exports_a_model_directory(full_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(full_run), "--out", str(out)]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert (out / "chat_template.jinja").is_file()
    policy = _trained(full_run)
    base = load_policy("tiny-random", reference=False)
    seqs = _batch(policy.tokenizer)
    expected = _trainer_logprobs(policy, seqs)
    assert (expected - _trainer_logprobs(base, seqs)).abs().max() > 10 * ATOL  # it trained
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(_hf_logprobs(model, seqs), expected, rtol=0, atol=ATOL)
    _assert_tokenizer_round_trips(out, policy.tokenizer)
    _assert_generates(model, policy.tokenizer, seqs[0])
    with pytest.raises(FileExistsError, match="--force"):
        export_run(full_run, out)
    with pytest.raises(ValueError, match="no adapter"):
        export_run(full_run, tmp_path / "m", merged=True)


def test_lora_exports_base_adapter_and_merged(lora_run, tmp_path):
    manifest = export_run(lora_run, tmp_path / "hf", merged=True)
    assert set(manifest["dirs"]) == {"base", "adapter", "merged"} and manifest["step"] == 2
    dirs = {k: Path(v) for k, v in manifest["dirs"].items()}
    assert {p.name for p in dirs["adapter"].iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    policy = _trained(lora_run)
    seqs = _batch(policy.tokenizer)
    expected = _trainer_logprobs(policy, seqs)
    with policy.model.disable_adapter():  # the reference: the base weights
        base_expected = _trainer_logprobs(policy, seqs)
    assert (expected - base_expected).abs().max() > 10 * ATOL  # the adapter moved the policy

    base = AutoModelForCausalLM.from_pretrained(dirs["base"], dtype=torch.float32)
    torch.testing.assert_close(_hf_logprobs(base, seqs), base_expected, rtol=0, atol=ATOL)
    adapted = PeftModel.from_pretrained(base, dirs["adapter"]).eval()
    torch.testing.assert_close(_hf_logprobs(adapted, seqs), expected, rtol=0, atol=ATOL)
    merged = AutoModelForCausalLM.from_pretrained(dirs["merged"], dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_hf_logprobs(merged, seqs), expected, rtol=0, atol=ATOL)
    for role in ("base", "merged", "adapter"):
        _assert_tokenizer_round_trips(dirs[role], policy.tokenizer)
    _assert_generates(merged, policy.tokenizer, seqs[0])
    _assert_generates(adapted, policy.tokenizer, seqs[0])


def test_smollm2_gguf_tokenizer_reloads_with_the_trainers_ids(tmp_path):
    # tokenizer only (no weights): SmolLM2's GGUF tokenizer saved as export saves it, beside
    # its config (model_type llama, which AutoTokenizer reads to pick the tokenizer class)
    gguf = smollm2_gguf_path()  # raises with install instructions when missing
    tok = gguf_tokenizer(gguf)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    assert config.model_type == "llama"
    config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert check_tokenizer(tok, tmp_path) == len(PROBE_TEXTS) + 1
    _assert_tokenizer_round_trips(tmp_path, tok)


def test_a_tokenizer_that_autotokenizer_rebuilds_differently_fails_the_check(tmp_path):
    # The pitfall: a qwen2 directory with a GPT-2-regex byte-level tokenizer (the tiny
    # tokenizer's former layout). transformers 5 loads it as a Qwen2Tokenizer, which keeps only
    # vocabulary and merges and splits "\n    return" differently.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        _CORPUS,
        trainer=trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    tiny_model(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ExportError, match="Qwen2Tokenizer that tokenizes"):
        check_dir(tok, tmp_path, [0, 1], [0.0, 0.0])


def test_a_logprob_gap_fails_the_check(full_run, tmp_path, monkeypatch):
    out = export_run(full_run, tmp_path / "hf")["dirs"]["model"]
    policy = _trained(full_run)
    ids = probe_ids(policy.tokenizer)
    right = policy.logprobs([ids])[0]
    check_dir(policy.tokenizer, Path(out), ids, right)
    wrong = [lp + 1e-3 for lp in right]
    with pytest.raises(ExportError, match="logprobs differ"):
        check_dir(policy.tokenizer, Path(out), ids, wrong)
    monkeypatch.setattr("coderl.train.export.LOGPROB_ATOL", -1.0)  # every export now fails
    with pytest.raises(ExportError):
        export_run(full_run, tmp_path / "failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no OUT, no .tmp-OUT left
