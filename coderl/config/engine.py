"""The ``engine`` section: what rollouts sample from (``torch`` in-process or a ``vllm``
server)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coderl.config._base import _Section


class EngineConfig(_Section):
    kind: Literal["torch", "vllm"] = "torch"
    """Rollout engine: ``torch`` (coderl's in-process sampler) or ``vllm`` (a vLLM server; LoRA
    weights synced per version, see ``coderl.policy.rollout``)."""
    url: str | None = None
    """URL of a running vLLM server (e.g. on a GPU node); None: coderl starts one from
    ``.venv-vllm`` (``make vllm``) and stops it at the end."""
    python: str | None = None
    """Interpreter that starts the server (None: ``$CODERL_VLLM_PYTHON`` or ``.venv-vllm``)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Sampling precision; the trainer stays fp32 (asymmetric precision). ``torch``: sample from
    the policy's weights (float32) or from a bf16 copy kept current
    (``coderl.policy.precision``); ``vllm``: the server's weight dtype. ``auto``: bfloat16 iff
    the device has bf16 units (CPU flags avx512_bf16 / amx_bf16; CUDA bf16 support), else
    float32. With bf16 the behaviour logprobs differ from the trainer's (logged as
    ``logprob_gap``); keep ``algorithm.old_logp=trainer`` with importance weights to correct it."""
    max_model_len: int = Field(2048, ge=64)
    """Context length (prompt + completion) of a server coderl starts."""
    kv_cache_gib: int = Field(2, ge=1)
    """KV-cache memory of a server coderl starts on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    prefix_caching: bool = True
    """``vllm``: reuse the KV of prompt prefixes the server has seen (``--enable-prefix-caching``;
    keyed by the adapter too, so a new version never reads an old one's KV)."""
    prefix_cache_mib: float = Field(1024.0, ge=0)
    """``torch``: MiB of KV kept across sampling calls so that an agent's next turn prefills only
    its new tokens (``coderl.policy.prefixcache``; 0 turns it off; static backend only)."""
    served_name: str = "coderl-base"
    """The server's name for the base model."""
    ready_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for a started server to answer ``/health``."""
    request_timeout_s: float = Field(600.0, gt=0)
    """HTTP timeout of one request."""
    max_loras: int = Field(2, ge=1)
    """LoRA adapters the vLLM server holds in its batch at once (``--max-loras``): two versions
    are in flight during a sync; with ``online.populations`` set it to the populations served
    side by side plus two (vLLM swaps the others in from CPU memory, which costs time)."""
    canary_max_gap: float | None = Field(None, gt=0)
    """Largest mean |logprob gap| (nats) between engine and trainer on the probe after a sync;
    more stops the run. None: 1e-3 with ``dtype=float32`` (measured gaps ~1e-5), 0.1 with
    ``bfloat16`` (SmolLM2 measured 3.3e-2 against the fp32 trainer: in bf16 the canary catches a
    wrong or missing adapter, not a one-step-stale one)."""

    def canary_gap(self, dtype: str | None = None) -> float:
        """``canary_max_gap`` with its default for the server's resolved ``dtype`` (default:
        ``self.dtype``) filled in."""
        if self.canary_max_gap is not None:
            return self.canary_max_gap
        return 1e-3 if (dtype or self.dtype) == "float32" else 0.1
