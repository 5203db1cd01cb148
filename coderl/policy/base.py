"""The policy interface seen by the harness and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class SamplingParams:
    """How to sample one completion per prompt."""

    temperature: float = 1.0
    """Softmax temperature (>= 0); logprobs are reported under the tempered distribution.
    0 means greedy decoding, with logprobs under the untempered (temperature 1) softmax."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]. Reported logprobs stay those of the full tempered
    distribution (what the trainer recomputes); use 1.0 when training on the samples."""
    max_new_tokens: int = 256
    """Budget of generated tokens per completion."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after sampling any of these (the EOS id is always a stop token)."""
    seed: int | None = None
    """Seed for the sampler's RNG; equal seeds give equal samples."""
    ignore_eos: bool = False
    """Keep sampling past EOS until ``max_new_tokens`` (for benchmarks); explicit stop ids
    still stop."""


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int] = field(default_factory=list)
    """The sampled token ids (the stop token included when one was sampled)."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each sampled token under the distribution it was sampled from."""
    finish_reason: str = "length"
    """``"stop"`` (a stop token was sampled, it is the last id) or ``"length"`` (budget
    exhausted); any other value (an engine's ``"abort"``, ``"tool_calls"``, ``""``, None)
    raises at construction and again where completions are consumed (the field may be
    reassigned), see :func:`check_finish_reason`."""
    policy_version: int = 0
    """Weight version the completion started with (that produced its first token)."""
    token_versions: list[int] = field(default_factory=list)
    """Weight version that produced each sampled token, aligned with ``token_ids``; it changes
    inside a completion only with in-flight weight updates (``between_chunks`` of
    :meth:`coderl.policy.engine.TorchEngine.generate`). Empty: every token carries
    ``policy_version`` (engines that never swap weights mid-completion leave it so)."""

    def __post_init__(self) -> None:
        check_finish_reason(self)  # at construction too: an engine adapter fails where it maps

    def versions(self) -> list[int]:
        """The weight version of every sampled token (``[len(token_ids)]`` ints).

        Raises:
            ValueError: ``token_versions`` is set but not aligned with ``token_ids``.
        """
        if not self.token_versions:
            return [self.policy_version] * len(self.token_ids)
        if len(self.token_versions) != len(self.token_ids):
            raise ValueError(
                f"{len(self.token_ids)} sampled tokens but {len(self.token_versions)} versions"
            )
        return list(self.token_versions)


FINISH_REASONS = ("stop", "length")
"""The finish reasons a :class:`Completion` may carry."""


def check_finish_reason(completion: Completion) -> Completion:
    """``completion`` itself if its ``finish_reason`` is one of :data:`FINISH_REASONS`.

    The reason decides how the training context continues after the sampled ids: after
    ``"stop"`` the sampled stop token already closes the turn, after ``"length"`` the harness
    appends the closing. Guessing for any other reason would either train on a context with the
    end-of-turn token twice or miss it, so it is an engine fault and raises.

    Raises:
        ValueError: an unknown finish reason (lists the valid ones).
    """
    if completion.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"unknown finish_reason {completion.finish_reason!r}; valid: {list(FINISH_REASONS)} "
            "(an engine that aborts or stops for another reason must not hand the completion on)"
        )
    return completion


class Engine(Protocol):
    """A rollout engine: the only part a vLLM / SGLang / OpenAI-compatible server would replace.

    ``generate`` samples one completion per token-id prompt with the engine's current weights and
    stamps every completion with ``version``, the weight version those weights carry.
    """

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0
    ) -> list[Completion]: ...


class Policy(Protocol):
    """What the agent harness needs from a policy."""

    tokenizer: Any
    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


def context_limit(sampler: Any) -> int | None:
    """Tokens of one sequence (prompt plus completion) the sampler's model holds: a vLLM
    engine's ``max_model_len``, else the model's ``max_position_embeddings`` (None: unknown).
    The one check of a prompt against the engine's context, for every engine and driver: a
    prompt of ``context_limit`` tokens or more leaves no room to sample (the vLLM engine refuses
    it, the torch model has no positions for it), so the harness, the gateway and ``coderl
    serve`` end or refuse it before sampling."""
    engine = getattr(sampler, "engine", None)
    if isinstance(getattr(engine, "max_model_len", None), int):
        return int(engine.max_model_len)  # type: ignore[union-attr]
    model = getattr(getattr(sampler, "policy", sampler), "model", None)
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) else None
