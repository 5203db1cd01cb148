"""One tree of typed configuration for ``coderl train``, ``train-async``, ``sft``, ``eval``,
``serve`` and ``online`` (its ``async`` and ``online`` sections).

Presets are YAML files in ``configs/``; ``key=value`` overrides on the command line replace single
leaves (``trainer.lr=2e-5 rollout.group_size=4``). Each field is documented once, under the field.
Unknown keys, wrong types and impossible combinations raise :class:`ConfigError`, whose message
names the dotted key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from coderl.config._base import ConfigError, _error_message, _Section
from coderl.config.algorithm import (
    AlgorithmConfig,
    DynamicSamplingConfig,
    ImportanceConfig,
    KLConfig,
)
from coderl.config.asyncrl import AsyncConfig
from coderl.config.engine import EngineConfig
from coderl.config.graders import GradersConfig, JudgeConfig, RMConfig
from coderl.config.online import OnlineConfig
from coderl.config.presets import missing_config
from coderl.config.reward_order import check_reward_order
from coderl.config.rewards import REWARD_TERM_NAMES, LengthPenaltyConfig, RewardConfig
from coderl.config.rollout import RolloutConfig
from coderl.config.sandbox import SandboxConfig
from coderl.config.synth import CurriculumConfig, SynthConfig
from coderl.config.tracking import LoggingConfig
from coderl.config.trainer import DistributedConfig, TrainerConfig

__all__ = [  # the sections live in their modules; users import them from here
    "AlgorithmConfig",
    "AsyncConfig",
    "Config",
    "ConfigError",
    "CurriculumConfig",
    "DistributedConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "EvalConfig",
    "GradersConfig",
    "ImportanceConfig",
    "JudgeConfig",
    "KLConfig",
    "LengthPenaltyConfig",
    "LoggingConfig",
    "MixSourceConfig",
    "ModelConfig",
    "OnlineConfig",
    "PoolConfig",
    "REWARD_TERM_NAMES",
    "RMConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SandboxConfig",
    "SynthConfig",
    "TaskConfig",
    "TrainerConfig",
    "anchored",
    "apply_override",
    "build_config",
    "dump_config",
    "load_config",
    "load_online_config",
    "load_tree",
]


class ModelConfig(_Section):
    name: str = "smollm2-135m"
    """Policy to load: a registered name (``tiny-random``, ``smollm2-135m``) or a checkpoint path."""
    lora: bool = True
    """Train LoRA adapters (reference policy = adapter disabled); False fine-tunes every weight
    and keeps a frozen copy as the reference policy."""
    lora_r: int = Field(16, ge=1)
    """LoRA rank."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input; keep 0 for exact logprob recomputation."""
    seed: int = 0
    """Seed for building random models (``tiny-random``) and LoRA initialisation."""


class PoolConfig(_Section):
    window: int = Field(16, ge=1)
    """Outcomes (resolved or not) kept per task, newest last; the task's pass-rate estimate is
    their mean."""
    settle: int = Field(8, ge=1)
    """Samples after which a task whose kept outcomes all agree is settled: all resolved ->
    retired, none resolved -> unsolved. Must be <= ``window``."""
    explore: float = Field(0.25, ge=0, le=1)
    """Share of draws from new tasks (fewer than ``settle`` samples, all of one outcome) while
    active tasks (estimate strictly in (0, 1)) exist."""
    revisit: float = Field(0.05, ge=0, le=1)
    """Share of draws from retired and unsolved tasks (one that turns active is revived)."""
    prepass_samples: int = Field(0, ge=0)
    """Episodes per training task rolled out (not trained on) before the first step to seed the
    estimates (0: no pre-pass)."""
    prepass_tasks: int | None = Field(None, ge=1)
    """Pre-pass only the first N training tasks (None: all)."""
    bins: int = Field(5, ge=1)
    """Bins of the logged pass-rate histogram (``pool/hist_<i>``, equal width over [0, 1])."""

    @model_validator(mode="after")
    def _settle_fits(self) -> PoolConfig:
        if self.settle > self.window:
            raise ValueError(f"settle={self.settle} must be <= window={self.window}")
        if self.explore + self.revisit > 1:
            raise ValueError("explore + revisit must be <= 1")
        return self


class MixSourceConfig(_Section):
    source: str
    """Task source of this entry (a ``tasks.source`` name other than ``mix``)."""
    name: str | None = None
    """Label in metrics (``mix/<name>/...``); None: ``source``. Unique within the mix."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The source's ``tasks.options``."""
    split: str | None = None
    """Split this source trains on (None: ``tasks.train_split``)."""
    heldout_split: str | None = None
    """Split this source contributes to evaluation (None: ``tasks.heldout_split``)."""
    limit: int | None = Field(None, ge=1)
    """Use only the first ``limit`` training tasks of this source (None: all)."""
    weight: float | list[tuple[int, float]] = 1.0
    """Share of each step's tasks, relative to the other entries: a constant, or ``[step,
    weight]`` points (steps increasing) linearly interpolated, constant beyond the ends (stages:
    put two points one step apart)."""
    sampler: Literal["uniform", "pool"] | None = None
    """Task sampler of this source (None: ``tasks.sampler``)."""

    @field_validator("weight")
    @classmethod
    def _weights(cls, w: Any) -> Any:
        points = [(0, w)] if isinstance(w, float | int) else w
        if not points or any(v < 0 for _, v in points):
            raise ValueError("weights must be >= 0 and a schedule needs at least one point")
        steps = [s for s, _ in points]
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"schedule steps must increase, got {steps}")
        return w

    def label(self) -> str:
        """The entry's name in metrics (``name``, else ``source``)."""
        return self.name or self.source


class TaskConfig(_Section):
    source: str = "humaneval"
    """Task source: ``humaneval``, ``toy`` (an in-process task for tests and smoke runs),
    ``repo`` (synthesised repository bug-fix tasks), ``swebench`` (SWE-bench-format instances
    that bring their own image; ``sandbox.backend=container``), ``fnrepair`` (function-scope
    repair tasks, ``coderl.synth.fnrepair``) or ``mix`` (the sources of ``mix``)."""
    sampler: Literal["uniform", "pool"] = "uniform"
    """How training tasks are drawn: ``uniform`` (an epoch-shuffled stream) or ``pool`` (the
    difficulty-calibrated pool of ``pool``; see ``coderl.train.sampling``)."""
    pool: PoolConfig = Field(default_factory=PoolConfig)
    """The difficulty-calibrated pool (``sampler: pool``)."""
    mix: list[MixSourceConfig] = Field(default_factory=list)
    """With ``source: mix``: the sources one run draws from, with weight schedules (a
    curriculum)."""
    train_split: str = "train"
    """Split the training loop samples tasks from."""
    heldout_split: str = "heldout"
    """Split evaluated before, during and after training."""
    tasks_per_step: int = Field(4, ge=1)
    """Distinct tasks per training step (each gets ``rollout.group_size`` episodes)."""
    limit: int | None = Field(None, ge=1)
    """Use only the first ``limit`` tasks of the training split (None: all)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Source-specific options (e.g. the repository environment directory for ``repo``)."""
    synth: SynthConfig = Field(default_factory=SynthConfig)
    """Task synthesis inside the loop (``coderl.train.synth``)."""
    curriculum: CurriculumConfig | None = None
    """With ``tasks.mix``: stages that advance by pass rate and set the mix weights (the entries'
    ``weight`` schedules are then unused; ``coderl.train.curriculum``). None: the schedules."""

    @model_validator(mode="after")
    def _synth_and_curriculum(self) -> TaskConfig:
        labels = [m.label() for m in self.mix]
        if self.curriculum is not None:
            unknown = sorted(set(self.curriculum.order) - set(labels))
            if unknown or len(set(self.curriculum.order)) < len(self.curriculum.order):
                raise ValueError(
                    f"tasks.curriculum.order: {self.curriculum.order} must be distinct "
                    f"tasks.mix labels; valid: {labels}"
                )
        s = self.synth
        if s.enabled and self.mix:
            # "repo-L{level}": one entry per level (those of levels 0-9 that the mix has)
            named = (
                [s.source.format(level=lv) for lv in range(10)]
                if s.source and "{level}" in s.source
                else [s.source]
            )
            entries = [m for m in self.mix if m.label() in named]
            if not entries or any((m.sampler or self.sampler) != "pool" for m in entries):
                raise ValueError(
                    f"tasks.synth.source={s.source!r} must name a tasks.mix entry drawn by the "
                    f"pool sampler (or entries, with {{level}}); valid: {labels}"
                )
        elif s.enabled and self.sampler != "pool":
            raise ValueError("tasks.synth.enabled needs tasks.sampler=pool (it admits to the pool)")
        return self

    @model_validator(mode="after")
    def _mix_matches_source(self) -> TaskConfig:
        if (self.source == "mix") != bool(self.mix):
            raise ValueError("tasks.mix needs tasks.source=mix, and source=mix needs tasks.mix")
        labels = [m.label() for m in self.mix]
        if len(set(labels)) < len(labels) or any(m.source == "mix" for m in self.mix):
            raise ValueError(f"tasks.mix: names must be unique and not nest a mix, got {labels}")
        if self.mix and self.limit is not None:
            raise ValueError("tasks.limit does not apply to a mix: set each entry's limit")
        return self


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate on held-out tasks every N steps (0: none between steps; the evaluations before and
    after training are ``before_after``'s, which ``before_after=false`` skips)."""
    before_after: bool = True
    """Evaluate before the first and after the last step."""
    before_sft: bool = True
    """With an SFT warm start, also evaluate the model before it (logged with ``phase: base``),
    so the whole recipe's change is measured, not only RL's."""
    tasks: int | None = Field(None, ge=1)
    """Held-out tasks evaluated (None: the whole split)."""
    samples: int = Field(16, ge=1)
    """Samples per task (n of pass@k)."""
    base_samples: int | None = Field(None, ge=1)
    """Samples per task for the model before SFT (``phase: base``; None: ``samples``). The
    RL-only change and the collapse check compare the evaluations after SFT and after RL, both
    at ``samples``; the base model's pass@1 stays unbiased at any n, with a wider CI."""
    k: list[int] = Field(default_factory=lambda: [1, 16])
    """The k values of pass@k."""
    temperature: float = Field(0.8, gt=0)
    """Sampling temperature in evaluation."""
    batch_episodes: int = Field(64, ge=1)
    """Episodes rolled out together (one sampling batch: ``batch_episodes // samples`` tasks,
    at least one); larger batches sample faster and hold more KV cache in memory."""
    extra_splits: list[str] = Field(default_factory=list)
    """Further task splits evaluated beside ``tasks.heldout_split`` at the start (after SFT) and
    after the last step, with the same ``tasks``, ``samples`` and seeds (each costs what the
    held-out evaluation costs), logged to ``eval_extra.jsonl`` and reported with their own
    paired RL-only change; never trained on. ``[outside]`` with ``tasks.source: fnrepair``: the
    kept-back set of libraries the family never uses (docs/training.md)."""


class SFTConfig(_Section):
    enabled: bool = False
    """Run supervised fine-tuning on oracle demonstrations before RL (``coderl online``: version
    0 of a new registry is this warm start, :func:`coderl.online.cycle.first_version`)."""
    epochs: int = Field(1, ge=1)
    """Passes over the demonstrations."""
    lr: float = Field(2e-4, gt=0)
    """SFT learning rate."""
    batch_size: int = Field(4, ge=1)
    """Demonstrations per optimizer step (micro-batched like RL)."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N training tasks as demonstrations (None: all)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """SFT precision (fp32 weights and optimizer either way): ``bfloat16`` is ``trainer.bf16``'s
    bf16 MLPs, ``auto`` is bfloat16 iff the device has bf16 units (``has_bf16_units``). SFT
    follows the trainer's packing and checkpointing too (docs/training.md, "Memory and speed levers")."""
    cache: bool = False
    """Reuse the SFT weights of an earlier run with the same inputs (model files, demonstrations,
    this section, seed, code): a content-addressed cache under ``data/cache/warmstart``
    (:mod:`coderl.train.warmstart`; ``make warm-start`` builds the demo's entry)."""


class Config(_Section):
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_by_name=True,
        validate_by_alias=True,
    )

    seed: int = 0
    """Seed for task order, sampling and every RNG the run uses."""
    run_dir: str = "runs/default"
    """Where metrics, checkpoints and the report go."""
    threads: int | None = Field(None, ge=1)
    """torch's intra-op threads in each process of the command (workers and torchrun ranks
    included; :func:`coderl.policy.threads.use_threads`). None: torch's default, one per core
    or ``OMP_NUM_THREADS``; a number here wins over ``OMP_NUM_THREADS``. Keep processes x
    threads <= cores: two processes at 2 threads on 2 cores spin-wait, many times slower."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    """``coderl serve`` and ``coderl online`` (serving, rewards from events, the gate)."""
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """The ``async:`` section, read by ``coderl train-async`` (``async.max_staleness=0``...)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The rollout engine (``torch`` in-process, or a ``vllm`` server)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where rollouts, builds and grades execute (``bwrap`` or ``container``)."""
    graders: GradersConfig = Field(default_factory=GradersConfig)
    """Gameability probes of the learned graders (``coderl graders probe``)."""
    tensorboard: bool = True
    """Also log metrics to TensorBoard (``run_dir/tb``)."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Other metric sinks beside ``metrics.jsonl`` and TensorBoard (Weights & Biases)."""
    progress: bool = True
    """Show a progress bar with ETA."""

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        alg, rew = self.algorithm, self.reward
        unknown = sorted(set(rew.terms) - set(REWARD_TERM_NAMES))
        if unknown:
            raise ValueError(
                f"reward.terms: unknown terms {unknown}; valid: {sorted(REWARD_TERM_NAMES)}"
            )
        if "rm" in rew.terms and not rew.rm.checkpoint:  # else every sample would be masked
            raise ValueError(
                "reward.terms.rm needs reward.rm.checkpoint (a `coderl rm train` output)"
            )
        if alg.advantage != "gae" and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: advantage "
                f"{alg.advantage!r} needs at least 2 episodes per task (a group baseline)"
            )
        branching = self.rollout.branch.k > 0
        if (alg.advantage == "vineppo") != branching or (rew.shaping > 0 and not branching):
            raise ValueError(
                "rollout.branch.k: algorithm.advantage=vineppo needs continuations "
                "(rollout.branch.k >= 1 with turns or every), and rollout.branch and "
                "reward.shaping are used only by vineppo"
            )
        check_reward_order(rew)  # no cheaper behaviour can outscore solving
        if "kl" in rew.terms and rew.kl_coef > 0 and alg.kl.coef > 0:
            raise ValueError(
                "algorithm.kl.coef: KL is both in the reward (reward.terms.kl) and in the loss; "
                "choose one"
            )
        if alg.importance.low is not None and alg.importance.low > alg.importance.cap:
            raise ValueError("algorithm.importance.low must be <= algorithm.importance.cap")
        if any(k < 1 or k > self.eval.samples for k in self.eval.k):
            raise ValueError(
                f"eval.k={self.eval.k}: every k must be in [1, eval.samples={self.eval.samples}]"
            )
        named = (self.tasks.train_split, self.tasks.heldout_split)
        extra = self.eval.extra_splits
        if len(set(extra)) != len(extra) or set(extra) & set(named):
            raise ValueError(
                f"eval.extra_splits={extra}: each split once, neither tasks.train_split nor "
                f"tasks.heldout_split ({list(named)})"
            )
        if self.trainer.warmup_steps > self.trainer.steps:
            raise ValueError("trainer.warmup_steps must be <= trainer.steps")
        a, per_step = self.async_, self.tasks.tasks_per_step
        g, r = a.groups_per_step or per_step, a.tasks_per_rollout or per_step
        if g % r:
            raise ValueError(
                f"async.tasks_per_rollout={r} must divide async.groups_per_step={g} "
                "(None: tasks.tasks_per_step)"
            )
        return self


def split_preset(
    config: str | None, overrides: list[str] | tuple[str, ...]
) -> tuple[str | None, list[str]]:
    """``(preset, overrides)`` of a command line whose first word may be an override instead of
    a YAML preset (``coderl train --resume RUN k=v``: argparse puts ``k=v`` in ``config``)."""
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, list(overrides)


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override to a raw config dict, in place.

    The value is parsed as YAML (``3`` is an int, ``[1, 2]`` a list, ``null`` None). A mapping
    given for a whole section is merged into the section (``trainer={steps: 1}`` keeps the
    preset's other trainer keys), as a key-by-key override would be. Intermediate sections that
    are absent from the YAML are created; whether the key exists is checked by
    :func:`build_config`.

    Raises:
        ConfigError: no ``=``, an empty key, a path through a non-section value, or a value
            that is not valid YAML.
    """
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section ({key!r})")
        node = child
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        why = str(getattr(e, "problem", None) or "not valid YAML")
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({why})") from None
    _merge(node, parts[-1], value, _section_of(parts))


def _section_of(parts: list[str]) -> type[_Section] | None:
    """The config section at dotted ``parts`` (``["trainer"]`` -> TrainerConfig), or None for a
    leaf (a value, or a mapping field such as ``reward.terms``)."""
    model: type[_Section] = Config
    for part in parts:
        field = model.model_fields.get(part)
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, _Section)):
            return None
        model = ann
    return model


def _merge(node: dict[str, Any], key: str, value: Any, section: type[_Section] | None) -> None:
    """``node[key] = value``, except that a mapping given for a section is merged into what the
    preset holds there (``trainer={steps: 1}`` keeps the preset's other trainer keys); a mapping
    field (``reward.terms``) is replaced whole."""
    old = node.get(key)
    if section is None or not isinstance(value, dict) or not isinstance(old, dict):
        node[key] = value
        return
    for k, v in value.items():
        field = section.model_fields.get(k) if isinstance(k, str) else None
        ann = field.annotation if field is not None else None
        sub = ann if isinstance(ann, type) and issubclass(ann, _Section) else None
        _merge(old, k, v, sub)


def build_config(tree: dict[str, Any]) -> Config:
    """Validate a raw dict into a :class:`Config`.

    Raises:
        ConfigError: unknown keys, wrong types or impossible combinations (naming the keys).
    """
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_error_message(err, model=Config)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load a YAML preset (None: the defaults) and apply ``key=value`` overrides.

    Raises:
        ConfigError: the file is missing or not a YAML mapping, or any validation error.
    """
    return build_config(load_tree(path, overrides))


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the
    last silently, so a preset's earlier setting would vanish without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{key_node.start_mark.name}: key {key!r} is given twice in one mapping "
                    f"(lines {seen[key]} and {line}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_tree(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """The raw YAML mapping of a preset (None: empty) with ``key=value`` overrides applied.

    Raises:
        ConfigError: the file is missing or empty, holds a key twice in one mapping (names the
            key and line) or its top level is not a mapping; a malformed override.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            run = f"; to continue the run in it: coderl train --resume {p}"
            raise ConfigError(
                f"{str(p)!r} is a directory, not a YAML config file; name a preset such as "
                f"configs/default.yaml{run if (p / 'config.yaml').is_file() else ''}"
            )
        if not p.is_file():
            raise ConfigError(missing_config(p))
        try:
            with p.open() as f:  # the marks name the file
                loaded = yaml.load(f, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML: {err}") from err
        if loaded is None:  # an empty file (or only comments) would silently be the defaults
            raise ConfigError(
                f"{p}: the config file is empty; give a preset (e.g. configs/default.yaml) or "
                "leave the file out to run on the defaults"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded or {}
    for ov in overrides:
        apply_override(tree, ov)
    return tree


def load_online_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """:func:`load_config` for ``coderl serve`` / ``coderl online``, which also refuses an
    ``algorithm.advantage``: production gives one sample per context, so group estimators are
    meaningless there (``online.advantage`` names the single-sample baseline).

    Raises:
        ConfigError: as :func:`load_config`, or ``algorithm.advantage`` is set.
    """
    cfg = load_config(path, overrides)
    if "advantage" in cfg.algorithm.model_fields_set:
        raise ConfigError(
            "algorithm.advantage is not used online: production gives one sample per context, "
            "so group estimators (grpo, rloo, dr_grpo) are meaningless; set online.advantage "
            "to a single-sample baseline (batch-norm, running-segment)"
        )
    return cfg


FILE_OPTIONS = ("tasks_file", "repos_file")
"""``tasks.options`` (and each ``tasks.mix`` source's ``options``) that name files: a run's
``config.yaml`` holds them absolute (:func:`anchored`)."""


def anchored(cfg: Config, base: str | Path | None = None) -> Config:
    """``cfg`` with every relative path of :data:`FILE_OPTIONS` made absolute against ``base``
    (default: the working directory), as a run's ``config.yaml`` holds it: the task file a run
    trained on is then the one ``coderl eval``, ``export`` and ``--resume`` read, from whatever
    directory they run in. Globs stay globs."""
    root = Path(base or Path.cwd()).resolve()

    def fix(value: Any) -> Any:
        if isinstance(value, str):
            return value if Path(value).is_absolute() else str(root / value)
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    def options(opts: dict[str, Any]) -> dict[str, Any]:
        return {k: fix(v) if k in FILE_OPTIONS else v for k, v in opts.items()}

    mix = [m.model_copy(update={"options": options(m.options)}) for m in cfg.tasks.mix]
    tasks = cfg.tasks.model_copy(update={"options": options(cfg.tasks.options), "mix": mix})
    return cfg.model_copy(update={"tasks": tasks})


def dump_config(cfg: Config) -> str:
    """The config as YAML (what ``run_dir/config.yaml`` holds; loads back to an equal Config)."""
    return yaml.safe_dump(cfg.model_dump(by_alias=True), sort_keys=False)
