"""The ``algorithm`` and ``dynamic_sampling`` sections: the advantage estimator, the policy loss,
its KL leash and importance weights, and what happens to groups without signal.

Each field is documented once, under the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from coderl.config._base import _Section


class KLConfig(_Section):
    coef: float = Field(0.0, ge=0)
    """KL coefficient beta in the loss (0: no KL in the loss)."""
    estimator: Literal["k2"] = "k2"
    """Per-token KL estimator of the loss term: only ``k2``, whose gradient on the policy's own
    samples is ``grad KL(pi || ref)``; k3 differentiated as a loss follows ``grad KL(ref || pi)``
    and k1's gradient is 0 in expectation (Tang & Munos 2025; see
    ``coderl.algorithms.kl_penalty``). For a k1 KL, use ``reward.terms.kl``."""

    @field_validator("estimator", mode="before")
    @classmethod
    def _loss_estimator(cls, v: Any) -> Any:
        if v in ("k1", "k3"):
            raise ValueError(
                f"{v} is not a KL loss: its gradient is not grad KL(pi || ref) (k1: 0 in "
                "expectation, k3: grad KL(ref || pi)); use k2 here, or the k1 KL-in-reward term "
                "(reward.terms.kl with reward.kl_coef)"
            )
        return v


def _off(v: Any) -> Any:
    """YAML 1.1 reads a bare ``off`` (in a preset or a ``key=off`` override) as False: that is
    the ``"off"`` mode, not an error."""
    return "off" if v is False else v


class ImportanceConfig(_Section):
    level: Literal["token", "sequence"] = "token"
    """One weight per token, or the geometric mean per sequence."""
    mode: Literal["off", "truncate", "mask"] = "truncate"
    """Correction of sampler/trainer mismatch; ``off`` uses no weights."""
    _mode = field_validator("mode", mode="before")(_off)
    cap: float = Field(2.0, gt=0)
    """Upper bound of the weights."""
    low: float | None = Field(None, ge=0)
    """Lower bound (None: none)."""


class AlgorithmConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae", "vineppo"] = "grpo"
    """Advantage estimator: group baselines, GAE with a value head (PPO), or ``vineppo``:
    per-turn advantages from Monte-Carlo values of continuations (``rollout.branch``)."""
    turn_lam: float = Field(0.0, ge=0, le=1)
    """``vineppo``: GAE lambda over turns (0: VinePPO's ``V(s_{t+1}) - V(s_t)``); the discount
    per turn is ``gamma``."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses are reduced, see ``coderl.algorithms.aggregate``."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip range below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO clip range above 1 (clip-higher when > ``clip_low``)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c for negative advantages (None: off)."""
    old_logp: Literal["behaviour", "trainer"] = "trainer"
    """Ratio denominator: the sampler's behaviour logprobs, or the trainer's own logprobs before
    the update (then importance weights correct the sampler/trainer mismatch)."""
    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    """Importance weights for sampler/trainer mismatch (used with ``old_logp=trainer``)."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL-in-loss to the reference policy."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient (0: entropy is only logged)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    value_coef: float = Field(0.5, ge=0)
    """Weight of the value loss (PPO)."""
    value_clip: float | None = Field(0.2, ge=0)
    """Value clipping range (None: off)."""
    value_lr: float = Field(1e-3, gt=0)
    """Learning rate of the value head."""


class DynamicSamplingConfig(_Section):
    mode: Literal["off", "drop", "resample"] = "off"
    """Groups whose rewards have zero variance: keep, drop, or drop and sample new tasks."""
    _mode = field_validator("mode", mode="before")(_off)
    max_resample: int = Field(2, ge=0)
    """Extra rounds of task sampling per step in ``resample`` mode."""
