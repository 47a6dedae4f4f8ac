"""Loading checkpoints: per-expert, fused, sharded and bfloat16 files load to the same model; a missing or
misshapen tensor is refused with its name and both shapes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from rt_plans import make_plan

from strata_cfg.schema.presets import preset_config
from strata_runtime.backend import Device
from strata_runtime.layout import Layout
from strata_runtime.model import Model
from strata_runtime.models.qwen3_moe import ModelArgs, stage_shapes
from strata_runtime.weights.checkpoint import CheckpointError
from strata_runtime.weights.synthetic import SyntheticModel


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], bf16: bool = False) -> None:
    """A minimal safetensors writer (also bfloat16: the top 16 bits of each float32)."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype=np.float32)
        data = (a.view(np.uint32) >> 16).astype(np.uint16).tobytes() if bf16 else a.tobytes()
        header[name] = {
            "dtype": "BF16" if bf16 else "F32",
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def synthetic_tensors(fused: bool) -> dict[str, np.ndarray]:
    """The tiny preset's weights, in the fused or the per-expert layout."""
    synth = SyntheticModel("tiny", seed=0, layer_scale=0.05)
    args = ModelArgs.from_config(synth.config)
    shapes = stage_shapes(args, (0, args.num_hidden_layers), first=True, last=True, mtp=True)
    tensors = synth.load(shapes, Device("cpu", 0), np.float32)
    if fused:
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, i = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = t[e, :i], t[e, i:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def save_checkpoint(
    directory: Path, tensors: dict[str, np.ndarray], *, shards: int = 1, bf16: bool = False
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(preset_config("tiny")))
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, bf16)
        return directory
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / fname, {n: tensors[n] for n in part}, bf16)
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def logits_of(plan, prompt: np.ndarray) -> np.ndarray:
    model = Model.from_plan(plan)
    return model.logits(model.forward(prompt, Layout.of([(0, len(prompt), 0)])))


PROMPT = np.array(list(b"checkpoint"))


@pytest.fixture(scope="module")
def synthetic_logits() -> np.ndarray:
    return logits_of(make_plan(stages=2, draft_tokens=3), PROMPT)


@pytest.mark.parametrize(("fused", "shards"), [(True, 1), (False, 1), (False, 3)])
def test_checkpoints_load_to_the_generated_model(tmp_path, synthetic_logits, fused, shards) -> None:
    path = save_checkpoint(tmp_path / "m", synthetic_tensors(fused), shards=shards)
    plan = make_plan(model_dir=path, stages=2, draft_tokens=3)
    assert plan.model.facts.mtp_layers == 1
    assert np.array_equal(logits_of(plan, PROMPT), synthetic_logits)


def test_bfloat16_checkpoints_load_without_torch(tmp_path) -> None:
    tensors = synthetic_tensors(False)
    path = save_checkpoint(tmp_path / "bf16", tensors, bf16=True)
    model = Model.from_plan(make_plan(model_dir=path, stages=1))
    got = model.stages[0].layers[0].self_attn.q_proj
    want = tensors["model.layers.0.self_attn.q_proj.weight"]
    truncated = ((want.view(np.uint32) >> 16) << 16).view(np.float32)  # what bfloat16 keeps
    assert got.dtype == np.float32 and np.array_equal(got, truncated)
    assert not np.array_equal(got, want)


def test_a_missing_tensor_is_named_with_its_expected_shape(tmp_path) -> None:
    tensors = synthetic_tensors(False)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    path = save_checkpoint(tmp_path / "missing", tensors)
    with pytest.raises(CheckpointError) as err:
        Model.from_plan(make_plan(model_dir=path, stages=2))
    assert str(err.value) == (
        f"{path}: tensor 'model.layers.2.mlp.experts.5.up_proj.weight' is missing "
        "(needed for model.layers.2.mlp.experts.gate_up_proj, expected shape [64, 64])"
    )


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path) -> None:
    tensors = synthetic_tensors(True)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.ones((16, 64), dtype=np.float32)
    path = save_checkpoint(tmp_path / "shape", tensors)
    with pytest.raises(CheckpointError) as err:
        Model.from_plan(make_plan(model_dir=path, stages=1))
    assert str(err.value) == (
        f"{path / 'model.safetensors'}: tensor 'model.layers.1.self_attn.k_proj.weight' has shape [16, 64], "
        "expected [32, 64]"
    )


def test_a_file_whose_header_cannot_describe_it_is_refused_with_its_name(tmp_path) -> None:
    """The loader reads headers with the facts step's reader, which checks each tensor against the file."""
    from strata_runtime.weights.checkpoint import SafetensorsFile

    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"w": np.ones((4, 4), np.float32)})
    assert SafetensorsFile(good).read("w").sum() == 16
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-8])  # the tensor's last two floats are gone
    with pytest.raises(CheckpointError, match=f"^{truncated}: not a safetensors file: tensor 'w'"):
        SafetensorsFile(truncated)
