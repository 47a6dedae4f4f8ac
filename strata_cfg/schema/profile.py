"""The profile schema: what a user may write in a `*.toml` hardware profile.

Every field is optional and defaults to ``None``, which means *unset*. Defaults are applied in one place,
during resolution (`strata_cfg.resolve`), where each applied default is recorded as such. That keeps what
the user wrote distinguishable from what the tool chose, all the way into the launch plan.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .packaged import PackagedName
from .presets import PresetName

Backend = Literal["cuda", "cpu"]
DType = Literal["float32", "float16", "bfloat16"]
Routing = Literal["uniform", "calibrated"]
PrefillQ = Literal["split", "fp16"]
DecodeAttention = Literal["auto", "cuda_cores"]
KvDType = Literal["float32", "float16", "bfloat16"]
SpecMethod = Literal["mtp", "ngram"]
DraftHead = Literal["auto", "shared", "int8"]

_DEVICE_RE = re.compile(r"^(?:(?P<host>[A-Za-z0-9_.-]+):)?(?P<index>\d+)$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ORIGIN_RE = re.compile(r"^https?://[^/\s:]+(:[0-9]{1,5})?$")

DeviceSpec = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=_DEVICE_RE.pattern)]
"""A GPU index (``1``), or ``"host:index"`` (``"local:1"``) naming the host that holds it."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_device(spec: int | str) -> tuple[str, int]:
    """Split a device spec into ``(host, index)``; a bare index is on host ``local``."""
    if isinstance(spec, int):
        return "local", spec
    m = _DEVICE_RE.match(spec)
    if m is None:  # the schema pattern already refused it; this guards direct callers
        raise ValueError(f"not a device: {spec!r}")
    return m.group("host") or "local", int(m.group("index"))


class Section(BaseModel):
    """Base of every profile table: strict, frozen, documented.

    Strict means no coercion: ``slots = "2"``, ``mtp = "no"`` and ``--set batch.slots=true`` are errors, not
    2, False and 1. Only an integer is taken where a float is expected (TOML writes ``760`` for 760.0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


class GpuSpec(Section):
    """One GPU of the machine, as the resolver needs to know it."""

    name: str = Field(min_length=1)
    """Marketing name, for display only (``"RTX 3080 20GB"``)."""
    vram_mib: int = Field(gt=0, le=4 * 1024 * 1024)
    """Total memory of the card in MiB, as `nvidia-smi` reports it."""
    bandwidth_gbs: float = Field(gt=0, le=100_000)
    """Memory bandwidth in GB/s. Decode is memory-bound, so this is the GPU's speed for the auto split."""


class MachineSection(Section):
    """The machine this profile describes: its GPUs, written out or probed."""

    gpus: list[GpuSpec] | None = Field(default=None, min_length=1, max_length=16)
    """The GPUs, in CUDA device order. Give this, or ``probe = true``."""
    probe: bool | None = None
    """Fill the GPU list from the machine `strata` runs on (nvidia-smi), before resolving."""
    backend: Backend | None = None
    """``"cuda"`` (default) runs on real GPUs; ``"cpu"`` runs each listed GPU as a virtual NumPy device."""
    host_ram_mib: int | None = Field(default=None, gt=0, le=1 << 30)
    """Host memory the engine may pin, in MiB: the host tier of experts that do not fit in VRAM must fit
    in it. Default: probed from /proc/meminfo with ``probe = true``, else unknown (not checked)."""

    @model_validator(mode="after")
    def _gpus_or_probe(self) -> MachineSection:
        if self.gpus is not None and self.probe:
            raise ValueError("give either `gpus` or `probe = true`, not both")
        return self


class ModelSection(Section):
    """Which model to run: a Hugging Face style directory, a packaged model or a built-in synthetic preset."""

    path: str | None = Field(default=None, min_length=1)
    """A model directory (``config.json`` plus safetensors), relative to the profile file or absolute."""
    synthetic: PresetName | None = None
    """A built-in seeded random model, generated in place on each device (no download)."""
    packaged: PackagedName | None = None
    """A trained model that ships with strata: ``"austen"``, a few-MB byte-level toy trained on Jane
    Austen's novels, with an MTP head (the demo's model; it writes English-like prose, not answers)."""
    dtype: DType | None = None
    """Weight and activation precision on GPUs (default ``"float16"``; a bfloat16 or float32 checkpoint is
    converted on load). Virtual CPU devices always use float32."""
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    """Synthetic models only: the seed the weights are generated from (default 0)."""
    layer_scale: float | None = Field(default=None, ge=0.0, le=10.0)
    """Synthetic models only: scale on each layer's output into the residual stream. Small values keep the
    preset's planted token chain dominant, so MTP drafts are accepted often; large values let the random
    layers change the next token, so drafts are rejected. Default: the preset's own."""
    routing: Routing | None = None
    """Synthetic models only: how the router picks experts. ``"uniform"`` (default): the random router, every
    expert about equally likely at every token, the worst case for an expert cache. ``"calibrated"``: skewed
    within a request and persistent from token to token, like a real model's (docs/RUNTIME.md); the router
    still decides, through a bias on its logits."""
    prefill_q: PrefillQ | None = None
    """How prompt attention on the GPU holds each query. ``"split"`` (default): as two fp16 parts, so scores
    keep the query's fp32 precision. ``"fp16"``: rounded to fp16, as FlashAttention and llama.cpp compute
    it: faster on long prompts, and each score moves by up to about 2^-11 of its size. Decode windows and
    CPU devices are not affected."""
    decode_attention: DecodeAttention | None = None
    """Which kernel runs decode attention on a GPU. ``"auto"`` (default): on tensor cores where the model's
    shape allows (head dim 16, 32, 64 or 128, at most 16 query heads per KV head: every preset), a row
    read by one block up to 192 positions, streamed by at most 16 up to 8,192 and by 64 past that; else on
    CUDA cores. ``"cuda_cores"``: the CUDA-core kernel for every shape, which on an H200 ran one- and
    two-row windows up to 2% faster from about 200 to 1,000 positions into a context, and every window slower
    before that and past a few thousand (docs/PERFORMANCE.md). CPU devices are not affected."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        given = [k for k in ("path", "synthetic", "packaged") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of `path`, `synthetic` or `packaged`, not {' and '.join(given)}")
        if self.synthetic is None and self.routing == "calibrated":
            raise ValueError(
                '`routing = "calibrated"` is for synthetic presets; a checkpoint routes by its own router'
            )
        return self


class SplitSection(Section):
    """How the model's layers are split into pipeline stages across GPUs (`--layer-split`)."""

    layers: list[int] | Literal["auto"] | None = None
    """The first layer of each later stage, rising (``[23]`` gives stages [0, 23) and [23, n)), or
    ``"auto"`` to balance the stages by GPU speed and memory. Absent: one stage."""
    devices: list[DeviceSpec] | None = Field(default=None, min_length=1, max_length=8)
    """The GPU of each stage, in stage order (``--split-device``). Default: 0, 1, 2, ..."""
    test_shared_gpu: bool | None = None
    """Allow two stages on one GPU. For testing the split code paths on one card; turns batching off."""
    # A range, not Literal[0, 1, 2]: the literals would take `true` for 1, even in strict mode.
    pipeline_windows: int | None = Field(default=None, ge=0, le=2)
    """Overlapped windows on a two-stage split for the solo path (``--pipeline-windows``): 0 (off), 1 or 2."""


class BatchSection(Section):
    """Concurrent request slots and how they are scheduled through the stages."""

    slots: int | None = Field(default=None, ge=0, le=64)
    """Concurrent decode slots (``--batch``); 0 or 1 means no batching."""
    groups: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] | None = None
    """Slot groups pipelined through the stages (``--batch-groups``). Absent: chosen for you, and one group
    when batch MTP can run. ``"auto"``: the largest divisor of the slots that is at most the stage count."""
    mtp: bool | None = None
    """Per-slot MTP drafters in batch windows (``--batch-mtp``): each slot sends its token and one drafted
    proposal through every stage."""
    mtp_in_groups: bool | None = None
    """Run batch MTP inside each pipelined group instead of turning it off when ``groups`` is more than 1 on
    a split (default false). Each group's window carries 2 rows per slot, so at most 4 slots per group. An
    extension beyond the reference engine, which refuses the combination."""
    run_ahead: int | None = Field(default=None, ge=1, le=8)
    """Plain decode windows in flight at once (default 2): each next window reads the tokens the one before
    it chose on the GPU, so the GPU does not wait for the host between them. 1 runs each window alone. A
    request that stops computes at most ``run_ahead - 1`` windows past its stop, which are discarded."""


class SpecSection(Section):
    """Speculative decoding on the solo path: proposals from the model's MTP head, or from n-gram lookup in
    the request's own text, verified by the model in one window."""

    method: SpecMethod | None = None
    """Where proposals come from. ``"mtp"`` (default): the model's MTP head drafts them, chained, one head
    pass each; a model without MTP weights does not draft. ``"ngram"``: n-gram lookup (prompt lookup
    decoding), for any model: the request's latest ``ngram_max`` down to ``ngram_min`` tokens are looked up
    earlier in its prompt and reply, and the tokens that followed their latest match are proposed. It costs
    no head pass and no drafter memory; its proposals hold where a reply repeats its context (code edits,
    quoting, a list continued, a loop), and seldom elsewhere; a reply held to a grammar does not look up.
    With several slots, windows of several take looked-up proposals in the rows they spare too. Batch MTP
    drafts with the MTP head, so it is off with ``"ngram"``."""
    draft_tokens: int | None = Field(default=None, ge=0, le=8)
    """Speculative window (``--spec``): the token plus up to T-1 proposals (chained MTP proposals, or the
    tokens that followed an n-gram match), verified in one window of at most 8 rows. 2 or more enables
    drafting; 0 or 1 turns it off. Default 4 with MTP weights or ``method = "ngram"``, else 0."""
    ngram_min: int | None = Field(default=None, ge=1, le=16)
    """``method = "ngram"`` only: the shortest run of the request's latest tokens a lookup matches (default 2,
    or ``ngram_max`` where that is less). Shorter runs find a match more often, and more of those matches
    propose tokens that do not hold."""
    ngram_max: int | None = Field(default=None, ge=1, le=16)
    """``method = "ngram"`` only: the longest run of the request's latest tokens a lookup matches (default
    4, or ``ngram_min`` where that is more); the longest run that matches is used. At least ``ngram_min``.
    These are lengths of the run matched, not of the proposals: ``draft_tokens`` bounds those."""
    draft_floor: float | None = Field(default=None, ge=0.0, le=1.0)
    """Drafting pauses for a request while fewer than this share of its windows' first proposals hold
    (default 0.25), with a probe window now and then to measure again (a plain greedy request alone probes
    silently instead: its drafting head's proposal is checked against the next token, one window into a
    pause and then twice as far apart after each that fails, up to 8 windows); 0
    never pauses. Windows with one proposal per slot cost about twice the rows for (1 + acceptance) tokens
    per slot, so drafting under about a quarter accepted loses on the GPUs measured; a GPU whose wider
    windows cost relatively less can set it lower."""
    draft_head: DraftHead | None = None
    """The LM head the MTP head drafts through. ``"int8"``: a copy of the model's with 8-bit weights and one
    scale per vocabulary row, made on the last stage when the engine loads (vocab x hidden bytes more there,
    half the fp16 head): each draft step then reads half the bytes through the head, which is most of what
    a draft step reads. ``"shared"``: the model's own, as the checkpoint shares it between the model and its
    MTP head. ``"auto"`` (default): ``"int8"`` on GPUs where the copy displaces no routed expert from VRAM
    (no expert cache holds fewer for it), else ``"shared"``. Proposals can differ where two tokens' draft
    logits are nearly equal; what is emitted does not, since the model verifies every proposal with its own
    head (greedy text is the same, and sampled drafting keeps the model's distribution). Does nothing where
    the MTP head does not draft."""
    adaptive_depth: bool | None = None
    """Whether a request running alone drafts only as many of the window's proposals as pay (default
    true): the depth that gives the most tokens per second, from the request's measured acceptance at
    each position and the engine's measured window times; and whether, in serial mode, slots decoding
    together take batch-MTP windows only where those give more tokens per second than serial windows,
    by both kinds' measured times. False: every drafting window carries all ``draft_tokens - 1``
    proposals, and batch MTP follows ``draft_floor`` alone. A seeded sampled request always drafts as
    with false, so that its seed gives the same text on every run."""

    @field_validator("ngram_max")
    @classmethod
    def _ngram_order(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("ngram_min")
        if value is not None and low is not None and low > value:
            raise ValueError(
                f"`ngram_max = {value}` is less than `ngram_min = {low}`: a lookup matches the latest "
                "ngram_max down to ngram_min tokens, so ngram_min must not be more than ngram_max"
            )
        return value


class MemorySection(Section):
    """VRAM reserve, context length and KV precision."""

    vram_reserve_mib: int | None = Field(default=None, ge=0, le=1024 * 1024)
    """VRAM left free on the first GPU, in MiB (default 700)."""
    vram_reserve_later_mib: int | None = Field(default=None, ge=0, le=1024 * 1024)
    """VRAM left free on every later GPU, in MiB (default: the same as ``vram_reserve_mib``)."""
    context: int | None = Field(default=None, ge=16, le=1 << 20)
    """Context length of each slot in tokens (``--max-context``); default 4096, capped by the model's own."""
    kv_dtype: KvDType | None = None
    """KV cache precision (``--kv``); default: the model's dtype."""
    host_reserve_mib: int | None = Field(default=None, ge=0, le=1 << 30)
    """Host memory left for everything but the host tier of experts, in MiB (default 4096): the checkpoint
    reader, the server, the operating system."""
    prefill_chunk: int | None = Field(default=None, ge=8, le=1 << 16)
    """Prompt tokens read per prefill window (default 512). Bigger reads prompts faster and needs more
    activation workspace."""
    prefill_chunk_alone: int | None = Field(default=None, ge=8, le=1 << 16)
    """Prompt tokens per prefill window while that prompt is the engine's only work: no stream decoding, no
    other prompt waiting (serial windows; default: ``prefill_chunk``, or under an expert cache up to 4096
    where the workspace costs at most 1/32 of the cache's slots). A lone prompt then reads in fewer, longer
    windows, and nothing waits behind them; the workspace is planned for that many rows."""
    prompt_graph_rows: Annotated[int, Field(ge=8, le=64)] | Literal["auto"] | None = None
    """On a GPU, prompt chunks of at most this many rows run as 8-row decode graph windows; longer ones take
    the prefill path (cuBLAS products, launched layer by layer from Python). ``"auto"`` (default): as many
    windows as cost less than the prefill path's launches, from the model's bytes and the GPUs' bandwidth
    (8 to 64 rows)."""
    prefill_graph_rows: Annotated[int, Field(ge=0, le=1 << 16)] | Literal["auto"] | None = None
    """On a GPU, a prompt chunk through the prefill path is padded to the next power of two of rows (at
    least 16; past 128, the next multiple of 64) and replayed as a CUDA graph where that is at most this
    many rows, so the host does not launch its kernels one by one; 0 launches every chunk. ``"auto"``
    (default): 512, or the longest chunk where that is shorter; 0 on virtual CPU devices and under an
    expert cache."""
    prefix_reuse: bool | None = None
    """Whether a free slot keeps its last request's KV (default true): a new request takes the free slot
    whose kept tokens share the longest prefix with its prompt, and reads only the rest. A chat's next turn
    or a repeated system prompt then skips what was read before. A request reuses only what was sent with
    its own ``cache_salt`` (an API extension for servers that several parties share). False: every request
    reads its whole prompt."""
    prefix_store_mib: int | None = Field(default=None, ge=0, le=1 << 30)
    """Host memory, in MiB, for kept prefixes that no slot holds any more (default 0: none). When a request
    takes a free slot and does not reuse what that slot kept, at least 64 tokens that no other slot holds
    are first copied into host memory; a later request that begins with them copies them back instead of
    reading them (a conversation whose slot another client took, an agent's instructions after a burst of
    other work). The least recently used go first. Pinned on a GPU machine; counted in the host budget.
    Needs ``prefix_reuse``."""


class ExpertsSection(Section):
    """Where the MoE experts live."""

    cache: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    """VRAM expert-cache slots (``--expert-cache``); ``"auto"`` (default): what fits after everything else."""
    helper_devices: list[int] | None = Field(default=None, max_length=3)
    """Helper GPUs that hold only experts, no stage (``--expert-cache-device1..3``)."""
    remote_opt: bool | None = None
    """Remote expert optimisation (``--remote-expert-opt``)."""
    peer_device: int | None = Field(default=None, ge=0)
    """A GPU holding a second adaptive expert cache over P2P (``--peer-device``)."""
    adapt: bool | None = None
    """Whether the expert cache follows the routing (default true): every few windows the most used experts
    that hold no VRAM slot replace the least used ones that do. False freezes it at its first contents."""
    score_decay: float | None = Field(default=None, gt=0, lt=1)
    """How fast the cache forgets (default 0.95 where it keeps its misses, else 0.9): each window multiplies
    every expert's score, its decayed count of uses, by this before adding the window's own uses."""
    rebalance_every: int | None = Field(default=None, ge=1)
    """Windows between rebalances of the cache (default 4); a prompt chunk read in one window brings one at
    once."""
    swap_margin: float | None = Field(default=None, ge=0)
    """How much higher a missing expert's score must be than a resident one's for it to take that slot
    (default 3): each swap copies an expert over the host link, so it must pay for itself."""
    max_swaps: int | None = Field(default=None, ge=1)
    """Swaps per rebalance at most (default 512); a rebalance cut at the cap goes on at the next window, so a
    lower cap spreads a new request's swaps, and the pause their copies bring, over several windows."""
    keep_misses: bool | None = None
    """Whether the cache keeps the experts the kernels read from host memory (default true): instead of
    copying swaps, each rebalance queues the ``max_swaps`` least used experts in VRAM, and each expert a
    window reads from host memory takes the next queued slot, written there as it is read, so keeping it
    costs no second crossing of the host link. Not with helper GPUs or a peer device, whose tier adapts by
    swaps; false by default where a cache holds fewer than twice a token's experts a layer, where keeping
    every miss would churn."""
    recall_stored: bool | None = None
    """Whether a conversation copied back from the prefix store brings back the experts it routed to (default
    true): what the cache had learned when its slot was released is added to the cache's scores, and the
    cache rebalances at once, as after a prompt chunk, since the history copied back is not read again."""


class ServeSection(Section):
    """Serve requests over HTTP. Without this table the profile is a one-shot generation profile."""

    host: str | None = Field(default=None, min_length=1)
    """Address to bind (default ``127.0.0.1``). Anything but loopback exposes the model to the network."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """TCP port (default 8000)."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the API key. The key itself never goes in a profile."""
    model_name: str | None = Field(default=None, min_length=1)
    """Model id reported by ``/v1/models`` and accepted in requests (default: the profile's name)."""
    allowed_origins: list[str] | None = None
    """Web origins whose pages may call the API from a browser (CORS): ``"*"`` for any, or each as
    ``scheme://host[:port]`` (default: none, so a page of another origin cannot read the answers)."""
    warm_up: bool | None = None
    """Run every decode window shape before answering, so that the first requests find their CUDA graphs
    captured (default true; nothing to do on CPU devices)."""
    recoveries: int | None = Field(default=None, ge=0)
    """Failed engine steps the server recovers from within ten minutes: the requests the engine was running
    are carried on (a request held by a second failed step within 64 tokens of the first is ended with an
    error), the queue is served on, and nothing is loaded again (default 3). One more within the ten
    minutes, or any that a self-check finds left the model computing something else, ends the server, as a
    failure to load does; 0 ends it at the first."""
    step_timeout_s: float | None = Field(default=None, ge=0)
    """Seconds one step of the engine may take before the server counts it as hung and ends, so that its
    supervisor starts it again (default 300; 0: never). A GPU or kernel that hangs never gives the step
    back: without this, ``/health`` would say ready while nothing is served."""
    max_queued: int | None = Field(default=None, ge=0)
    """Requests that may wait for a free batch slot. A generation request that would bring more than
    ``batch.slots`` plus these in flight is answered 429 at once, with ``Retry-After``, instead of waiting
    (default: no bound)."""

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str] | None) -> list[str] | None:
        for origin in v or []:
            if origin != "*" and not _ORIGIN_RE.match(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: give `*` or `scheme://host[:port]`, with no path or "
                    "trailing slash (as a browser sends it in `Origin`)"
                )
        return v

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not _ENV_NAME_RE.match(v):
            raise ValueError(
                "must be an environment variable name such as STRATA_API_KEY, not the key itself"
            )
        return v


class Profile(Section):
    """A hardware profile: one machine, one model, and how to run it."""

    name: str | None = Field(default=None, min_length=1)
    """A short name for the profile (default: the file's stem)."""
    description: str | None = None
    """Free text shown in listings."""
    extends: str | None = None
    """A base profile to inherit from, relative to this file. Keys here override the base's."""
    machine: MachineSection | None = None
    """The machine's GPUs."""
    model: ModelSection | None = None
    """The model to run."""
    split: SplitSection | None = None
    """The layer split over GPUs."""
    batch: BatchSection | None = None
    """Batch slots and groups."""
    spec: SpecSection | None = None
    """Speculative decoding."""
    memory: MemorySection | None = None
    """Memory settings."""
    experts: ExpertsSection | None = None
    """Expert placement."""
    serve: ServeSection | None = None
    """HTTP serving; present means the profile serves requests."""
