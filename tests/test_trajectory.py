"""Segments and token-exact multi-turn assembly with the chat template."""

import pytest
import torch

from coderl.policy import (
    Completion,
    EpisodeBuilder,
    SamplingParams,
    collate,
    load_policy,
    render,
    supports_tools,
)
from coderl.policy.tiny import tiny_tokenizer
from coderl.trajectory import Segment

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "The test fails."},
]


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny-random", reference=False)


def fake_completion(tok, text, *, stop=True):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if stop else [])
    return Completion(ids, [-0.5] * len(ids), "stop" if stop else "length", 0)


def test_segment_appends_and_validates():
    seg = Segment()
    with pytest.raises(ValueError, match="start with sampled"):
        seg.append_sampled([1], [-0.1], 0)
    seg.append_context([1, 2], kind="prompt")
    with pytest.raises(ValueError, match="logprobs"):
        seg.append_sampled([3, 4], [-0.1], 0)
    with pytest.raises(ValueError, match="finite"):
        seg.append_sampled([3], [float("nan")], 0)
    seg.append_sampled([3, 4], [-0.1, -0.2], 7)
    assert seg.loss_mask == [0, 0, 1, 1] and seg.policy_versions == [-1, -1, 7, 7]
    assert seg.provenance["spans"] == [["prompt", 0, 2], ["action", 2, 4]]
    assert seg.num_trainable == 2
    seg.validate()
    seg.policy_versions[2] = -1
    with pytest.raises(ValueError, match="version"):
        seg.validate()


def test_tools_are_rendered_by_the_template():
    tok = tiny_tokenizer()
    assert supports_tools(tok)
    text = render(tok, MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert '"name": "run"' in text and text.endswith("<|im_start|>assistant\n")


def test_observation_delta_reproduces_the_rendered_conversation():
    # When the sampled text round-trips, the segment decodes to exactly the template's rendering
    # of the whole conversation: the delta neither drops nor duplicates scaffolding.
    tok = tiny_tokenizer()
    ep = EpisodeBuilder(tok, MESSAGES, tools=TOOLS)
    call = {"name": "run", "arguments": {"cmd": "pytest"}}
    text = '<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest"}}\n</tool_call>'
    ep.add_completion(
        fake_completion(tok, text),
        message={"role": "assistant", "content": "", "tool_calls": [call]},
    )
    assert ep.add_observation([{"role": "tool", "content": "1 failed"}])
    ep.add_completion(fake_completion(tok, "Fixed."))
    assert ep.add_observation([{"role": "user", "content": "Thanks."}])
    expected = render(
        tok,
        MESSAGES
        + [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": "1 failed"},
            {"role": "assistant", "content": "Fixed."},
            {"role": "user", "content": "Thanks."},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    )
    seg = ep.segment
    assert tok.decode(seg.token_ids) == expected
    assert [s[0] for s in seg.provenance["spans"]] == [
        "prompt",
        "action",
        "observation",
        "action",
        "observation",
    ]


def test_length_cut_completion_gets_the_end_of_turn_as_scaffolding():
    tok = tiny_tokenizer()
    ep = EpisodeBuilder(tok, MESSAGES)
    ep.add_completion(fake_completion(tok, "I will", stop=False))
    ep.add_observation([{"role": "user", "content": "go on"}])
    kind, start, end = ep.segment.provenance["spans"][-1]
    obs = ep.segment.token_ids[start:end]
    assert kind == "observation" and obs[0] == tok.eos_token_id  # <|im_end|> added, masked 0
    assert ep.segment.loss_mask[start:end] == [0] * (end - start)


def test_multi_turn_prefix_invariant_and_exact_logprobs(policy):
    tok = policy.tokenizer
    ep = EpisodeBuilder(tok, MESSAGES, tools=TOOLS)
    params = SamplingParams(max_new_tokens=8, seed=0)
    sampled_from = []
    for turn in range(3):
        prompt = ep.prompt_ids()
        c = policy.generate([prompt], params)[0]
        sampled_from.append(prompt)
        ep.add_completion(c)
        obs = (
            {"role": "tool", "content": f"output {turn}"}
            if turn < 2
            else {"role": "user", "content": "done?"}
        )
        assert ep.add_observation([obs])
    seg = ep.segment
    actions = [(s, e) for kind, s, e in seg.provenance["spans"] if kind == "action"]
    assert len(actions) == 3
    for (start, end), prompt in zip(actions, sampled_from, strict=True):
        assert seg.token_ids[:start] == prompt  # the training prefix is the sampling prefix
        assert seg.loss_mask[start:end] == [1] * (end - start)
    assert sum(seg.loss_mask) == sum(e - s for s, e in actions)
    # the trainer recomputes the sampler's numbers on the assembled segment
    batch = collate([seg], policy.pad_token_id)
    with torch.no_grad():
        logp = policy.forward_logprobs(batch)
    m = batch.loss_mask.bool()
    assert (logp[m] - batch.behavior_logprobs[m]).abs().max() < 1e-3


def test_template_that_rewrites_history_starts_a_new_segment():
    # Like Qwen3: earlier assistant turns lose their <think>...</think> once a user turn follows.
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{%- for m in messages %}{%- set c = m['content'] %}"
        "{%- if m['role'] == 'assistant' and not loop.last %}"
        "{%- set c = c.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    ep = EpisodeBuilder(tok, MESSAGES)
    ep.add_completion(fake_completion(tok, "<think>hmm</think>Done."))
    assert not ep.add_observation([{"role": "user", "content": "Sure?"}])
    assert len(ep.trajectory.segments) == 2
    first, second = ep.trajectory.segments
    assert first.num_trainable > 0 and second.num_trainable == 0
    text = tok.decode(second.token_ids)
    assert "hmm" not in text and "Done." in text and text.endswith("<|im_start|>assistant\n")
    assert second.provenance["reason"] == "chat template rewrites history"


def test_builder_enforces_turn_order():
    tok = tiny_tokenizer()
    ep = EpisodeBuilder(tok, MESSAGES)
    with pytest.raises(RuntimeError, match="follow a completion"):
        ep.add_observation([{"role": "user", "content": "x"}])
    ep.add_completion(fake_completion(tok, "a"))
    with pytest.raises(RuntimeError, match="add_observation"):
        ep.prompt_ids()
    with pytest.raises(RuntimeError, match="add_observation"):
        ep.add_completion(fake_completion(tok, "b"))
    with pytest.raises(ValueError, match="at least one"):
        EpisodeBuilder(tok, [])


def test_a_stopped_turn_has_exactly_one_end_of_turn_token():
    # the sampled <|im_end|> closes the turn; the observation delta must not add a second one
    tok = tiny_tokenizer()
    ep = EpisodeBuilder(tok, MESSAGES)
    ep.add_completion(fake_completion(tok, "Done."))
    ep.add_observation([{"role": "user", "content": "ok"}])
    seg = ep.segment
    _, start, end = [s for s in seg.provenance["spans"] if s[0] == "action"][0]
    assert seg.token_ids[end - 1] == tok.eos_token_id
    assert seg.token_ids[end] != tok.eos_token_id  # the delta starts after the closing


@pytest.mark.parametrize("reason", ["abort", "tool_calls", "", None])
def test_unknown_finish_reasons_raise(reason):
    # Treated like "length" they would keep the template's closing after a sampled <|im_end|>
    # (two end-of-turn tokens in the training context); the builder refuses them instead.
    tok = tiny_tokenizer()
    ep = EpisodeBuilder(tok, MESSAGES)
    c = fake_completion(tok, "Done.")  # ends with the sampled <|im_end|>
    c.finish_reason = reason
    before = list(ep.segment.token_ids)
    with pytest.raises(ValueError, match="unknown finish_reason"):
        ep.add_completion(c)
    assert ep.segment.token_ids == before  # nothing appended
    ep.add_completion(fake_completion(tok, "Done."))  # the builder is still usable
    with pytest.raises(ValueError, match="unknown finish_reason"):
        Completion([5], [-0.1], reason, 0)  # an engine adapter cannot even build one
