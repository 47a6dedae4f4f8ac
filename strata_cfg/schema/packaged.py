"""Models that ship inside strata_cfg, by the name a profile gives them (``[model] packaged = "austen"``).

Each is a Hugging Face style model directory (``config.json``, ``model.safetensors``, a README saying what
it is and how it was made) under ``strata_cfg/data/models/<name>``. The resolver turns the name into that
absolute directory, so the launch plan and the runtime see an ordinary ``model.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

PackagedName = Literal["austen"]
"""Names of the packaged models. ``austen``: the demo's 5.6 MB byte-level Qwen3-MoE with an MTP head,
trained on Jane Austen's novels (``strata_cfg/data/models/austen/README.md``)."""

_ROOT = Path(__file__).resolve().parent.parent / "data" / "models"


def packaged_dir(name: str) -> Path:
    """The absolute directory of packaged model ``name``."""
    return _ROOT / name
