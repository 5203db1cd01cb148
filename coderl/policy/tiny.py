"""``"tiny-random"``: a ~1M-parameter Qwen2-architecture model and its tokenizer, built
in-process.

Used by tests and examples: nothing is downloaded. The tokenizer is a byte-level BPE trained in a
few milliseconds on a fixed built-in corpus (so every byte string can be encoded), with Qwen2.5's
special tokens and a ChatML chat template that renders tool definitions, tool calls and tool
results the way Qwen2.5's template does. It is a ``Qwen2Tokenizer`` (Qwen2's NFC normalizer and
pre-tokenizer split, taken from transformers' own class), because that is what
``AutoTokenizer`` builds for any ``model_type: qwen2`` directory in transformers 5, whatever
``tokenizer_config.json`` names: it keeps only the vocabulary and merges of a saved
``tokenizer.json`` and rebuilds the pipeline itself, so a tokenizer with another pre-tokenizer
would come back from a saved or exported directory (``load_policy(DIR)``,
:mod:`coderl.train.export`) tokenizing differently. The weights are random, drawn from
``seed``: the model produces token soup, which is all the tests need (exact logprobs, masks,
LoRA, references).

Limits: the corpus is tiny, so most text encodes to many short tokens; not a language model.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

# Special tokens as in Qwen2.5: <|endoftext|> pads, <|im_end|> ends a turn (the EOS of chat).
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Tool-call markup is added as whole tokens (not special: they survive decoding).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nclass Parser:\n    def __init__(self, text):\n        self.text = text\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    'The test failed: AssertionError: expected 3, got 4.\n{"name": "run", "arguments": {}}\n',
    "system user assistant tool You are a helpful coding assistant. Read the file and fix the bug.",
    "# Tools\n<tools>\n</tools>\nFor each function call, return a json object with function name",
    "and arguments within XML tags: function, parameters, properties, required, type, string.",
]

# A Qwen2.5-style ChatML template: tools go into the system turn as JSON lines, an assistant turn's
# tool calls are JSON objects inside <tool_call> tags, and consecutive tool results are grouped
# into one user turn inside <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if 'function' in call else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] | tojson if fn['arguments'] is not string else fn['arguments'] }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_tokenizer(vocab_size: int = 512) -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer`` with ChatML special tokens and :data:`CHAT_TEMPLATE`.

    Trained with the normalizer, pre-tokenizer and decoder of transformers' ``Qwen2Tokenizer``
    (NFC, Qwen2's split regex, byte-level), so ``AutoTokenizer`` reloads a saved copy with the
    same ids. Deterministic: the same ``vocab_size`` always gives the same vocabulary. Ids 0, 1,
    2 are ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS).
    """
    qwen2 = Qwen2Tokenizer().backend_tokenizer  # transformers' Qwen2 pipeline, empty vocabulary
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = qwen2.normalizer
    bpe.pre_tokenizer = qwen2.pre_tokenizer
    bpe.decoder = qwen2.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    tok = Qwen2Tokenizer(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )
    tok.add_tokens(MARKUP_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, *, seed: int = 0, eos_token_id: int = 2, pad_token_id: int = 0):
    """A random Qwen2ForCausalLM: hidden 128, MLP 512, 4 layers, 4 query / 2 KV heads, tied
    embeddings; ~1.05M parameters with the tiny tokenizer's vocabulary.

    Weights are drawn after ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng``: equal
    seeds give equal models, and the caller's global RNG state is left as it was.
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    fork = torch.random.fork_rng()
    with fork:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float().eval()


def tiny_random(seed: int = 0) -> tuple[Qwen2ForCausalLM, Qwen2Tokenizer]:
    """The ``"tiny-random"`` model and tokenizer (see the module docstring)."""
    tok = tiny_tokenizer()
    model = tiny_model(
        len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return model, tok
