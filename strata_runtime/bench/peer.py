"""Hugging Face transformers as a peer arm of `strata bench`, on the very same weights.

`TransformersPeer` builds ``Qwen3MoeForCausalLM`` on the meta device and assigns it the runtime's own device
arrays through DLPack, so both engines read identical bytes and nothing is copied. Its driver runs a
workload's requests as one left-padded greedy ``generate`` batch. This is what a user would otherwise reach
for; torch and transformers are needed only to run this arm (they are never a runtime dependency).
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

from strata_cfg.schema.plan import LaunchPlan
from strata_cfg.schema.presets import preset_config

from ..api import Tokenizer
from ..backend import Array
from ..model.placed import WeightStore
from .harness import Arrival, Result

ARM_PEERS = ("transformers",)
"""Peers that run as arms of the harness; ``llama.cpp`` runs its own tools (`bench.llamacpp`)."""


class TransformersPeer:
    """An arm that generates with transformers on a model's tensors (one device, one stage)."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, Array], tokenizer: Tokenizer) -> None:
        torch: Any = importlib.import_module("torch")  # only this arm needs torch and transformers
        transformers: Any = importlib.import_module("transformers")

        self.torch, self.tokenizer = torch, tokenizer
        cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "architectures"})
        cfg.eos_token_id = None  # generate exactly the asked number of tokens, as the other arms do
        with torch.device("meta"):
            model = transformers.Qwen3MoeForCausalLM(cfg)
        state = {name: torch.from_dlpack(arr) for name, arr in tensors.items() if not name.startswith("mtp.")}
        missing, _ = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if "rotary_emb" not in m]
        if missing:
            raise ValueError(f"transformers peer: no runtime tensor for {missing[:3]}")
        device = next(iter(state.values())).device
        # Non-persistent buffers (RoPE frequencies) were made on the meta device: rebuild them.
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg).to(device)
        self.model = model.eval()
        self.device = device

    def driver(self) -> TransformersDriver:
        return TransformersDriver(self)


class TransformersDriver:
    """Runs every arrival at once as one greedy ``generate`` batch (delayed arrivals are not modelled)."""

    def __init__(self, peer: TransformersPeer) -> None:
        self.peer = peer

    def run(self, arrivals: list[Arrival]) -> tuple[list[Result], dict[str, Any]]:
        torch = self.peer.torch
        prompts = [list(a.request.prompt_ids) for a in arrivals]
        tokens = max(a.request.max_tokens for a in arrivals)
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.peer.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only batching needs
            ids[i, width - len(p) :] = torch.tensor(p, device=self.peer.device)
            mask[i, width - len(p) :] = 1
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.peer.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        sync()
        wall = time.perf_counter() - t0
        results = [
            Result(out[i, width:].tolist(), len(p), 0.0, None, wall, 0, 0) for i, p in enumerate(prompts)
        ]
        stats = {
            "windows": tokens,
            "rows_per_window": float(len(prompts)),
            "ms_per_window": wall * 1000 / tokens,
            "proposals": 0,
            "accepted": 0,
        }
        return results, stats


def make_peer(name: str, plan: LaunchPlan, tokenizer: Tokenizer, weights: WeightStore) -> TransformersPeer:
    """The peer arm ``name`` over the tensors an engine of ``plan`` was built from (``weights``: the
    bench's shared weight store), with that engine's tokenizer."""
    if name not in ARM_PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(ARM_PEERS)}")
    if len(plan.stages) != 1:
        raise ValueError("the transformers peer runs a one-stage plan (one device)")
    tensors = next(iter(weights.stages.values())).tensors
    return TransformersPeer(model_config(plan), tensors, tokenizer)


def model_config(plan: LaunchPlan) -> dict[str, Any]:
    """The ``config.json`` dictionary of the plan's model (a synthetic preset's, or the checkpoint's)."""
    if plan.model.synthetic is not None:
        return preset_config(plan.model.synthetic)
    assert plan.model.path is not None
    config: dict[str, Any] = json.loads((Path(plan.model.path) / "config.json").read_text())
    return config
