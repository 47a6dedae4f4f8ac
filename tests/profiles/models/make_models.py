"""Writes the two tiny checkpoint fixtures the config tests read: `mtp-micro/` and `nomtp-micro/`.

Each is a Hugging Face style directory (config.json plus one bf16 safetensors file) of a 3-layer qwen3_moe
model small enough to commit; `mtp-micro` adds one MTP layer under `mtp.*`. Only the headers matter to the
resolver; the values are seeded random so the files are ordinary checkpoints. Run from anywhere:
`python tests/profiles/models/make_models.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 48,
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "moe_intermediate_size": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def layer_tensors(prefix: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, hd, e, w = (
        CONFIG["hidden_size"],
        CONFIG["head_dim"],
        CONFIG["num_experts"],
        CONFIG["moe_intermediate_size"],
    )
    q, kv = CONFIG["num_attention_heads"] * hd, CONFIG["num_key_value_heads"] * hd
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate.weight": (e, h),
    }
    for i in range(e):
        shapes |= {
            f"mlp.experts.{i}.gate_proj.weight": (w, h),
            f"mlp.experts.{i}.up_proj.weight": (w, h),
            f"mlp.experts.{i}.down_proj.weight": (h, w),
        }
    return {f"{prefix}.{k}": rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write(directory: Path, *, mtp: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    tensors = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32)}
    for layer in range(CONFIG["num_hidden_layers"]):
        tensors |= layer_tensors(f"model.layers.{layer}", rng)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = rng.standard_normal((v, h)).astype(np.float32)
    config = dict(CONFIG)
    if mtp:
        tensors |= layer_tensors("mtp.layers.0", rng)
        for name, shape in {
            "mtp.enorm.weight": (h,),
            "mtp.hnorm.weight": (h,),
            "mtp.fc.weight": (h, 2 * h),
            "mtp.norm.weight": (h,),
        }.items():
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        config["num_nextn_predict_layers"] = 1
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: torch.from_numpy(t).to(torch.bfloat16) for k, t in tensors.items()},
        directory / "model.safetensors",
    )


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "mtp-micro", mtp=True, seed=1)
    write(here / "nomtp-micro", mtp=False, seed=2)
