"""Facts the resolver takes as given: the machine's GPUs and the model's shapes.

Both are gathered *before* resolution (from the profile, a probe, a ``config.json`` or a preset), so that
`resolve` stays a pure function. `ModelFacts` also knows the exact byte size of every tensor group, which
the VRAM budget is built from.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .profile import Backend

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def run_dtype(backend: str, asked: str | None, default: str = "float16") -> str:
    """The precision weights sit in on the device: float32 on virtual CPU devices, else as asked.

    The facts step gives a model this dtype, and the resolver's step 0 records it as ``model.dtype``.
    """
    if backend == "cpu":
        return "float32"
    return asked or default


# Sanity bounds on a checkpoint's dimensions: far above any real model, low enough that the sizes the budget
# multiplies out stay plain integers and a corrupt or hostile config.json is refused by name.
MAX_VOCAB = 1 << 22
MAX_HIDDEN = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_WIDTH = 1 << 20
MAX_EXPERTS = 1 << 14
MAX_POSITIONS = 1 << 24
MAX_MTP_LAYERS = 16


MTP_WHOLE_MOST = 1 / 8
"""The share of a GPU's expert slots the MTP head's routed experts may take to be held whole (rule
``experts.mtp-whole``)."""


def mtp_experts_whole(mtp_experts: int, slots: int) -> bool:
    """Whether an expert cache of ``slots`` VRAM slots holds every one of the MTP head's ``mtp_experts``
    routed experts: where they take at most `MTP_WHOLE_MOST` of the slots. That layer runs on the drafters'
    stream, which the cache's moves are not ordered with, so it cannot follow its routing; an even share
    would leave it the experts of the lowest ids whatever it routes to."""
    return 0 < mtp_experts <= slots * MTP_WHOLE_MOST


def expected_distinct_experts(n_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts that ``rows`` rows route to under uniform random routing (exactly top-k at 1 row)."""
    if n_experts == 0 or top_k == 0:
        return 0.0
    if rows <= 1:
        return float(min(top_k, n_experts))
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


class ModelConfig(BaseModel):
    """The fields of a ``qwen3_moe`` ``config.json`` that strata reads, strictly typed and bounded.

    Strict: ``"hidden_size": "64"`` is an error, not 64. Other fields of the file are ignored.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model_type: str = "qwen3_moe"
    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS)
    num_key_value_heads: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    head_dim: int | None = Field(default=None, ge=1, le=MAX_HEAD_DIM)
    intermediate_size: int = Field(default=0, ge=0, le=MAX_WIDTH)
    moe_intermediate_size: int = Field(default=0, ge=0, le=MAX_WIDTH)
    num_experts: int | None = Field(default=None, ge=0, le=MAX_EXPERTS)
    num_local_experts: int | None = Field(default=None, ge=0, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    shared_expert_intermediate_size: int | None = Field(default=None, ge=0, le=MAX_WIDTH)
    decoder_sparse_step: int | None = Field(default=None, ge=1, le=MAX_LAYERS)
    mlp_only_layers: list[int] | None = None
    max_position_embeddings: int = Field(default=32768, ge=1, le=MAX_POSITIONS)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int | None = Field(default=None, ge=0, le=MAX_MTP_LAYERS)
    mtp_num_hidden_layers: int | None = Field(default=None, ge=0, le=MAX_MTP_LAYERS)

    @property
    def experts(self) -> int:
        """The routed-expert count, under either spelling."""
        return self.num_experts if self.num_experts is not None else (self.num_local_experts or 0)

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(
                f"no head_dim, and hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{heads}"
            )
        if kv is not None and heads % kv:
            raise ValueError(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
        if self.num_experts_per_tok > self.experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} is more than the {self.experts} experts"
            )
        outside = [n for n in self.mlp_only_layers or () if not 0 <= n < self.num_hidden_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of the model")
        return self


class ConfigError(ValueError):
    """A config.json that `ModelConfig` refuses: one plain line per offending field."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("; ".join(messages))
        self.messages = messages


def _config_messages(exc: ValidationError) -> list[str]:
    """``field: expected ... (got ...)``, one line per field that is missing, mistyped or out of bounds."""
    out = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "expected")
        msg = msg.replace("Field required", "required")
        got = "" if err["type"] in ("missing", "value_error") else f" (got {_short(err.get('input'))})"
        out.append(f"{key}: {msg}{got}" if key else f"{msg}{got}")
    return out


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class GpuFacts(_Facts):
    """One GPU as the resolver sees it."""

    index: int = Field(ge=0)
    """CUDA device ordinal (or virtual CPU device number)."""
    name: str
    """Display name."""
    vram_mib: int = Field(gt=0)
    """Total memory in MiB."""
    bandwidth_gbs: float = Field(gt=0)
    """Memory bandwidth in GB/s, the GPU's speed for placement."""
    bandwidth_estimated: bool = False
    """True when a probe did not know the card and ``bandwidth_gbs`` is a guess."""


class MachineFacts(_Facts):
    """The machine: its backend and GPUs."""

    backend: Backend = "cuda"
    """``cuda`` for real GPUs; ``cpu`` for virtual CPU devices running NumPy."""
    gpus: tuple[GpuFacts, ...]
    """GPUs in device order."""
    source: Literal["profile", "probe"] = "profile"
    """Where the GPU list came from."""
    host: str = "local"
    """The host these GPUs are on."""
    host_ram_mib: int | None = Field(default=None, gt=0)
    """Host memory the engine may pin, in MiB; None when unknown (then nothing checks the host tier)."""
    host_ram_source: Literal["profile", "probe"] | None = None
    """Where ``host_ram_mib`` came from: ``machine.host_ram_mib``, or /proc/meminfo when probing."""

    def device_name(self, index: int) -> str:
        """``cuda:N`` or ``cpu:N``."""
        return f"{self.backend}:{index}"


class ModelFacts(_Facts):
    """A ``qwen3_moe`` model's shapes, enough to size and place it."""

    source: str
    """``synthetic:<preset>`` or the model directory."""
    model_type: str = "qwen3_moe"
    """The checkpoint's architecture id."""
    dtype: Literal["float32", "float16", "bfloat16"]
    """Weight precision as it will sit on the device."""
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(ge=0)
    """Width of dense (non-MoE) MLP layers."""
    moe_intermediate_size: int = Field(ge=0)
    """Width of one expert."""
    num_experts: int = Field(ge=0)
    num_experts_per_tok: int = Field(ge=0)
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    """Width of the shared expert; 0 means none."""
    decoder_sparse_step: int = Field(default=1, ge=1)
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = Field(default=32768, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mtp_layers: int = Field(default=0, ge=0)
    """MTP decoder layers present in the weights (0: the model cannot draft)."""

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, source: str, dtype: str, mtp_layers: int | None = None
    ) -> ModelFacts:
        """Build facts from a ``config.json`` dictionary (either spelling of the expert count).

        Raises `ConfigError` naming each field that is missing, of the wrong type, or out of bounds
        (`ModelConfig`).
        """
        try:
            c = ModelConfig.model_validate(config)
        except ValidationError as exc:
            raise ConfigError(_config_messages(exc)) from None
        n_heads = c.num_attention_heads
        if mtp_layers is None:
            mtp_layers = (
                c.num_nextn_predict_layers
                if c.num_nextn_predict_layers is not None
                else (c.mtp_num_hidden_layers or 0)
            )
        return cls(
            source=source,
            model_type=c.model_type,
            dtype=dtype,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=c.num_key_value_heads or n_heads,
            head_dim=c.head_dim or c.hidden_size // n_heads,
            intermediate_size=c.intermediate_size,
            moe_intermediate_size=c.moe_intermediate_size,
            num_experts=c.experts,
            num_experts_per_tok=c.num_experts_per_tok,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size or 0,
            decoder_sparse_step=c.decoder_sparse_step or 1,
            mlp_only_layers=tuple(c.mlp_only_layers or ()),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
            mtp_layers=mtp_layers,
        )

    # ---- structure -------------------------------------------------------------------------------

    @property
    def has_mtp(self) -> bool:
        """Whether the weights include an MTP head that can draft."""
        return self.mtp_layers > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether main-model layer ``layer`` has an MoE block (transformers' Qwen3-MoE rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    # ---- sizes in bytes ----------------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight element."""
        return DTYPE_BYTES[self.dtype]

    def attention_bytes(self) -> int:
        """One decoder layer's attention and norms: q/k/v/o projections, q/k norms, two RMSNorms."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        n = h * q + 2 * h * kv + q * h + 2 * hd + 2 * h
        if self.attention_bias:
            n += q + 2 * kv
        return n * self.weight_bytes

    def expert_bytes(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size * self.weight_bytes

    def moe_dense_bytes(self) -> int:
        """The parts of an MoE block that are not routed experts: the router and the shared expert."""
        h = self.hidden_size
        n = self.num_experts * h
        if self.shared_expert_intermediate_size:
            n += 3 * h * self.shared_expert_intermediate_size + h
        return n * self.weight_bytes

    def dense_mlp_bytes(self) -> int:
        """A dense (non-MoE) layer's SwiGLU MLP."""
        return 3 * self.hidden_size * self.intermediate_size * self.weight_bytes

    def layer_bytes(self, layer: int) -> tuple[int, int]:
        """``(non-expert bytes, routed-expert bytes)`` of main-model layer ``layer``."""
        if self.is_sparse(layer):
            return self.attention_bytes() + self.moe_dense_bytes(), self.num_experts * self.expert_bytes()
        return self.attention_bytes() + self.dense_mlp_bytes(), 0

    def layer_experts(self, layer: int) -> int:
        """Routed experts in layer ``layer`` (0 for a dense layer)."""
        return self.num_experts if self.is_sparse(layer) else 0

    def embedding_bytes(self) -> int:
        """The token embedding."""
        return self.vocab_size * self.hidden_size * self.weight_bytes

    def head_bytes(self) -> int:
        """The final norm and the LM head (the head is free when tied to the embedding)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (head + self.hidden_size) * self.weight_bytes

    def int8_head_bytes(self) -> int:
        """The LM head as 8-bit weights with a float32 scale a vocabulary row: the copy the MTP head drafts
        through under ``spec.draft_head = "int8"``."""
        return self.vocab_size * self.hidden_size + 4 * self.vocab_size

    def mtp_bytes(self) -> tuple[int, int]:
        """``(non-expert bytes, routed-expert bytes)`` of the MTP head: its norms, fc, layers and norm."""
        if not self.has_mtp:
            return 0, 0
        h = self.hidden_size
        own = (2 * h + 2 * h * h + h) * self.weight_bytes
        dense = self.mtp_layers * (self.attention_bytes() + self.moe_dense_bytes())
        experts = self.mtp_layers * self.num_experts * self.expert_bytes()
        return own + dense, experts

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """KV bytes one token occupies in one layer: keys and values."""
        return 2 * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[kv_dtype]
