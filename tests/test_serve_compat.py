"""``coderl serve`` accepts what OpenAI clients send at values that change nothing, and refuses
the rest in OpenAI's one-line error shape (never pydantic's wording); ``content: null`` only on
an assistant message with tool calls. Driven through the official ``openai`` client where it can
send the request, else with the JSON it would send."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from openai import OpenAI

from coderl.agent.parsing import CALL_FORMATS
from coderl.agent.scripted import ScriptedPolicy
from coderl.agent.tools import TOOLS as HARNESS_TOOLS
from coderl.endpoint.http import BackgroundServer
from coderl.online.server import InteractionServer
from coderl.online.store import Store
from coderl.policy import load_policy

USER = [{"role": "user", "content": "fix the bug"}]
TOOLS = [HARNESS_TOOLS["write_file"].schema]
PYDANTIC_WORDS = ("Input should", "Extra inputs", "validation error", "Field required", "type=")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1M-parameter model gains nothing from more on busy cores
    yield
    torch.set_num_threads(n)


def _server(tmp: Path, policy, **kw):
    store = Store(f"sqlite:///{tmp / 'online.db'}")
    srv = InteractionServer(policy, store, version=0, model_name="tiny", **kw)
    return store, BackgroundServer(srv.app())


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory):
    """tiny-random sampling for real: a seeded sample depends on every sampling setting."""
    policy = load_policy("tiny-random", reference=False)
    store, bg = _server(tmp_path_factory.mktemp("compat"), policy, max_new_tokens=6)
    yield store, bg, OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    bg.stop()


def _post(bg: BackgroundServer, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        bg.base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _refused(status: int, body: dict, field: str) -> str:
    """The message of a 400 in OpenAI's shape whose ``param`` is ``field``."""
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", 400, field), err
    msg = err["message"]
    assert "\n" not in msg and not any(w in msg for w in PYDANTIC_WORDS), msg
    return msg


# What OpenAI clients send (the SDK's create() keywords, and vLLM's through extra_body) at the
# value that changes nothing about the sample, or fields that are bookkeeping only.
NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "metadata": {"run": "first-day"},
    "store": False,
    "parallel_tool_calls": True,
    "user": "alice",  # an end-user id; no own route, so the shared one answers
    "stream_options": {"include_usage": True},  # without stream it changes nothing
    "service_tier": "auto",
    "response_format": {"type": "text"},
    "n": 1,
    "logprobs": False,
    "top_logprobs": 0,
    "stop": None,
    "tool_choice": "auto",
    "modalities": ["text"],
    "reasoning_effort": None,
    "prompt_cache_key": "k",
    "safety_identifier": "u-1",
    "prediction": {"type": "content", "content": "x"},
}
VLLM_NEUTRAL = {
    "top_k": -1,
    "min_p": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "chat_template_kwargs": {},
}


def test_neutral_fields_are_accepted_and_the_sample_is_unchanged(sampled) -> None:
    store, _, client = sampled
    kw = {"model": "tiny", "messages": USER, "seed": 7, "temperature": 1.0, "max_tokens": 6}
    base = client.chat.completions.create(**kw)
    [ref] = store.interactions(ids=[base.id])
    cases = [({k: v}, {}) for k, v in NEUTRAL.items()]
    cases += [({}, {k: v}) for k, v in VLLM_NEUTRAL.items()]
    cases += [({**NEUTRAL}, {**VLLM_NEUTRAL})]  # all at once
    for direct, extra in cases:
        r = client.chat.completions.create(**kw, **direct, extra_body=extra or None)
        [row] = store.interactions(ids=[r.id])
        what = direct or extra
        assert row["prompt_token_ids"] == ref["prompt_token_ids"], what
        assert row["completion_token_ids"] == ref["completion_token_ids"], what
        assert r.choices[0].message.content == base.choices[0].message.content, what
    # max_completion_tokens is max_tokens' newer name
    r = client.chat.completions.create(**{**kw, "max_tokens": None}, max_completion_tokens=6)
    assert store.interactions(ids=[r.id])[0]["completion_token_ids"] == ref["completion_token_ids"]


# A value that would change the answer, which coderl does not implement: refused, naming the
# field, the value and what is supported.
REFUSED = {
    "n": (2, "supported: 1"),
    "top_logprobs": (5, "supported: 0"),
    "frequency_penalty": (0.5, "supported: 0"),
    "presence_penalty": (-1, "supported: 0"),
    "logit_bias": ({"50256": -100}, "supported: {}"),
    "response_format": ({"type": "json_object"}, 'supported: {"type": "text"}'),
    "modalities": (["text", "audio"], 'supported: ["text"]'),
    "reasoning_effort": ("high", "supported: null"),
    "functions": ([{"name": "f", "parameters": {}}], "use tools"),
    "top_k": (40, "supported: -1 or 0"),
    "repetition_penalty": (1.2, "supported: 1"),
    "chat_template_kwargs": ({"enable_thinking": False}, "supported: {}"),
    "store": ("yes", "supported: true, false or null"),
    # honoured fields, at a value outside their range
    "temperature": (3, "allowed: a number from 0 to 2"),
    "top_p": (0, "allowed: a number above 0 and at most 1"),
    "max_tokens": (0, "allowed: a positive integer"),
    "seed": ("7", "allowed: an integer"),  # no coercion of strings, as OpenAI has it
    "tool_choice": (12, 'allowed: "auto" or "none"'),
    "stop": (["a", "b", "c", "d", "e"], "at most 4 non-empty strings"),
    "stream_options": ({"continuous_usage_stats": True}, '{"include_usage": true|false'),
    "logprobs": ("true", "allowed: true, false or null"),
}


def test_values_that_would_change_the_answer_are_refused_in_one_openai_line(sampled) -> None:
    store, bg, _ = sampled
    before = len(store.interactions())
    for field, (value, says) in REFUSED.items():
        status, body = _post(bg, {"model": "tiny", "messages": USER, field: value})
        msg = _refused(status, body, field)
        assert msg.startswith(f"{field}: {json.dumps(value)} "), msg
        assert says in msg, msg
    assert len(store.interactions()) == before  # nothing was sampled


def test_every_bad_field_is_named_in_one_line_through_the_openai_client(sampled) -> None:
    _, _, client = sampled
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=USER, n=2, temperature=3, extra_body={"guided_json": {}}
        )
    msg = err.value.body["message"]
    assert err.value.body["param"] == "temperature"
    assert msg.startswith("temperature: 3 is not allowed; allowed: a number from 0 to 2")
    assert "n: 2 is not supported; supported: 1" in msg
    # an unknown field is refused, as OpenAI refuses it, listing what is accepted
    assert "guided_json: unknown field" in msg and "frequency_penalty" in msg
    assert not any(w in msg for w in PYDANTIC_WORDS)


@pytest.mark.parametrize(
    ("messages", "where", "says"),
    [
        (
            [{"role": "user", "content": None}],
            "messages.0.content",
            "null or absent in the user message",
        ),
        ([{"role": "user"}], "messages.0.content", "in the user message"),
        (
            [{"role": "system", "content": None}, *USER],
            "messages.0.content",
            "in the system message",
        ),
        (
            [*USER, {"role": "assistant", "content": None}, *USER],
            "messages.1.content",
            "null or absent in the assistant message",
        ),
        (
            [
                *USER,
                {"role": "assistant", "content": "ok"},
                {"role": "tool", "tool_call_id": "c", "content": None},
            ],
            "messages.2.content",
            "in the tool message",
        ),
        ([{"role": "user", "content": 5}], "messages.0.content", "5 in the user message"),
    ],
)
def test_null_content_is_refused_outside_an_assistant_tool_call_turn(
    sampled, messages, where, says
) -> None:
    _, _, client = sampled
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    body = err.value.body
    assert body["param"] == where and says in body["message"], body
    assert "only an assistant message with tool_calls may leave it null" in body["message"] or (
        "supported: a string or a list of" in body["message"]
    )


def test_null_content_is_accepted_on_an_assistant_turn_with_tool_calls(sampled) -> None:
    _, _, client = sampled
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "write_file", "arguments": '{"path": "a.py", "content": "x"}'},
    }
    msgs = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "wrote a.py"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parallel_tool_calls_false_answers_and_records_only_the_first_call(tmp_path) -> None:
    tok = load_policy("tiny-random", reference=False).tokenizer
    hermes = CALL_FORMATS["hermes"]
    first = hermes.format_call("write_file", {"path": "a.py", "content": "x = 1"})
    second = hermes.format_call("write_file", {"path": "b.py", "content": "y = 2"})
    policy = ScriptedPolicy(tok, lambda _: f"Two edits.\n{first}\n{second}")
    store, bg = _server(tmp_path, policy, max_new_tokens=256, call_format="hermes")
    client = OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
    try:
        kw = {"model": "tiny", "messages": USER, "tools": TOOLS}
        both = client.chat.completions.create(**kw)
        one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    finally:
        bg.stop()
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["write_file"] * 2
    [call] = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"path": "a.py", "content": "x = 1"}
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.choices[0].message.content == "Two edits."
    whole, cut = (store.interactions(ids=[r.id])[0] for r in (both, one))
    k = len(cut["completion_token_ids"])
    assert 0 < k < len(whole["completion_token_ids"])  # what was answered is what is recorded
    assert cut["completion_token_ids"] == whole["completion_token_ids"][:k]
    assert cut["tool_call_status"] == "valid"
    assert "b.py" not in tok.decode(cut["completion_token_ids"])
