"""The facts step: GPUs from the profile or nvidia-smi, model shapes from presets or checkpoint headers."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from cfg_fixtures import FIXTURES, line_of

from strata_cfg.facts.gather import gather_facts
from strata_cfg.facts.machine import ESTIMATED_BANDWIDTH_GBS, known_bandwidth, machine_facts, parse_nvidia_smi
from strata_cfg.facts.model import model_facts
from strata_cfg.profile.load import load_profile, load_profile_text
from strata_cfg.schema.errors import ProfileError
from strata_cfg.schema.presets import preset_config

MODELS = FIXTURES / "models"
SMI = "0, NVIDIA H200, 143771\n1, NVIDIA GeForce RTX 3080 Ti, 12288\n2, Mystery Accelerator 9000, 24576\n"


def test_nvidia_smi_output_becomes_gpu_facts_with_known_or_flagged_bandwidth():
    gpus = parse_nvidia_smi(SMI)
    assert [(g.index, g.vram_mib) for g in gpus] == [(0, 143771), (1, 12288), (2, 24576)]
    assert [g.bandwidth_gbs for g in gpus] == [4800, 912, ESTIMATED_BANDWIDTH_GBS]
    assert [g.bandwidth_estimated for g in gpus] == [False, False, True]


def test_longest_known_name_wins():
    assert known_bandwidth("NVIDIA GeForce RTX 3080") == 760
    assert known_bandwidth("NVIDIA GeForce RTX 3080 Ti") == 912
    assert known_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert known_bandwidth("Something Else") is None


def test_probe_is_used_only_when_asked():
    lp = load_profile_text('[machine]\nprobe = true\n[model]\nsynthetic = "tiny"\n', "p.toml")
    machine = machine_facts(lp, probe=lambda: SMI)
    assert machine.source == "probe" and len(machine.gpus) == 3 and machine.backend == "cuda"


def test_failed_probe_names_the_probe_line():
    lp = load_profile_text('[model]\nsynthetic = "tiny"\n[machine]\nprobe = true\n', "p.toml")

    def broken() -> str:
        raise OSError("nvidia-smi was not found on PATH")

    with pytest.raises(ProfileError) as err:
        machine_facts(lp, probe=broken)
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == ("p.toml", 4, "machine.probe")
    assert "nvidia-smi was not found" in p.message and "[machine] gpus" in p.message


def test_preset_facts_follow_the_preset_config():
    lp = load_profile_text('[model]\nsynthetic = "qwen3-30b-a3b"\n', "p.toml")
    facts = model_facts(lp, "cuda")
    cfg = preset_config("qwen3-30b-a3b")
    assert facts.dtype == "float16" and facts.source == "synthetic:qwen3-30b-a3b"
    assert (facts.num_hidden_layers, facts.num_experts, facts.mtp_layers) == (
        cfg["num_hidden_layers"],
        128,
        1,
    )
    assert model_facts(lp, "cpu").dtype == "float32"


def test_model_dir_gives_mtp_layers_and_dtype_from_the_headers():
    lp = load_profile(
        FIXTURES / "rules" / "spec.needs-mtp-weights.toml", [("model.path", str(MODELS / "mtp-micro"))]
    )
    facts = model_facts(lp, "cuda")
    # A bfloat16 checkpoint runs in float16 on GPUs unless model.dtype asks otherwise (converted on load).
    assert facts.mtp_layers == 1 and facts.dtype == "float16"
    assert facts.source == str((MODELS / "mtp-micro").resolve())
    assert (facts.hidden_size, facts.num_experts, facts.head_dim) == (16, 4, 8)


def test_mtp_comes_from_the_weights_not_the_config(tmp_path):
    # A config that promises an MTP layer over weights without one (transformers drops MTP weights on save).
    shutil.copy(MODELS / "nomtp-micro" / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((MODELS / "nomtp-micro" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    lp = load_profile_text(f'[model]\npath = "{tmp_path}"\n', "p.toml")
    assert model_facts(lp, "cuda").mtp_layers == 0


def test_model_path_is_relative_to_the_file_that_wrote_it(tmp_path):
    base_dir = tmp_path / "bases"
    base_dir.mkdir()
    shutil.copytree(MODELS / "mtp-micro", base_dir / "weights")
    (base_dir / "model.toml").write_text('[model]\npath = "weights"\n')
    child = tmp_path / "box.toml"
    child.write_text('extends = "bases/model.toml"\n')
    facts = model_facts(load_profile(child), "cuda")
    assert facts.source == str((base_dir / "weights").resolve())


def test_corrupt_header_is_a_profile_error(tmp_path):
    shutil.copy(MODELS / "mtp-micro" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    profile = tmp_path / "p.toml"
    profile.write_text(f'[model]\npath = "{tmp_path}"\n')
    with pytest.raises(ProfileError) as err:
        model_facts(load_profile(profile), "cuda")
    (p,) = err.value.problems
    assert p.key == "model.path" and p.line == line_of(profile, "path") and "safetensors headers" in p.message


def test_machine_and_model_problems_are_reported_together():
    lp = load_profile_text('[model]\npath = "/no/such/model/dir"\n', "p.toml")
    with pytest.raises(ProfileError) as err:
        gather_facts(lp)
    assert sorted(p.key for p in err.value.problems) == ["machine", "model.path"]


# ---- a config.json or header that is not what it should be: a named error, never a traceback ------------


def _model_dir(tmp_path, config_text: str):
    """A model directory with mtp-micro's weights and ``config_text`` as its config.json; its profile."""
    shutil.copy(MODELS / "mtp-micro" / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config_text)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[model]\npath = "{tmp_path}"\n')
    return profile


def _config_problems(tmp_path, config_text: str) -> list[str]:
    profile = _model_dir(tmp_path, config_text)
    with pytest.raises(ProfileError) as err:
        model_facts(load_profile(profile), "cuda")
    assert all(p.key == "model.path" and p.line == line_of(profile, "path") for p in err.value.problems)
    return [p.message for p in err.value.problems]


def _micro_config() -> dict:
    return json.loads((MODELS / "mtp-micro" / "config.json").read_text())


def test_config_json_that_is_a_list_is_refused(tmp_path):
    (message,) = _config_problems(tmp_path, json.dumps([_micro_config()]))
    assert "is not a JSON object (it holds a list)" in message


def test_config_json_nested_100k_deep_is_refused(tmp_path):
    (message,) = _config_problems(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in message


def test_zero_attention_heads_without_head_dim_is_a_named_error(tmp_path):
    config = {k: v for k, v in _micro_config().items() if k != "head_dim"}
    (message,) = _config_problems(tmp_path, json.dumps({**config, "num_attention_heads": 0}))
    assert "num_attention_heads: expected greater than or equal to 1 (got 0)" in message


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("hidden_size", "64", 'hidden_size: expected a valid integer (got "64")'),
        ("hidden_size", 1 << 30, "hidden_size: expected less than or equal to 65536"),
        ("vocab_size", 10**12, "vocab_size: expected less than or equal to 4194304"),
        ("num_hidden_layers", True, "num_hidden_layers: expected a valid integer (got true)"),
        ("num_experts_per_tok", 9, "num_experts_per_tok 9 is more than the 4 experts"),
        ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 2"),
    ],
)
def test_config_json_fields_are_strictly_typed_and_bounded(tmp_path, key, value, expected):
    messages = _config_problems(tmp_path, json.dumps({**_micro_config(), key: value}))
    assert any(expected in m for m in messages), messages


def test_a_missing_config_field_is_named(tmp_path):
    config = {k: v for k, v in _micro_config().items() if k != "vocab_size"}
    (message,) = _config_problems(tmp_path, json.dumps(config))
    assert "vocab_size: required" in message


def test_safetensors_header_nested_100k_deep_is_refused_by_name(tmp_path):
    shutil.copy(MODELS / "mtp-micro" / "config.json", tmp_path / "config.json")
    text = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[model]\npath = "{tmp_path}"\n')
    with pytest.raises(ProfileError) as err:
        model_facts(load_profile(profile), "cuda")
    (p,) = err.value.problems
    assert p.key == "model.path" and "nested too deeply" in p.message
