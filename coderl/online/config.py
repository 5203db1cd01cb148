"""``coderl online`` configuration: one tree of pydantic sections, YAML presets in ``configs/``,
``key=value`` overrides (same rules as :mod:`coderl.config`: unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coderl.config import (
    AlgorithmConfig,
    ConfigError,
    ModelConfig,
    TrainerConfig,
    load_tree,
)
from coderl.online.baselines import check_baseline
from coderl.online.gate import GateConfig
from coderl.online.monitors import AlarmRule, default_alarm_rules
from coderl.online.rewards import RewardSpec
from coderl.online.suites import check_sandbox


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ServeSection(_Section):
    host: str = "127.0.0.1"
    """Interface to bind (keep loopback unless a proxy adds authentication)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0: any free port)."""
    temperature: float = Field(0.8, gt=0)
    """Default sampling temperature (> 0: greedy traffic teaches nothing); also the training
    temperature (interactions sampled at another temperature are excluded)."""
    max_new_tokens: int = Field(128, ge=1)
    """Default and maximum completion tokens per request."""


class EvalSection(_Section):
    suite: str = "humaneval"
    """Held-out suite (``humaneval``: its held-out split)."""
    limit: int | None = Field(None, ge=2)
    """First N held-out tasks (None: all 41); at least 2 (the gate's t bound needs a variance)."""
    samples: int = Field(1, ge=1)
    """Samples per task; the per-task score is their mean pass rate (pass@1 estimate)."""
    temperature: float = Field(0.8, gt=0)
    """Eval sampling temperature; both policies get the same seeds (paired comparison)."""
    max_new_tokens: int = Field(128, ge=1)
    """Completion budget per eval sample."""
    seed: int = 1234
    """Base seed of the eval samples."""


class MonitorSection(_Section):
    window_s: float = Field(6 * 3600.0, gt=0)
    """Trailing window of the monitors, seconds."""
    rules: list[AlarmRule] = Field(default_factory=default_alarm_rules)
    """Alarm rules on live traffic (watched = champion, reference = its predecessor)."""
    min_samples: int = Field(20, ge=1)
    """Fewest interactions per version and population for an alarm to be checked."""


class SimulateSection(_Section):
    enabled: bool = False
    """``coderl online run`` serves in-process and drives this population before each cycle."""
    clients: int = Field(4, ge=1)
    """Simulated users; client i belongs to population ``org-{i % populations}``."""
    populations: int = Field(2, ge=1)
    """Number of populations (segments for monitors and the running baseline)."""
    interactions_per_cycle: int = Field(16, ge=1)
    """Requests the population sends before each cycle."""
    tool_share: float = Field(0.5, ge=0, le=1)
    """Share of requests that offer the ``write_file`` tool."""
    drop_rate: float = Field(0.1, ge=0, le=1)
    """Share of interactions whose outcome events are never sent (censored when they edit)."""
    duplicate_rate: float = Field(0.1, ge=0, le=1)
    """Share of events sent twice (idempotency)."""
    malformed_rate: float = Field(0.05, ge=0, le=1)
    """Share of interactions that also send a malformed event (rejected and counted)."""
    seed: int = 0
    """Seed of the population's choices and of the sampling seeds it sends."""


class OnlineConfig(_Section):
    run_dir: str = "runs/online"
    """Where the registry, reports and (by default) the SQLite database live."""
    database: str | None = None
    """SQLAlchemy URL (``postgresql+psycopg://...``); None: SQLite at ``run_dir/online.db``."""
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(name="tiny-random", lora=False))
    """Base policy of version 0 and how it is trained (LoRA or full)."""
    serve: ServeSection = Field(default_factory=ServeSection)
    """The OpenAI-compatible endpoint."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Versioned reward spec (events -> reward)."""
    advantage: str = "running-segment"
    """Single-sample baseline: ``batch-norm`` or ``running-segment`` (group-normalised methods
    are rejected: production gives one sample per context)."""
    baseline_alpha: float = Field(0.1, gt=0, le=1)
    """EMA rate of the running per-segment baseline."""
    last_k_versions: int = Field(2, ge=1)
    """Train only on traffic of the last K promoted versions (near on-policy)."""
    min_batch: int = Field(8, ge=1)
    """Fewest trainable interactions for a cycle to train (otherwise it waits)."""
    max_batch: int = Field(64, ge=1)
    """Most interactions claimed per cycle."""
    algorithm: AlgorithmConfig = Field(
        default_factory=lambda: AlgorithmConfig(kl={"coef": 0.05}, old_logp="trainer")
    )
    """Loss settings (clipping, importance weights, KL to the champion); ``advantage`` unused."""
    trainer: TrainerConfig = Field(
        default_factory=lambda: TrainerConfig(steps=2, lr=1e-4, checkpoint_every=1)
    )
    """Optimizer settings; ``steps`` trainer steps per cycle."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Held-out evaluation of candidate and champion."""
    gate: GateConfig = Field(default_factory=GateConfig)
    """Non-inferiority margins and behaviour checks."""
    monitors: MonitorSection = Field(default_factory=MonitorSection)
    """Live-traffic monitors and alarms."""
    simulate: SimulateSection = Field(default_factory=SimulateSection)
    """The simulated client population (demo and tests)."""
    sandbox: str = "bwrap"
    """Where the hidden tests of the simulated population and the held-out eval run the model's
    code: ``bwrap`` (coderl.sandbox, isolated) or ``local`` (a plain subprocess with your
    permissions, filesystem and network: NOT isolated, warns; only for trusted models on hosts
    without bubblewrap)."""
    cycles: int = Field(1, ge=1)
    """Cycles of ``coderl online run``."""
    interval_s: float = Field(0.0, ge=0)
    """Seconds between cycle starts in ``coderl online run`` (0: back to back)."""

    @field_validator("advantage")
    @classmethod
    def _single_sample(cls, v: str) -> str:
        check_baseline(v)
        return v

    @field_validator("sandbox")
    @classmethod
    def _known_sandbox(cls, v: str) -> str:
        return check_sandbox(v)

    @model_validator(mode="after")
    def _check(self) -> OnlineConfig:
        if "advantage" in self.algorithm.model_fields_set:
            raise ValueError(
                "algorithm.advantage is not used online: production gives one sample per "
                "context, so group estimators (grpo, rloo, dr_grpo) are meaningless; set the "
                "top-level 'advantage' to a single-sample baseline (batch-norm, running-segment)"
            )
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch {self.min_batch} > max_batch {self.max_batch}")
        return self

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{Path(self.run_dir) / 'online.db'}"


def load_online_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> OnlineConfig:
    """Load a YAML preset (None: defaults) and apply ``key=value`` overrides.

    Raises:
        ConfigError: missing file, not a mapping, unknown keys, bad values (naming the key).
    """
    tree = load_tree(path, overrides)
    try:
        return OnlineConfig.model_validate(tree)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            msgs.append(f"{key}: {what}" if key else e["msg"])
        raise ConfigError("; ".join(msgs).replace("Value error, ", "")) from None
