"""``ScriptedPolicy``: replays fixed assistant messages through a real tokenizer.

It drives the harness in tests and demonstrations without a model. Each message is tokenized
with the policy's tokenizer and followed by the end-of-turn stop token, so the trajectories it
produces are token-exact like a model's. A scripted policy is deterministic: every replayed token
has probability 1, so its behaviour logprobs are 0.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from coderl.policy.base import Completion, SamplingParams


class ScriptedPolicy:
    """A :class:`coderl.policy.base.Policy` that answers with scripted text.

    Args:
        tokenizer: the tokenizer whose chat template the harness renders with.
        script: assistant messages replayed in order, one per prompt (across all episodes of a
            batch, in prompt order), or a function from the decoded prompt to the reply (for
            concurrent episodes that each follow their own script).
        version: the ``policy_version`` stamped on every completion.

    Raises (from ``generate``):
        IndexError: the script has no message left (the message says how many were used).
    """

    def __init__(
        self, tokenizer: Any, script: Sequence[str] | Callable[[str], str], version: int = 0
    ):
        self.tokenizer = tokenizer
        self.version = version
        self._script = script
        self._next = 0
        self.prompts: list[list[int]] = []
        """Every prompt it was asked to continue, in order."""
        self.batch_sizes: list[int] = []
        """Number of prompts of each ``generate`` call."""

    def _reply(self, prompt: list[int]) -> str:
        if callable(self._script):
            return self._script(self.tokenizer.decode(prompt, skip_special_tokens=False))
        if self._next >= len(self._script):
            raise IndexError(f"ScriptedPolicy ran out of messages after {len(self._script)}")
        self._next += 1
        return self._script[self._next - 1]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Tokenize the next scripted message per prompt, add the first stop token, cut to
        ``params.max_new_tokens`` (``finish_reason="length"`` when cut)."""
        self.batch_sizes.append(len(prompts))
        stop = params.stop_token_ids[0] if params.stop_token_ids else self.tokenizer.eos_token_id
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            ids = [*self.tokenizer.encode(self._reply(prompt), add_special_tokens=False), stop]
            cut = ids[: params.max_new_tokens]
            reason = "stop" if len(cut) == len(ids) else "length"
            out.append(Completion(cut, [0.0] * len(cut), reason, self.version))
        return out
