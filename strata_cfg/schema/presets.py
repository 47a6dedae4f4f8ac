"""Built-in synthetic model presets, shared by the resolver (sizes) and the runtime (generation).

Each preset is a Hugging Face style ``config.json`` for the ``qwen3_moe`` architecture, plus one MTP layer
in the Qwen3-Next layout. The runtime generates the weights in place from a seed, so a preset of any size
needs no download; the resolver sizes the VRAM budget from the same numbers.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal

PresetName = Literal["tiny", "small", "qwen3-30b-a3b", "qwen3-235b-a22b"]
"""Names of the built-in synthetic presets."""

_COMMON: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "shared_expert_intermediate_size": 0,
    "num_nextn_predict_layers": 1,
}

_PRESETS: dict[str, dict[str, Any]] = {
    # The demo model: small enough for two virtual CPU devices, big enough to have every part.
    "tiny": {
        **_COMMON,
        "vocab_size": 384,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
    },
    # Exercises dense layers between sparse ones and a shared expert; still fast on a CPU.
    "small": {
        **_COMMON,
        "vocab_size": 1024,
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 2,
        "shared_expert_intermediate_size": 256,
        "max_position_embeddings": 8192,
    },
    # The shape of Qwen3-30B-A3B (the model docs/PERFORMANCE.md measures), with one MTP layer added.
    "qwen3-30b-a3b": {
        **_COMMON,
        "vocab_size": 151_936,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40_960,
    },
    # The shape of Qwen3-235B-A22B, for multi-GPU profiles.
    "qwen3-235b-a22b": {
        **_COMMON,
        "vocab_size": 151_936,
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 12_288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40_960,
    },
}

PRESET_DEFAULTS: MappingProxyType[str, MappingProxyType[str, float]] = MappingProxyType(
    {
        # layer_scale: how strongly the random layers perturb the planted token chain (see ModelSection).
        "tiny": MappingProxyType({"layer_scale": 0.05}),
        "small": MappingProxyType({"layer_scale": 0.05}),
        # Measured on an H200 (`strata bench profiles/h200.toml --workload two-decodes`, 300 tokens):
        # 0.030 accepted 97% of batch-MTP drafts, 0.033 90%, 0.034 64%, 0.035 46%, 0.037 23%.
        "qwen3-30b-a3b": MappingProxyType({"layer_scale": 0.034}),
        "qwen3-235b-a22b": MappingProxyType({"layer_scale": 0.034}),
    }
)


def preset_names() -> tuple[str, ...]:
    """The preset names, in a stable order."""
    return tuple(_PRESETS)


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of a preset's ``config.json`` dictionary."""
    try:
        cfg = _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown synthetic preset {name!r}; known: {', '.join(_PRESETS)}") from None
    return {k: (list(v) if isinstance(v, list) else v) for k, v in cfg.items()}
