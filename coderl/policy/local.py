"""The local torch policy: sampling, trainer-side logprobs, LoRA or full fine-tuning, a
reference policy and versioned weights, all on one in-process model.

Who calls what:

- the agent harness: :meth:`LocalPolicy.generate` (token-id prompts in, completions with exact
  logprobs out) and the tokenizer's chat template via :class:`coderl.policy.episode.EpisodeBuilder`;
- the trainer: :func:`coderl.policy.batch.collate` then :meth:`LocalPolicy.forward` /
  :meth:`LocalPolicy.forward_logprobs` (with grad), :meth:`LocalPolicy.reference_logprobs`
  (no grad), the optimizer over :meth:`LocalPolicy.trainable_parameters`, then
  :meth:`LocalPolicy.bump_version` after every optimizer step. Every one of these logprobs
  (and :meth:`LocalPolicy.logprob_gap`) comes from the one trainer forward,
  :func:`coderl.policy.forward.forward`.

Reference policy: with LoRA it is the same model with the adapter disabled (peft's
``disable_adapter``; no second copy in memory); with full fine-tuning it is a frozen deep copy
made at construction, optionally kept on another device (``reference_device="cpu"`` offloads it
from an accelerator). The model stays in eval mode (no dropout), so sampling and training see the
same function.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor

from coderl import algorithms as A
from coderl.config import EngineConfig
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.batch import TrainBatch, collate
from coderl.policy.engine import BetweenChunks, TorchEngine
from coderl.policy.forward import forward
from coderl.policy.precision import LowPrecisionSampler, resolve_precision
from coderl.rundir import honour_umask
from coderl.trajectory import Segment

DEFAULT_PREFIX_CACHE_MIB: float = EngineConfig.model_fields["prefix_cache_mib"].default
"""KV cache kept across sampling calls by default, ``engine.prefix_cache_mib``'s default (1024:
SmolLM2-135M holds ~45 KiB per token in fp32, so about 23k tokens, six 3.5k-token windows)."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapter settings (Hu et al. 2021, "LoRA", Sec. 4.1: ``W + (alpha / r) * B A``)."""

    rank: int = 16
    """Rank ``r`` of the update ``B A``."""
    alpha: float = 32.0
    """Scale numerator: the update is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter input; keep 0 so sampling and training see the same function."""
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Names of the linear layers that get adapters (Llama/Qwen2 naming)."""


@dataclass
class TokenOutputs:
    """Per-token results of a forward pass, aligned to tokens (see :mod:`coderl.policy.batch`).

    - ``logprobs``: ``[B, T]`` float32, differentiable; 0 where a token is not scored.
    - ``entropy``: ``[B, T]`` float32 nats of the tempered next-token distribution, or None.
    """

    logprobs: Tensor
    entropy: Tensor | None = None


class LocalPolicy:
    """A Hugging Face causal LM behind coderl's policy interface (see the module docstring).

    Args:
        model: a ``*ForCausalLM`` with plain (not quantized) weights.
        tokenizer: its tokenizer; its chat template renders conversations.
        lora: adapter settings, or None for full fine-tuning.
        adapter: a directory saved by :meth:`save` with LoRA on, to resume its adapter.
        reference: keep a reference policy (a frozen copy for full fine-tuning; free with LoRA).
        reference_device: device for the full fine-tuning reference copy (None: the model's).
        engine: the sampling backend, a name in :data:`coderl.policy.engine.BACKENDS` or
            ``"auto"``.
        name: where the model came from, for provenance.
        sampler_precision: ``"float32"`` (sample from the trainer's weights), ``"bfloat16"`` (from
            a bf16 copy kept current, :class:`coderl.policy.precision.LowPrecisionSampler`) or
            ``"auto"`` (bf16 iff the device has bf16 units); see :meth:`set_sampler_precision`.
        prefix_cache_mib: MiB of KV cache kept across :meth:`generate` calls so that an agent's
            next turn prefills only its new tokens (:mod:`coderl.policy.prefixcache`; static
            backend only); 0 turns it off. See :meth:`set_prefix_cache`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        lora: LoraSpec | None = None,
        adapter: str | os.PathLike[str] | None = None,
        reference: bool = True,
        reference_device: str | torch.device | None = None,
        engine: str = "auto",
        name: str = "",
        sampler_precision: str = "float32",
        prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
    ):
        self.tokenizer = tokenizer
        self.name = name
        self.version = 0
        self.lora = lora
        self.reference_model: torch.nn.Module | None = None
        model.eval()
        if adapter is not None:
            self.model: torch.nn.Module = PeftModel.from_pretrained(
                model, adapter, is_trainable=True
            )
            self.lora = _spec_of(self.model)  # the loaded adapter's settings, not the caller's
        elif lora is not None:
            config = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                task_type="CAUSAL_LM",
            )
            self.model = get_peft_model(model, config)
        else:
            self.model = model
            if reference:
                ref = copy.deepcopy(model).requires_grad_(False).eval()
                self.reference_model = ref.to(reference_device) if reference_device else ref
        self.has_reference = reference
        self.model.eval()
        self.eos_token_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else self.eos_token_ids[0]
        self.engine_backend = engine
        self.engine: TorchEngine
        self.low_precision: LowPrecisionSampler | None = None
        self._sampled_version = 0  # the version the last generate call sampled
        self.prefix_cache_mib = _check_mib(prefix_cache_mib)
        self.set_sampler_precision(sampler_precision)

    def set_prefix_cache(self, mib: float) -> None:
        """Bound the KV kept for reuse across :meth:`generate` calls to ``mib`` MiB (0: off).

        A fresh engine is made, so what was cached is dropped. Reuse changes no token and no
        logprob beyond floating-point summation order (:mod:`coderl.policy.prefixcache`).

        Raises:
            ValueError: a negative ``mib``.
        """
        self.prefix_cache_mib = _check_mib(mib)
        self._make_engine(self.engine.model)

    def forget_prefixes(self, sequences: Sequence[Sequence[int]]) -> int:
        """Drop the cached KV of an ended episode's context windows (their token ids); returns
        how many cache entries were dropped."""
        return self.engine.forget([list(s) for s in sequences])

    def _make_engine(self, model: torch.nn.Module) -> None:
        self.engine = TorchEngine(
            model,
            self.eos_token_ids,
            self.pad_token_id,
            backend=self.engine_backend,
            prefix_cache_bytes=int(self.prefix_cache_mib * 2**20),
        )

    def set_sampler_precision(self, precision: str) -> torch.dtype:
        """Sample from the trainer's weights (``"float32"``) or from a bf16 copy of them
        (``"bfloat16"``; ``"auto"``: bf16 iff :func:`coderl.policy.precision.has_bf16_units`).

        The trainer's forward (:meth:`forward`, :meth:`logprob_gap`, the reference) stays on the
        trainer's weights in their own dtype; only :meth:`generate` changes. With a bf16 sampler
        the completions' logprobs are the bf16 function's, so they differ from the trainer's:
        train with ``algorithm.old_logp=trainer`` and importance weights to correct it (see
        :mod:`coderl.policy.precision`). Costs one bf16 copy of the model in memory.

        Returns:
            The dtype sampling now uses.

        Raises:
            ValueError: an unknown precision (lists the valid ones).
        """
        dtype = resolve_precision(precision, self.device)
        weights = next(self.model.parameters()).dtype
        if dtype == weights:
            self.low_precision = None
            model = self.model
        else:
            if self.low_precision is None or self.low_precision.dtype != dtype:
                self.low_precision = LowPrecisionSampler(self.model, dtype)
            model = self.low_precision.model
        self._make_engine(model)
        return dtype

    @property
    def sampler_dtype(self) -> torch.dtype:
        """The dtype :meth:`generate` samples in."""
        if self.low_precision is not None:
            return self.low_precision.dtype
        return next(self.model.parameters()).dtype

    @property
    def is_lora(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- sampling -------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        between_chunks: BetweenChunks | None = None,
        chunk_tokens: int = 0,
    ) -> list[Completion]:
        """Sample one completion per token-id prompt with the current weights.

        Every completion carries ``policy_version = self.version``; see
        :class:`~coderl.policy.engine.TorchEngine` for the logprob and finish-reason contract.
        With a bf16 sampler the copy first takes up any trainable weight that changed.

        In-flight weight updates: every ``chunk_tokens`` decode steps ``between_chunks()`` runs;
        it may load new weights into this policy (and set :attr:`version`), the bf16 copy then
        takes them up, and the engine recomputes the running rows' KV cache under them
        (:meth:`TorchEngine.generate`); tokens carry their version in
        ``Completion.token_versions``.
        """
        if self.low_precision is not None:
            self.low_precision.refresh(force=self.version != self._sampled_version)
        self._sampled_version = self.version
        swap = None if between_chunks is None else functools.partial(self._swap, between_chunks)
        return self.engine.generate(
            prompts, params, version=self.version, between_chunks=swap, chunk_tokens=chunk_tokens
        )

    def _swap(self, between_chunks: BetweenChunks) -> int:
        """A chunk boundary: ``between_chunks`` may load new weights; the bf16 copy takes them
        up; returns the version sampling continues with."""
        between_chunks()
        if self.low_precision is not None and self.version != self._sampled_version:
            self.low_precision.refresh(force=True)
        self._sampled_version = self.version
        return self.version

    # --- trainer side ---------------------------------------------------------------------

    def forward(
        self, batch: TrainBatch, temperature: float = 1.0, *, with_entropy: bool = False
    ) -> TokenOutputs:
        """Differentiable per-token logprobs (and optionally entropy) of a collated batch's
        sampled tokens, from :func:`coderl.policy.forward.forward`.

        ``logprobs[b, t] = log softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]`` where
        ``loss_mask[b, t]`` is 1, 0 elsewhere: the same tempered distribution the sampler drew
        from; pass the rollout's temperature.

        Args:
            batch: from :func:`coderl.policy.batch.collate`.
            temperature: > 0 (use 1.0 for greedy rollouts).

        Returns:
            :class:`TokenOutputs` with ``[B, T]`` float32 tensors on the policy's device;
            gradients flow into :meth:`trainable_parameters`.

        Raises:
            ValueError: non-positive temperature.
        """
        out = forward(self.model, batch.to(self.device), temperature=temperature)
        return TokenOutputs(logprobs=out.logp, entropy=out.entropy if with_entropy else None)

    def forward_logprobs(self, batch: TrainBatch, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` float32 differentiable logprobs; see :meth:`forward`."""
        return self.forward(batch, temperature).logprobs

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` float32 logprobs of the sampled tokens under the reference policy (no
        grad), aligned as :meth:`forward`'s and from the same forward function; on the
        reference's device.

        Raises:
            RuntimeError: the policy was built with ``reference=False``.
        """
        if not self.has_reference:
            raise RuntimeError("this policy was loaded with reference=False")
        if self.reference_model is None:  # LoRA: the base model is the reference
            assert isinstance(self.model, PeftModel)
            with self.model.disable_adapter():
                return forward(self.model, batch.to(self.device), temperature=temperature).logp
        ref_device = next(self.reference_model.parameters()).device
        return forward(self.reference_model, batch.to(ref_device), temperature=temperature).logp

    @torch.no_grad()
    def logprobs(
        self, sequences: Sequence[Sequence[int]], temperature: float = 1.0, *, batch_size: int = 16
    ) -> list[list[float]]:
        """Trainer-side logprobs of whole token sequences, one float per token.

        Entry ``t`` of a sequence's list is ``log p(seq[t] | seq[:t])`` under the tempered
        current policy; entry 0 (no prefix) is 0.0.

        Raises:
            ValueError: an empty sequence or a non-positive temperature.
        """
        out: list[list[float]] = []
        for i in range(0, len(sequences), batch_size):
            chunk = sequences[i : i + batch_size]
            segs = []
            for s in chunk:
                seg = Segment()
                seg.append_context(list(s), kind="prompt")
                segs.append(seg)
            batch = collate(segs, self.pad_token_id).to(self.device)
            every = (batch.attention_mask > 0) & (batch.position_ids > 0)  # all but token 0
            lp = forward(self.model, batch, temperature=temperature, at=every).logp
            out.extend(lp[b, : len(s)].tolist() for b, s in enumerate(chunk))
        return out

    @torch.no_grad()
    def logprob_gap(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Completion],
        temperature: float = 1.0,
        *,
        batch_size: int = 16,
    ) -> dict[str, float]:
        """Sampler/trainer mismatch over the sampled tokens of ``completions``: the trainer
        forward on prompt + completion, reduced by :func:`coderl.algorithms.logprob_gap`.

        Returns:
            ``logprob_gap`` (mean ``|sampler - trainer|`` logprob, nats), ``logprob_gap_max`` and
            ``logprob_gap_kl``; the gap is below 1e-3 in fp32 with the same weights (see
            ``tests/test_policy_sampling.py``).
        """
        train: list[Tensor] = []
        behaviour: list[Tensor] = []
        pairs = list(zip(prompts, completions, strict=True))
        for i in range(0, len(pairs), batch_size):
            segs = []
            for p, c in pairs[i : i + batch_size]:
                seg = Segment()
                seg.append_context(list(p), kind="prompt")
                seg.append_sampled(c.token_ids, c.logprobs, c.versions())
                segs.append(seg)
            batch = collate(segs, self.pad_token_id).to(self.device)
            lp = forward(self.model, batch, temperature=temperature).logp  # (b, T)
            m = batch.loss_mask > 0
            train.append(lp[m])
            behaviour.append(batch.behavior_logprobs[m])
        t = torch.cat(train) if train else torch.zeros(0)
        b = torch.cat(behaviour) if behaviour else torch.zeros(0)
        return A.logprob_gap(t, b, torch.ones_like(t))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA adapters only, or every weight)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def bump_version(self) -> int:
        """Call after every optimizer step: the weights changed, so their version does too.

        Returns:
            The new version (completions sampled afterwards carry it).
        """
        self.version += 1
        return self.version

    # --- persistence ----------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the weights as safetensors, plus the tokenizer, into directory ``path``.

        With LoRA only the adapter is written (``adapter_model.safetensors`` and its config;
        reload with ``load_policy(base, adapter=path)``); otherwise the full model
        (``model.safetensors``; reload with ``load_policy(path)``). A ``coderl_policy.txt`` records
        the source model and the weight version.
        """
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        with open(os.path.join(path, "coderl_policy.txt"), "w") as f:
            f.write(f"source: {self.name}\nversion: {self.version}\nlora: {self.is_lora}\n")
        honour_umask(path)  # safetensors leaves its temporary file's 0600


def _check_mib(mib: float) -> float:
    if not mib >= 0:
        raise ValueError(f"prefix_cache_mib must be >= 0, got {mib}")
    return float(mib)


def _spec_of(model: PeftModel) -> LoraSpec:
    """The :class:`LoraSpec` of a loaded peft adapter (its ``adapter_config.json``)."""
    c = model.peft_config[model.active_adapter]
    modules = c.target_modules
    targets = tuple(sorted(modules)) if isinstance(modules, (set, list, tuple)) else (modules,)
    return LoraSpec(
        rank=c.r, alpha=float(c.lora_alpha), dropout=c.lora_dropout, target_modules=targets
    )


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models add one)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    for i in extra if isinstance(extra, list) else [extra]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token; cannot stop generation")
    return ids
