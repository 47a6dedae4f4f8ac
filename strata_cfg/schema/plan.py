"""The launch plan: the only contract between strata_cfg and strata_runtime.

A `LaunchPlan` is frozen and JSON-serialisable. It says which device holds which layers, how slots are
scheduled, whether batch MTP runs, where every MiB goes, and why each of those was decided. The runtime
executes it as written and never re-derives a decision. ``plan.model_dump(mode="json")`` is the public JSON
that ``strata plan --json`` prints; `PLAN_VERSION` changes when that shape changes incompatibly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from .facts import MachineFacts, ModelFacts
from .windows import PROMPT_GRAPH_MAX

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


def find_origin(origins: Mapping[str, Origin], key: str) -> Origin | None:
    """The origin of ``key``, falling back to its nearest parent that has one."""
    parts = key.split(".")
    while parts:
        o = origins.get(".".join(parts))
        if o is not None:
            return o
        parts.pop()
    return None


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
    gates: tuple[str, ...] = ()
    """For a feature (``batch.mtp``, ``split.pipeline_windows``): the gates that checked it, in order, each of
    which could have turned it off. All passed unless the last one turned it off."""


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
    because: tuple[str, ...] = ()
    """The keys whose values made this rule fire (``batch.groups`` for ``batch-mtp.pipelined-groups``), so
    that explaining a key shows what it caused."""


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


WORKSPACE_PARTS = {
    "prompt": "prompt chunk",
    "scores": "attention scores",
    "windows": "decode windows",
    "logits": "logits and penalties",
    "headroom": "headroom",
}
"""The parts of a GPU's workspace (`Budget.workspace_parts`), in order, with the words the plan's text gives
them."""


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
    """Activation workspace: a prompt chunk's, the decode windows' buffers, the last stage's logits, and
    the memory pool's headroom."""
    workspace_parts: dict[str, int] = {}
    """``workspace`` by part, adding up to it (empty where the GPU has none): ``prompt`` (a prompt chunk's
    activations), ``scores`` (stored attention scores), ``windows`` (the decode windows' buffers),
    ``logits`` (the last stage's window logits and slots' token counts and bias), ``headroom``."""
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

    @model_validator(mode="after")
    def _parts_add_up(self) -> Budget:
        if self.workspace_parts and sum(self.workspace_parts.values()) != self.workspace:
            raise ValueError(
                f"workspace_parts {self.workspace_parts} do not add up to workspace {self.workspace}"
            )
        return self

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
    experts_whole: int = 0
    """Of ``experts_resident`` under an expert cache, the MTP head's routed experts, all of them, held for
    good (rule ``experts.mtp-whole``); 0 where the head's layer has an even share like any layer's."""

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
    mtp_in_groups: bool = False
    """Batch MTP runs inside each pipelined group (``batch.mtp_in_groups``): mode ``pipelined``, ``mtp``
    true, 2 rows per slot, at most 4 slots per group window."""
    slots_per_window: int
    """Slots that share one window (with batch MTP at most 4; in pipelined groups a group's slots)."""
    rows_per_slot: int
    """Rows each slot sends per batch window (2 with batch MTP: token and proposal)."""
    run_ahead: int = 2
    """Plain decode windows (one row per slot, tokens chosen on the GPU) in flight at once; 1: one at a
    time."""


DEFAULT_DRAFT_FLOOR = 0.25
"""``spec.draft_floor`` when the profile leaves it out."""


class SpecPlan(_Plan):
    """Speculative decoding on the solo path."""

    draft_tokens: int
    """The speculative window: the token plus ``draft_tokens - 1`` proposals (0 or 1: no drafting)."""
    mtp: bool
    """Whether the solo path drafts with the MTP head."""
    ngram: bool = False
    """Whether the solo path drafts by n-gram lookup (``spec.method = "ngram"``): the request's latest
    ``ngram_max`` down to ``ngram_min`` tokens are looked up earlier in its prompt and reply, and the tokens
    that followed their latest match are proposed. No MTP weights needed."""
    ngram_min: int = 2
    """The shortest run of latest tokens a lookup matches."""
    ngram_max: int = 4
    """The longest run of latest tokens a lookup matches (the longest that matches is used)."""
    draft_floor: float = DEFAULT_DRAFT_FLOOR
    """Drafting pauses for a request while fewer than this share of its windows' first proposals hold (0:
    never)."""
    adaptive_depth: bool = True
    """A request alone drafts as many proposals as pay, and slots together take batch-MTP windows where
    those pay (by acceptance and the measured window times); False: all ``draft_tokens - 1``, and batch
    MTP by the floor alone (and False where the solo path does not draft)."""
    pipeline_windows: int
    """Overlapped solo windows on a two-stage split (0: off)."""
    draft_head: Literal["shared", "int8"] = "shared"
    """The LM head the MTP head drafts through: the model's own (``"shared"``), or an 8-bit copy of it on
    the last stage (``"int8"``, only where the MTP head drafts)."""

    @property
    def drafts(self) -> bool:
        """Whether the solo path drafts at all: with the MTP head, or by n-gram lookup."""
        return self.mtp or self.ngram


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


PREFIX_STORE_PAGE = 64
"""Positions in one page of the host's prefix store (``memory.prefix_store_mib``): a stored prefix takes
whole pages, each of every layer's keys and values and of one drafter's."""


class MemoryPlan(_Plan):
    context: int
    """Tokens per slot."""
    kv_dtype: Literal["float32", "float16", "bfloat16"]
    prefill_chunk: int
    """Prompt tokens per prefill window."""
    prefill_chunk_alone: int
    """Prompt tokens per prefill window while that prompt is the engine's only work (serial windows)."""
    prompt_graph_rows: int = PROMPT_GRAPH_MAX
    """On a GPU, prompt chunks of at most this many rows run as 8-row decode graph windows; longer ones take
    the prefill path."""
    prefill_graph_rows: int = 0
    """On a GPU, a prefill-path chunk of one prompt is padded to a graph's rows and replayed as a
    CUDA graph where that is at most this many (0: every chunk is launched layer by layer). The workspace
    holds that many rows' temporaries beside the longest chunk's."""
    vram_reserve_mib: int
    vram_reserve_later_mib: int
    prefix_reuse: bool = True
    """A free slot keeps its last request's KV, and a request that begins the same way reads only the rest
    of its prompt."""
    prefix_store_mib: int = 0
    """Host memory for kept prefixes that no slot holds any more (0: none; off without ``prefix_reuse``)."""


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
    routing: Literal["uniform", "calibrated"] = "uniform"
    """Synthetic only: the routing model (see the profile's ``model.routing``)."""
    prefill_q: Literal["split", "fp16"] = "split"
    """The query's precision in prompt attention on the GPU (``model.prefill_q``)."""
    decode_attention: Literal["tensor_cores", "cuda_cores"] = "tensor_cores"
    """The kernel of decode attention on a GPU (``model.decode_attention``, ``"auto"`` resolved by the
    model's shape)."""
    facts: ModelFacts

    def label(self) -> str:
        """The model as the plan's summary names it: ``tiny (synthetic)``, ``austen (packaged)`` or a path."""
        if self.synthetic:
            return f"{self.synthetic} (synthetic)"
        if self.packaged:
            return f"{self.packaged} (packaged)"
        return self.path or self.facts.source


SCORE_DECAY = 0.9
REBALANCE_EVERY = 4
SWAP_MARGIN = 3.0
MAX_SWAPS = 512
"""The expert cache's policy by default (the runtime's `strata_runtime.experts.cache.Policy`): scores with a
half-life of about seven windows, a rebalance every four windows and right after each prompt chunk, and
swaps that must each beat the expert they evict by three uses, up to 512 at a time (or, keeping misses, a
queue of 512 victims). docs/RUNTIME.md ("How the cache's policy was chosen") has the simulation that chose
them."""
KEEP_SCORE_DECAY = 0.95
"""The scores' decay by default where the cache keeps its misses: a half-life of about 14 windows, which
ranks its queue of victims better than 0.9 (fewer experts over the link in the simulation, and one stream
3.9% faster on one H100 capped at 24 GiB)."""


class ExpertsPlan(_Plan):
    cache: int | None
    """Expert-cache slots per GPU when not every expert fits; None when every expert is resident."""
    helper_devices: tuple[int, ...] = ()
    remote_opt: bool = False
    peer_device: int | None = None
    adapt: bool = True
    """Whether the expert cache follows the routing (``experts.adapt``)."""
    score_decay: float = SCORE_DECAY
    """Each window multiplies the cache's scores by this (``experts.score_decay``)."""
    rebalance_every: int = REBALANCE_EVERY
    """Windows between the cache's rebalances (``experts.rebalance_every``)."""
    swap_margin: float = SWAP_MARGIN
    """Score a newcomer must beat the expert it evicts by (``experts.swap_margin``)."""
    max_swaps: int = MAX_SWAPS
    """Swaps per rebalance at most (``experts.max_swaps``); under ``keep_misses``, the victims queued."""
    keep_misses: bool = True
    """Whether the cache keeps the experts the kernels read from host memory, in the slots of queued
    victims, instead of copying swaps (``experts.keep_misses``)."""
    recall_stored: bool = True
    """Whether a prefix copied back from the prefix store brings back what the cache had learned from its
    conversation (``experts.recall_stored``)."""


class HostTier(_Plan):
    """One GPU's experts in pinned host memory."""

    gpu: int
    """The GPU whose stages these experts belong to."""
    experts: int
    """Routed experts held in host memory: every routed expert of the GPU's stages when not all fit in
    VRAM (the VRAM cache holds copies of some), none when all do. Helper and idle GPUs hold none."""
    bytes: int
    """Their bytes."""


class HostPlan(_Plan):
    """The host-memory budget: the host tier of experts and the prefix store against the machine's RAM, in
    bytes."""

    tiers: tuple[HostTier, ...]
    """One per GPU, in the order of ``gpus``."""
    prefix_store: int = 0
    """Bytes the prefix store may pin at most (``memory.prefix_store_mib``)."""
    total: int
    """Bytes of every host tier and the prefix store together."""
    reserve: int
    """Left for everything else (``memory.host_reserve_mib``)."""
    ram: int | None
    """The host memory the engine may pin; None when unknown (then nothing was checked)."""
    ram_source: Literal["profile", "probe"] | None = None
    """``profile`` (``machine.host_ram_mib``) or ``probe`` (/proc/meminfo)."""
    free: int | None
    """``ram - total - reserve`` (never negative: a plan that does not fit is refused); None when unknown."""

    @property
    def experts(self) -> int:
        """Bytes of every host tier together: ``total`` less the prefix store."""
        return self.total - self.prefix_store


DEFAULT_RECOVERIES = 3
"""``serve.recoveries`` when the profile leaves it out."""
DEFAULT_STEP_TIMEOUT_S = 300.0
"""``serve.step_timeout_s`` when the profile leaves it out."""


class ServePlan(_Plan):
    host: str
    port: int
    api_key_env: str | None
    model_name: str
    allowed_origins: tuple[str, ...] = ()
    """Web origins whose pages may call the API from a browser (``*``: any); empty: no CORS headers."""
    warm_up: bool = True
    """Whether the engine runs every decode window shape before it answers (`Engine.warm_up`)."""
    max_queued: int | None = None
    """Requests that may wait for a batch slot beyond ``batch.slots`` in flight; one more is answered 429
    (None: no bound)."""
    recoveries: int = DEFAULT_RECOVERIES
    """Failed engine steps recovered from within ten minutes, the engine's requests ending with an error;
    one more ends the server (0: the first does)."""
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    """Seconds a step may take before the server counts the engine as hung and ends (0: never)."""
    loopback: bool = False
    """Whether ``host`` keeps the server on this machine (a loopback address); the engine warns when it
    binds anywhere else without an API key."""


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
    host: HostPlan
    """Host memory: the experts kept there and the RAM they must fit in."""
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

    @property
    def prefix_store_pages(self) -> int:
        """Pages of `PREFIX_STORE_PAGE` positions that the prefix store holds: ``memory.prefix_store_mib``
        over the bytes of a page of every layer's KV and, where slots draft, one drafter's layer (0: no
        store, or one smaller than a page)."""
        m = self.memory
        if not (m.prefix_reuse and m.prefix_store_mib):
            return 0
        facts = self.model.facts
        layers = facts.num_hidden_layers + (1 if any(s.drafters for s in self.stages) else 0)
        page = PREFIX_STORE_PAGE * layers * facts.kv_bytes_per_token(m.kv_dtype)
        return m.prefix_store_mib * MIB // page

    def to_json(self) -> dict[str, Any]:
        """The public JSON form."""
        return self.model_dump(mode="json")
