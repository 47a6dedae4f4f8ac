"""A new profile from a probe of this machine: its GPUs as ``[machine]``, everything else a starting point.

The text is built here (pure); the probe itself is `facts.machine.probe_nvidia_smi`, the same one
`machine.probe = true` uses, and its parsing is `facts.machine.parse_nvidia_smi`. When the probe fails
(no nvidia-smi, no GPU), the profile uses one virtual CPU device instead, so it still resolves, and says so
at the top.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..facts.machine import parse_nvidia_smi
from ..schema.facts import GpuFacts


@dataclass(frozen=True)
class ProbeResult:
    gpus: tuple[GpuFacts, ...]
    error: str | None = None
    """Why the probe found nothing, in one sentence."""


def run_probe(probe: Callable[[], str]) -> ProbeResult:
    """Run ``probe`` (nvidia-smi's CSV) and parse it; failures become the result's ``error``."""
    try:
        gpus = tuple(parse_nvidia_smi(probe()))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return ProbeResult((), str(exc) or type(exc).__name__)
    if not gpus:
        return ProbeResult((), "the probe found no GPUs")
    return ProbeResult(gpus)


def _describe(gpus: Sequence[GpuFacts]) -> str:
    counts = Counter(g.name for g in gpus)
    return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())


def _gpu_line(g: GpuFacts) -> str:
    line = (
        f"  {{ name = {json.dumps(g.name)}, vram_mib = {g.vram_mib}, bandwidth_gbs = {g.bandwidth_gbs:g} }},"
    )
    if g.bandwidth_estimated:
        line += "  # bandwidth is a guess: this card is not in the known-cards table"
    return line


def probe_profile_text(name: str, result: ProbeResult, schema: str | None = None) -> str:
    """The TOML of a new profile named ``name`` for the probed machine (``schema``: the JSON Schema's
    path relative to the profile, for editors that read a ``#:schema`` line)."""
    lines = [f"#:schema {schema}"] if schema else []
    if result.gpus:
        lines += [
            f"# Made from a probe of this machine (nvidia-smi): {_describe(result.gpus)}.",
            "# The model is a small synthetic one, so that the plan resolves: set [model] path to yours.",
            f"name = {json.dumps(name)}",
            f"description = {json.dumps(_describe(result.gpus))}",
            "",
            "[machine]",
            "gpus = [",
            *(_gpu_line(g) for g in result.gpus),
            "]",
        ]
    else:
        lines += [
            f"# The machine probe found no GPU ({result.error}), so this profile runs on one virtual CPU",
            "# device. Replace [machine] with your GPUs: gpus = [{ name, vram_mib, bandwidth_gbs }, ...].",
            f"name = {json.dumps(name)}",
            'description = "one virtual CPU device"',
            "",
            "[machine]",
            'backend = "cpu"',
            'gpus = [{ name = "virtual CPU device", vram_mib = 1024, bandwidth_gbs = 20 }]',
        ]
    lines += ["", "[model]", 'synthetic = "tiny"']
    if len(result.gpus) > 1:
        lines += ["", "[split]", 'layers = "auto"']
    lines += [
        "",
        "[batch]",
        "slots = 2",
        "",
        "[serve]",
        'host = "127.0.0.1"',
        "port = 8000",
        "",
    ]
    return "\n".join(lines)
