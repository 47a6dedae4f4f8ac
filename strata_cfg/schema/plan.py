"""The launch plan: the only contract between strata_cfg and strata_runtime.

A `LaunchPlan` is frozen and JSON-serialisable. It says which device holds which layers, how slots are
scheduled, whether batch MTP runs, where every MiB goes, and why each of those was decided. The runtime
executes it as written and never re-derives a decision. ``plan.model_dump(mode="json")`` is the public JSON
that ``strata plan --json`` prints; `PLAN_VERSION` changes when that shape changes incompatibly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from .facts import MachineFacts, ModelFacts

PLAN_VERSION = 1

Severity = Literal["error", "off", "clamp", "warn", "note"]
"""``error`` refuses the plan; ``off`` turns a feature off; ``clamp`` bounds a value; ``warn`` and ``note``
inform."""
SourceKind = Literal["user", "default", "derived", "forced"]
BatchMode = Literal["solo", "serial", "pipelined"]
MIB = 1 << 20


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Origin(_Plan):
    """Where a user-written value came from."""

    file: str
    """The profile file, or ``--set`` for a command-line override."""
    line: int | None = None
    """1-based line in that file."""

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


class Source(_Plan):
    """How a resolved value got its value."""

    kind: SourceKind
    """``user`` (written in a profile or ``--set``), ``default``, ``derived`` (computed by a rule), or
    ``forced`` (a rule overrode what the user asked for)."""
    origin: Origin | None = None
    """For ``user`` and ``forced``: where the user wrote the value."""
    rule: str | None = None
    """For ``derived`` and ``forced``: the rule that set it."""

    def __str__(self) -> str:
        if self.kind == "user":
            return f"user ({self.origin})" if self.origin else "user"
        if self.kind == "default":
            return "default"
        where = f", asked at {self.origin}" if self.origin else ""
        return f"{self.kind} by {self.rule}{where}"


class Setting(_Plan):
    """One resolved profile key: its final value, where it came from, and what it was asked to be."""

    value: Any
    """The value the plan runs with."""
    source: Source
    """How it got that value."""
    requested: Any = None
    """What the user wrote, when a rule changed it (``forced``)."""
    rules: tuple[str, ...] = ()
    """Every rule that read or changed this key, in order."""


class Decision(_Plan):
    """A rule that fired, with one plain sentence saying what it did and why."""

    rule: str
    """Stable rule id (``strata rules`` lists them)."""
    severity: Severity
    """What kind of decision this is."""
    key: str
    """The dotted profile key it concerns."""
    message: str
    """One plain sentence."""
    requested: bool = False
    """True when it turned off or changed something the user explicitly asked for."""
    origin: Origin | None = None
    """Where the user asked for it, when they did."""


class StagePlan(_Plan):
    """One pipeline stage: a contiguous range of layers on one device."""

    index: int = Field(ge=0)
    gpu: int = Field(ge=0)
    """Device ordinal of the stage."""
    device: str
    """``cuda:N`` or ``cpu:N``."""
    host: str = "local"
    """The host holding the device."""
    layers: tuple[int, int]
    """Half-open range [start, end) of main-model layers."""
    holds: tuple[str, ...]
    """What the stage holds besides its layers' weights and KV: ``embedding``, ``final_norm``,
    ``lm_head``, ``mtp``, ``drafters``."""
    drafters: tuple[int, ...] = ()
    """Slot ids whose MTP drafters live on this stage (only ever the last)."""


class Budget(_Plan):
    """One GPU's VRAM, in bytes, split by purpose. The terms add up to ``total``."""

    total: int
    weights: int
    """Non-expert weights of the layers placed here, plus embedding / head / MTP where placed."""
    kv: int
    """KV cache of every slot for the layers placed here."""
    drafters: int
    """The slot drafters' private state (last stage only)."""
    workspace: int
    """Activation workspace for an 8-row window and for a prefill chunk."""
    reserve: int
    """Left free on purpose (``memory.vram_reserve_mib``)."""
    experts: int
    """Routed experts held in VRAM (all of them if they fit, else the expert cache)."""
    free: int
    """What is left over."""

    TERMS: ClassVar[tuple[str, ...]] = (
        "weights",
        "kv",
        "drafters",
        "workspace",
        "reserve",
        "experts",
        "free",
    )

    def mib(self) -> dict[str, float]:
        """The total and every term in MiB, rounded to 0.1."""
        return {n: round(getattr(self, n) / MIB, 1) for n in ("total", *self.TERMS)}


class GpuPlan(_Plan):
    """What one GPU is used for."""

    index: int
    device: str
    name: str
    role: Literal["stage", "helper", "idle"]
    stages: tuple[int, ...] = ()
    budget: Budget
    """Bytes by purpose."""
    experts_total: int = 0
    """Routed experts of the layers placed on this GPU."""
    experts_resident: int = 0
    """How many of those fit in VRAM."""

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        # `budget_mib` is output only; accept a plan JSON that carries it.
        if isinstance(data, dict) and "budget_mib" in data:
            data = {k: v for k, v in data.items() if k != "budget_mib"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def budget_mib(self) -> dict[str, float]:
        """The budget in MiB: what scripts read."""
        return self.budget.mib()

    @property
    def all_experts_resident(self) -> bool:
        return self.experts_resident >= self.experts_total


class BatchPlan(_Plan):
    """How request slots are scheduled."""

    slots: int
    """Concurrent decode slots (1 when batching is off)."""
    groups: int
    """Slot groups pipelined through the stages."""
    mode: BatchMode
    """``solo`` (no batching), ``serial`` (one group), or ``pipelined`` (several groups in flight)."""
    mtp: bool
    """Whether per-slot MTP drafters run in batch windows."""
    slots_per_window: int
    """Slots that share one window (4 with batch MTP, else up to 8)."""
    rows_per_slot: int
    """Rows each slot sends per batch window (2 with batch MTP: token and proposal)."""


class SpecPlan(_Plan):
    """Speculative decoding on the solo path."""

    draft_tokens: int
    """The speculative window: the token plus ``draft_tokens - 1`` proposals (0 or 1: no drafting)."""
    mtp: bool
    """Whether the solo path drafts with the MTP head."""
    pipeline_windows: int
    """Overlapped solo windows on a two-stage split (0: off)."""


class WindowPlan(_Plan):
    """Bounds on window shapes."""

    max_rows: int
    """Rows per window."""
    handoff_rows: int
    """Rows handed from one stage to the next."""
    solo_rows: int
    """Rows of a solo window: 1 + proposals."""
    batch_rows: int
    """Rows of a full batch window."""


class MemoryPlan(_Plan):
    context: int
    """Tokens per slot."""
    kv_dtype: Literal["float32", "float16", "bfloat16"]
    prefill_chunk: int
    """Prompt tokens per prefill window."""
    vram_reserve_mib: int
    vram_reserve_later_mib: int


class ModelPlan(_Plan):
    """The model as the runtime should build it."""

    path: str | None = None
    """Absolute model directory, or None for a synthetic preset."""
    synthetic: str | None = None
    """Preset name, or None for a model directory."""
    packaged: str | None = None
    """The packaged model's name when ``path`` is a model that ships with strata (``model.packaged``)."""
    seed: int = 0
    layer_scale: float | None = None
    """Synthetic only: the planted-structure scale (see the profile's ``model.layer_scale``)."""
    facts: ModelFacts

    def label(self) -> str:
        """The model as the plan's summary names it: ``tiny (synthetic)``, ``austen (packaged)`` or a path."""
        if self.synthetic:
            return f"{self.synthetic} (synthetic)"
        if self.packaged:
            return f"{self.packaged} (packaged)"
        return self.path or self.facts.source


class ExpertsPlan(_Plan):
    cache: int | None
    """Expert-cache slots per GPU when not every expert fits; None when every expert is resident."""
    helper_devices: tuple[int, ...] = ()
    remote_opt: bool = False
    peer_device: int | None = None


class ServePlan(_Plan):
    host: str
    port: int
    api_key_env: str | None
    model_name: str


class LaunchPlan(_Plan):
    """Everything the engine needs to start, and why it is what it is."""

    version: int = PLAN_VERSION
    profile: str
    """The profile's name."""
    profile_file: str | None = None
    strict: bool = False
    """Resolved in strict mode (asked-for features turned off are errors)."""
    machine: MachineFacts
    model: ModelPlan
    stages: tuple[StagePlan, ...]
    gpus: tuple[GpuPlan, ...]
    batch: BatchPlan
    spec: SpecPlan
    memory: MemoryPlan
    experts: ExpertsPlan
    windows: WindowPlan
    serve: ServePlan | None
    """None: a one-shot generation profile."""
    split_test_shared_gpu: bool = False
    decisions: tuple[Decision, ...]
    settings: dict[str, Setting]
    """Every resolved profile key by dotted name, with its provenance."""

    @property
    def last_stage(self) -> StagePlan:
        return self.stages[-1]

    def to_json(self) -> dict[str, Any]:
        """The public JSON form."""
        return self.model_dump(mode="json")
