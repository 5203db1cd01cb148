"""The ``online`` section: ``coderl serve`` and ``coderl online`` (serving, rewards from events,
the gate, monitors, the simulated population).

The plain data these sections are validated against lives here, below the code it configures:
the event types, the reward spec, the single-sample baseline names, the tool-call format names,
the house styles. Each module that implements them (``coderl.online.events``,
``coderl.online.baselines``, ``coderl.agent.parsing``, ``coderl.online.suites``) checks at its
import that its implementations match these names."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coderl.config._base import _Section

EVENT_TYPES = ("accepted", "rejected", "edit_persisted", "follow_up", "tool_error", "latency_ms")
"""The outcome event kinds (:mod:`coderl.online.events` defines one model per kind)."""
BASELINE_NAMES = ("batch-norm", "running-segment")
"""Single-sample advantage baselines (:data:`coderl.online.baselines.BASELINES` implements them)."""
GROUP_METHODS = ("grpo", "dr-grpo", "rloo", "group", "group-norm")
"""Group-normalised advantage names, refused for production traffic (one sample per context)."""
CALL_FORMAT_NAMES = ("hermes", "xml")
"""Tool-call formats (:data:`coderl.agent.parsing.CALL_FORMATS` implements them)."""

HOUSE_STYLE_NAMES = ("type_hints", "no_print", "docstrings")
"""The house styles a population may name (:data:`coderl.online.suites.HOUSE_STYLES` holds
their checks and is checked against these names at its import)."""
GRADING_SANDBOXES = ("bwrap",)
"""Where the simulated population's replies are graded: ``bwrap``, the sandbox of training's
grader (``coderl.grading.grade.grade``)."""


def check_baseline(name: str) -> None:
    """Raise unless ``name`` is a single-sample baseline (:data:`BASELINE_NAMES`).

    Raises:
        ValueError: a group-normalised method (with why it cannot work on production data) or
            an unknown name (listing the valid ones).
    """
    if name.lower() in GROUP_METHODS:
        raise ValueError(
            f"advantage baseline {name!r} is group-normalised: it compares several samples of "
            "the same prompt, but production traffic gives one sample per context, so every "
            "group has size 1 and every advantage would be 0. Use a single-sample baseline: "
            f"{sorted(BASELINE_NAMES)}"
        )
    if name not in BASELINE_NAMES:
        raise ValueError(f"unknown advantage baseline {name!r}; valid: {sorted(BASELINE_NAMES)}")


def check_call_format(name: str) -> str:
    """``name`` if it is one of :data:`CALL_FORMAT_NAMES`; ValueError listing them otherwise."""
    if name not in CALL_FORMAT_NAMES:
        raise ValueError(f"unknown tool-call format {name!r}; valid: {sorted(CALL_FORMAT_NAMES)}")
    return name


def _default_windows() -> dict[str, float]:
    return {
        "accepted": 900.0,
        "rejected": 900.0,
        "edit_persisted": 3600.0,
        "follow_up": 1800.0,
        "tool_error": 900.0,
        "latency_ms": 900.0,
    }


class RewardSpec(BaseModel):
    """Event -> reward mapping. Changing any field means a new ``version``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = "v1"
    """Name stored with every reward row; batches never mix versions."""
    accept: float = Field(default=0.5, ge=0)
    """Weight of the accepted (+1) / rejected (-1) signal."""
    persist: float = Field(default=1.0, ge=0)
    """Weight of edit persistence, mapped from fraction f in [0, 1] to 2f - 1."""
    follow_up: float = Field(default=0.5, ge=0)
    """Weight of follow-up sentiment (satisfied +1, neutral 0, dissatisfied -1)."""
    latency: float = Field(default=0.1, ge=0)
    """Weight of the latency penalty, -w * min(latency_ms / latency_scale_ms, 1)."""
    latency_scale_ms: float = Field(default=30_000.0, gt=0)
    """Latency (milliseconds) at which the latency penalty saturates."""
    broken_tool_call: float = -2.5
    """Reward of an episode with a broken tool call; must be below the deferral reward."""
    deferral: float | None = None
    """Reward of an episode without an edit; None means the worst edit reward (the cap)."""
    windows_s: dict[str, float] = Field(default_factory=_default_windows)
    """Join window per event type: seconds from the server recording the interaction to the
    server receiving the event (the server's clock); later events are ignored."""
    clock_skew_s: float = Field(default=5.0, ge=0)
    """Tolerance (seconds) between clocks: an event whose client ``occurred_at`` is before its
    interaction or after its receipt, or that a server received before another stored its
    interaction, by more than this, is not counted."""
    orphan_window_s: float = Field(default=3600.0, gt=0)
    """Events whose interaction has not arrived after this many seconds count as orphans."""

    @property
    def min_edit_reward(self) -> float:
        """Worst reward an edit can receive: every term at its minimum."""
        return -(self.accept + self.persist + self.follow_up + self.latency)

    @property
    def deferral_reward(self) -> float:
        return self.min_edit_reward if self.deferral is None else self.deferral

    @model_validator(mode="after")
    def _check(self) -> RewardSpec:
        missing = sorted(set(EVENT_TYPES) - set(self.windows_s))
        unknown = sorted(set(self.windows_s) - set(EVENT_TYPES))
        if missing or unknown:
            raise ValueError(
                f"windows_s must give one window per event type {list(EVENT_TYPES)}; "
                f"missing {missing}, unknown {unknown}"
            )
        if any(w <= 0 for w in self.windows_s.values()):
            raise ValueError(f"join windows must be > 0 seconds, got {self.windows_s}")
        if self.deferral is not None and self.deferral > self.min_edit_reward:
            raise ValueError(
                f"deferral reward {self.deferral} exceeds the worst edit reward "
                f"{self.min_edit_reward}: a turn that defers the edit (clarifying question, or "
                "nothing) could then score above making the edit, which teaches the policy to "
                "stop editing"
            )
        if self.broken_tool_call >= self.deferral_reward:
            raise ValueError(
                f"broken_tool_call {self.broken_tool_call} must be < the deferral reward "
                f"{self.deferral_reward}: otherwise breaking a call is a way to dodge a bad outcome"
            )
        return self


def check_house_style(name: str) -> str:
    """``name`` if it is one of :data:`HOUSE_STYLE_NAMES`; ValueError listing them otherwise."""
    if name not in HOUSE_STYLE_NAMES:
        raise ValueError(f"unknown house style {name!r}; valid: {sorted(HOUSE_STYLE_NAMES)}")
    return name


def check_sandbox(name: str) -> str:
    """``name`` if it is one of :data:`GRADING_SANDBOXES`; ValueError listing them otherwise
    (``local`` with why it is gone)."""
    valid = sorted(GRADING_SANDBOXES)
    if name == "local":
        raise ValueError(
            "sandbox 'local' is refused: it ran the hidden check in the reply's own interpreter, "
            f"which can rewrite the check, and online rewards are trained on; valid: {valid}"
        )
    if name not in GRADING_SANDBOXES:
        raise ValueError(f"unknown grading sandbox {name!r}; valid: {valid}")
    return name


class AlarmRule(_Section):
    """Fire when ``metric`` moves by more than ``threshold`` (absolute) in ``direction``."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    metric: str
    """A metric name from ``coderl.online.monitors.behaviour_metrics``."""
    direction: Literal["drop", "rise"]
    """``drop``: fires when watched - reference < -threshold; ``rise``: > threshold."""
    threshold: float = Field(ge=0)
    """Largest tolerated absolute change."""
    only_if_reward_rises: bool = False
    """Fire only when the mean reward also rose (metric falling while reward rises)."""


def default_alarm_rules() -> list[AlarmRule]:
    """The default alarms: the edit rate falling (faster while reward rises: the Cursor post's
    reward-hacking signature), clarifying questions, broken calls or dissatisfaction rising."""
    return [
        AlarmRule(metric="edit_rate", direction="drop", threshold=0.1, only_if_reward_rises=True),
        AlarmRule(metric="edit_rate", direction="drop", threshold=0.25),
        AlarmRule(metric="clarify_rate", direction="rise", threshold=0.15),
        AlarmRule(metric="broken_call_rate", direction="rise", threshold=0.1),
        AlarmRule(metric="dissatisfaction_rate", direction="rise", threshold=0.15),
    ]


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    """Interface to bind (keep loopback unless a proxy adds authentication)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0: any free port)."""
    temperature: float = Field(0.8, gt=0)
    """Default sampling temperature (> 0: greedy traffic teaches nothing); also the training
    temperature (interactions sampled at another temperature are excluded)."""
    max_new_tokens: int = Field(128, ge=1)
    """Default and maximum completion tokens per request."""
    call_format: str | None = None
    """Tool-call format of served replies, one of :data:`CALL_FORMAT_NAMES` (None: the
    run's harness format, ``tasks.options.episode.call_format``, else the harness default)."""

    @field_validator("call_format")
    @classmethod
    def _known_format(cls, v: str | None) -> str | None:
        return v if v is None else check_call_format(v)


class OnlineEvalConfig(_Section):
    """The gate's held-out suite: the run's environment (``tasks.source``, its
    ``tasks.heldout_split``) evaluated by ``coderl eval``'s code (:mod:`coderl.online.heldout`);
    the episode budgets are ``rollout``'s."""

    limit: int | None = Field(None, ge=2)
    """First N held-out tasks (None: all); at least 2 (the gate's t bound needs a variance)."""
    samples: int = Field(1, ge=1)
    """Samples per task; the per-task score is their mean pass rate (pass@1 estimate)."""
    temperature: float = Field(0.8, gt=0)
    """Eval sampling temperature; both policies get the same seeds (paired comparison)."""
    seed: int = 1234
    """Base seed of the eval samples."""


class GateConfig(_Section):
    margins: dict[str, float] = Field(default_factory=lambda: {"pass@1": 0.05})
    """Non-inferiority margin per held-out metric (absolute, in the metric's units)."""
    alpha: float = Field(default=0.05, gt=0, lt=0.5)
    """One-sided level of the non-inferiority test (0.05: a 95 % lower confidence bound)."""
    behaviour_rules: list[AlarmRule] = Field(default_factory=default_alarm_rules)
    """Alarm rules applied to held-out behaviour (candidate vs champion)."""
    min_samples: int = Field(default=8, ge=1)
    """Fewest held-out episodes for a behaviour check to count."""
    hack_rate_margin: float = Field(default=0.0, ge=0, le=1)
    """Largest tolerated rise of the held-out ``suspected_hack_rate`` (candidate minus
    champion, absolute); a larger rise blocks promotion like an alarm."""
    shared_margins: dict[str, float] | None = None
    """A population's candidate: non-inferiority margins on the shared suite against the shared
    champion (None: ``margins``); its own suite is gated with ``margins`` against its own
    champion."""


class MonitorConfig(_Section):
    window_s: float = Field(6 * 3600.0, gt=0)
    """Trailing window of the monitors, seconds."""
    rules: list[AlarmRule] = Field(default_factory=default_alarm_rules)
    """Alarm rules on live traffic (watched = champion, reference = its predecessor)."""
    min_samples: int = Field(20, ge=1)
    """Fewest interactions per version and population for an alarm to be checked."""


class SimulateConfig(_Section):
    enabled: bool = False
    """``coderl online run`` serves in-process and drives this population before each cycle."""
    clients: int = Field(4, ge=1)
    """Simulated users; client i belongs to population ``org-{i % populations}``."""
    populations: int = Field(2, ge=1)
    """Number of populations (segments for monitors and the running baseline)."""
    interactions_per_cycle: int = Field(16, ge=1)
    """Requests the population sends before each cycle."""
    tool_share: float = Field(0.5, ge=0, le=1)
    """Share of requests that offer the harness's ``write_file`` tool."""
    drop_rate: float = Field(0.1, ge=0, le=1)
    """Share of interactions whose outcome events are never sent (censored when they edit)."""
    duplicate_rate: float = Field(0.1, ge=0, le=1)
    """Share of events sent twice (idempotency)."""
    malformed_rate: float = Field(0.05, ge=0, le=1)
    """Share of interactions that also send a malformed event (rejected and counted)."""
    seed: int = 0
    """Seed of the population's choices and of the sampling seeds it sends."""
    agent: bool = False
    """Each of the ``interactions_per_cycle`` is a whole agent episode: the harness runs on the
    client side (tools in a sandbox there), the server generates every turn, summaries included
    (:mod:`coderl.online.agent_client`); False: one chat request per interaction."""
    episode: dict[str, Any] = Field(default_factory=dict)
    """``EpisodeConfig`` fields of those episodes (``max_turns``, ``context_budget``,
    ``max_tokens_per_turn``, ...) over the run's ``tasks.options.episode``; the call format is
    always the served one."""


SHARED = "shared"
"""The route, registry pointer and training track of traffic without an own adapter."""
_POPULATION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_population_name(name: str) -> str:
    """``name`` if it can name a population's adapter and pointer file (letters, digits,
    ``_.-``, at most 64 characters, not :data:`SHARED`).

    Raises:
        ValueError: otherwise.
    """
    if not _POPULATION_NAME.fullmatch(name) or name == SHARED:
        raise ValueError(
            f"population name {name!r}: need 1-64 letters, digits or '_.-' (starting with a "
            f"letter or digit), not the reserved {SHARED!r}"
        )
    return name


class PopulationConfig(_Section):
    """One organisation: its traffic can train an own LoRA adapter, served to it alone."""

    name: str
    """The ``population`` field its requests carry (also its adapter's and pointer's name)."""
    tasks: Literal["humaneval"] = "humaneval"
    """Task source of its traffic and held-out suite (``humaneval``: the fixed train/held-out
    split of :func:`coderl.tasks.humaneval.split_of`)."""
    task_filter: str | None = None
    """Regular expression a task id must match (``re.search``) to belong to this population's
    traffic and held-out suite (None: every task of the source)."""
    house_style: str | None = None
    """A house-style rule of :data:`coderl.online.suites.HOUSE_STYLES`: a passing edit that
    breaks it is reverted (its ``edit_persisted`` fraction is 0) and fails this population's
    held-out suite (None: no convention)."""
    min_events: int = Field(16, ge=1)
    """Fewest scored trainable interactions of this population before it trains an own adapter;
    until then its traffic trains the shared one and it is served the shared one."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_population_name(v)

    @field_validator("task_filter")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"task_filter {v!r} is not a regular expression: {e}") from None
        return v

    @field_validator("house_style")
    @classmethod
    def _style(cls, v: str | None) -> str | None:
        if v is not None:
            check_house_style(v)
        return v


class ExplorationConfig(_Section):
    """A share of traffic sampled at a higher temperature, its propensities logged."""

    share: float = Field(0.0, ge=0, lt=1)
    """Probability that a request (one that sets no temperature of its own) is sampled for
    exploration (0: none)."""
    temperature: float = Field(1.2, gt=0)
    """Sampling temperature of exploration requests; their behaviour logprobs are those of this
    tempered distribution, so the update's importance weights against the training
    temperature stay exact."""
    seed: int = 0
    """Seed of the server's exploration draws (one per request, in arrival order)."""


class OnlineConfig(_Section):
    """``coderl serve`` and ``coderl online``: the policy is ``model`` (version 0), the update
    uses ``algorithm`` (``advantage`` unused: see ``online.advantage``) and ``trainer``
    (``steps`` trainer steps per cycle); the registry, reports and the default SQLite database
    live in ``run_dir``."""

    database: str | None = None
    """SQLAlchemy URL (``postgresql+psycopg://...``); None: SQLite at ``run_dir/online.db``."""
    serve: ServeConfig = Field(default_factory=ServeConfig)
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
    eval: OnlineEvalConfig = Field(default_factory=OnlineEvalConfig)
    """Held-out evaluation of candidate and champion."""
    gate: GateConfig = Field(default_factory=GateConfig)
    """Non-inferiority margins and behaviour checks."""
    monitors: MonitorConfig = Field(default_factory=MonitorConfig)
    """Live-traffic monitors and alarms."""
    simulate: SimulateConfig = Field(default_factory=SimulateConfig)
    """The simulated client population (demo and tests)."""
    populations: list[PopulationConfig] = Field(default_factory=list)
    """Organisations that may get an own adapter (empty: one shared adapter for all traffic);
    a request's ``population`` outside this list is served and trained as shared."""
    exploration: ExplorationConfig = Field(default_factory=ExplorationConfig)
    """Exploration traffic (higher temperature, logged propensities)."""
    sandbox: str = "bwrap"
    """Where the hidden tests of the simulated population's single replies run the model's code
    (the held-out eval grades through the run's environment): ``bwrap`` (the function checker
    in coderl.sandbox), the only valid value. ``local`` (the check in the reply's own
    interpreter) is refused: these rewards are trained on."""
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
        try:
            return check_sandbox(v)
        except ValueError as e:
            raise ValueError(f"online.sandbox={v!r}: {e}") from None

    @model_validator(mode="after")
    def _check(self) -> OnlineConfig:
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch={self.min_batch} > max_batch={self.max_batch}")
        names = [p.name for p in self.populations]
        if len(set(names)) != len(names):
            raise ValueError(f"populations: duplicate names in {names}")
        if self.exploration.share > 0 and self.exploration.temperature == self.serve.temperature:
            raise ValueError(
                "exploration.temperature equals serve.temperature: exploration would sample "
                "the serving distribution (set a higher temperature or share 0)"
            )
        return self
