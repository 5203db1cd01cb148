"""Token in, token out across the calls of one episode.

A client sends its whole conversation with every call, as text. Re-tokenizing the model's own
earlier replies need not give back the ids it sampled (byte-level tokens that are not valid
UTF-8, merges across a boundary, a tokenization that is not the canonical one): the prompt would
then differ from what was sampled, the segment would break, and the model would be shown text
it never wrote in tokens it never chose. So when a call carries the previous call's messages
unchanged, then the reply exactly as it was returned, then new turns (tool results, a user
message), its prompt is the previous prompt, the sampled ids, and the template's delta for the
new turns (:func:`coderl.policy.episode.template_delta`, the rule of the harness's own
episodes). Any other call (history rewritten, summarised, truncated, another set of tools, a
reply edited or cut at a ``stop`` string) is rendered whole, and starts a new segment
(:func:`coderl.endpoint.chat.trajectory_of`).

Limits: a reply is matched by its text and its calls (name and arguments); a client that
reformats the arguments of a call but keeps their values still matches, and its call is shown
as sampled. A template that rewrites earlier turns once new ones follow (e.g. one that drops
earlier reasoning) is rendered whole.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coderl.agent.context import ChatRenderer
from coderl.endpoint.calls import render_prompt
from coderl.policy.base import Completion
from coderl.policy.episode import encode, template_delta

Message = dict[str, Any]


@dataclass
class Turn:
    """What one call of an episode asked and got: what the next call may continue."""

    messages: list[Message]
    """The call's messages (content parts joined)."""
    tools: list[dict[str, Any]]
    """The tool schemas the model was shown (none: ``[]``)."""
    prompt_ids: list[int]
    completion: Completion
    content: str | None
    """The reply's ``content`` as returned."""
    calls: list[dict[str, Any]]
    """The reply's ``tool_calls`` as returned."""
    whole: bool
    """The reply carries the whole sample (False when it was cut at a ``stop`` string)."""


def _calls(calls: Any) -> list[tuple[str, Any]] | None:
    try:
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    except (KeyError, TypeError, ValueError):
        return None


def is_reply(message: Message, turn: Turn) -> bool:
    """Whether ``message`` is ``turn``'s reply as it was returned (content up to surrounding
    whitespace, calls by name and arguments)."""
    if message.get("role") != "assistant":
        return False
    if (message.get("content") or "").strip() != (turn.content or "").strip():
        return False
    return _calls(message.get("tool_calls") or []) == _calls(turn.calls)


def continued_prompt(
    turn: Turn | None,
    messages: Sequence[Message],
    tools: list[dict[str, Any]],
    renderer: ChatRenderer,
    *,
    call_format: str,
) -> list[int] | None:
    """The prompt ids of a call that continues ``turn`` (see the module docstring), or None
    when it does not."""
    if turn is None or not turn.whole or tools != turn.tools:
        return None
    n = len(turn.messages)
    if len(messages) <= n + 1 or list(messages[:n]) != turn.messages:
        return None
    if not is_reply(messages[n], turn):
        return None
    new = list(messages[n + 1 :])
    history = list(turn.messages)

    def rendered(msgs: list[Message], generation_prompt: bool) -> str:
        return render_prompt(
            renderer, msgs, call_format=call_format, add_generation_prompt=generation_prompt
        )

    if not rendered([*history, messages[n], *new], True).startswith(
        rendered([*history, messages[n]], False)
    ):
        return None  # the template rewrites earlier turns once new ones follow
    delta = template_delta(rendered, renderer.tokenizer, history, turn.completion, new)
    return [*turn.prompt_ids, *turn.completion.token_ids, *encode(renderer.tokenizer, delta)]
