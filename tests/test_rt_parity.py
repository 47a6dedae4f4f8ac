"""The runtime's qwen3_moe against transformers' Qwen3MoeForCausalLM on tiny random fp32 checkpoints.

Each case saves a random model to disk (``save_pretrained``: per-expert tensors; or the transformers v5
fused ``gate_up_proj``/``down_proj`` tensors written from the state dict), loads it through the runtime on
1, 2 or 3 virtual CPU stages, and compares the logits of a prompt (1e-4 relative error) and 32 greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rt_plans import make_plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import save_file  # noqa: E402

from strata_runtime.api import Request  # noqa: E402
from strata_runtime.engine import Engine  # noqa: E402
from strata_runtime.layout import Layout  # noqa: E402
from strata_runtime.model import Model  # noqa: E402

STEPS = 32


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights at unit output scale (not the tiny init std), so logits are well apart and norms matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _save(
    tmp: Path, *, norm_topk_prob: bool, sparse_step: int, fused: bool, seed: int
) -> tuple[Path, object]:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=sparse_step,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = tmp / f"m-{norm_topk_prob}-{sparse_step}-{fused}"
    model.save_pretrained(out)
    if fused:  # rewrite the weights in the v5 in-memory layout: experts.gate_up_proj / experts.down_proj
        for f in out.glob("*.safetensors"):
            f.unlink()
        tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out, model


CASES = [
    pytest.param(False, 1, False, id="topk-raw-per-expert"),
    pytest.param(True, 1, True, id="topk-norm-fused"),
    pytest.param(True, 2, False, id="sparse-step-2-per-expert"),
    pytest.param(False, 2, True, id="sparse-step-2-fused"),
]


@pytest.mark.parametrize(("norm_topk_prob", "sparse_step", "fused"), CASES)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_tokens_match_transformers(
    tmp_path: Path, norm_topk_prob: bool, sparse_step: int, fused: bool, stages: int
) -> None:
    seed = 1000 * stages + 10 * sparse_step + int(norm_topk_prob) + 2 * int(fused)
    path, hf = _save(tmp_path, norm_topk_prob=norm_topk_prob, sparse_step=sparse_step, fused=fused, seed=seed)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 96, size=int(rng.integers(5, 14))).tolist()

    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()  # [P, V]
        ref_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)[
            0, len(prompt) :
        ]

    plan = make_plan(model_dir=path, stages=stages, context=128, prefill_chunk=8)
    model = Model.from_plan(plan)
    logits = model.logits(model.forward(np.array(prompt), Layout.of([(0, len(prompt), 0)])))  # [P, V]
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"relative error {rel:.2e}"

    engine = Engine(plan)
    handle = engine.submit(Request(tuple(prompt), STEPS))
    while engine.step():
        pass
    tokens = []
    while not handle.events.empty():
        tokens += handle.events.get().token_ids
    assert tokens == ref_tokens.tolist()


def test_config_spellings_are_equivalent(tmp_path: Path) -> None:
    """``num_local_experts`` + ``rope_parameters`` (v5) read like ``num_experts`` + ``rope_theta`` (v4)."""
    from strata_runtime.models.qwen3_moe import ModelArgs

    path, _ = _save(tmp_path, norm_topk_prob=True, sparse_step=1, fused=False, seed=3)
    v5 = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in v5 and "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k not in ("num_local_experts", "rope_parameters")}
    v4.update(num_experts=v5["num_local_experts"], rope_theta=v5["rope_parameters"]["rope_theta"])
    assert ModelArgs.from_config(v4) == ModelArgs.from_config(v5)
    assert ModelArgs.from_config(v5).num_experts == 6
