"""Model facts: a synthetic preset's config, or a model directory's ``config.json`` plus what its
safetensors headers say (the MTP layers and the checkpoint's dtype), in the dtype the model will run in."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..profile.load import LoadedProfile
from ..profile.overrides import SET_ORIGIN
from ..schema.bounded_read import read_bounded
from ..schema.errors import ProfileError
from ..schema.facts import ConfigError, ModelFacts, run_dtype
from ..schema.packaged import packaged_dir
from ..schema.presets import preset_config
from .checkpoint import read_checkpoint

MAX_CONFIG_BYTES = 4 << 20
"""A model's config.json is a few KiB; a larger one is refused before it is parsed."""


def model_dir(loaded: LoadedProfile) -> Path:
    """``model.path`` as a directory, relative to the profile file that wrote it; or a packaged model's."""
    m = loaded.profile.model
    assert m is not None
    if m.packaged is not None:
        return packaged_dir(m.packaged)
    assert m.path is not None
    origin = loaded.origin("model.path")
    base = Path(origin.file).parent if origin and origin.file != SET_ORIGIN else Path.cwd()
    return (base / os.path.expanduser(m.path)).resolve()


def model_facts(loaded: LoadedProfile, backend: str) -> ModelFacts:
    """The model's shapes: from a synthetic preset, or from a model directory's config and headers."""
    m = loaded.profile.model
    if m is None or (m.path is None and m.synthetic is None and m.packaged is None):
        raise loaded.problem("model", 'no model given: write [model] synthetic = "tiny" or path = "..."')
    if m.synthetic is not None:
        dtype = run_dtype(backend, m.dtype)
        return ModelFacts.from_config(
            preset_config(m.synthetic), source=f"synthetic:{m.synthetic}", dtype=dtype
        )
    directory = model_dir(loaded)
    if m.packaged is not None and not directory.is_dir():
        raise loaded.problem("model.packaged", f"packaged model {m.packaged!r} is missing: {directory}")
    if not directory.is_dir():
        raise loaded.problem("model.path", f"no model directory at {directory}")
    config_path = directory / "config.json"
    config = _read_config(loaded, directory, config_path)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise loaded.problem("model.path", f"{directory} has no *.safetensors weights")
    try:
        header = read_checkpoint(shards)
    except (OSError, ValueError) as exc:
        raise loaded.problem(
            "model.path", f"cannot read the safetensors headers in {directory}: {exc}"
        ) from None
    ckpt_dtype = header.dtype
    if ckpt_dtype is None:
        kinds = ", ".join(sorted(header.dtype_bytes)) or "none"
        raise loaded.problem(
            "model.path", f"weights in {directory} are not float32/float16/bfloat16 ({kinds})"
        )
    if config.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise loaded.problem(
            "model.path", f"model_type {config.get('model_type')!r} is not supported (qwen3_moe)"
        )
    # The runtime computes in float16 on GPUs; bfloat16 and float32 checkpoints are converted on load.
    dtype = run_dtype(backend, m.dtype)
    try:
        return ModelFacts.from_config(
            config, source=str(directory), dtype=dtype, mtp_layers=header.mtp_layers
        )
    except ConfigError as exc:
        raise ProfileError(
            [loaded.problem("model.path", f"{config_path}: {m}").problems[0] for m in exc.messages]
        ) from None


def _read_config(loaded: LoadedProfile, directory: Path, config_path: Path) -> dict[str, Any]:
    """The model directory's config.json as a JSON object, read within `MAX_CONFIG_BYTES`."""
    try:
        config = json.loads(read_bounded(config_path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise loaded.problem("model.path", f"{directory} has no config.json") from None
    except RecursionError:
        raise loaded.problem("model.path", f"cannot read {config_path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise loaded.problem("model.path", f"cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise loaded.problem(
            "model.path", f"{config_path} is not a JSON object (it holds a {type(config).__name__})"
        )
    return config
