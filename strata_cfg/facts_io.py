"""The facts step: everything the resolver takes as given, gathered (with I/O) before it runs.

* `machine_facts`: the GPUs from the profile's ``[machine]`` table, or probed with ``nvidia-smi`` (never
  through CuPy, so that `strata plan` stays light). A probed card's bandwidth comes from a table of known
  cards; an unknown card gets an estimate, flagged as such.
* `model_facts`: a synthetic preset's config, or a model directory's ``config.json`` plus its safetensors
  *headers* (read in pure Python: an 8-byte length and a JSON table), from which the MTP layers and the
  checkpoint's dtype are taken.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .load import LoadedProfile
from .resolve.gates import run_dtype
from .schema.errors import Problem, ProfileError
from .schema.facts import GpuFacts, MachineFacts, ModelFacts
from .schema.packaged import packaged_dir
from .schema.presets import preset_config

# Memory bandwidth of cards users run, in GB/s (vendor specifications). Longest matching name wins.
KNOWN_BANDWIDTH_GBS: dict[str, float] = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 80GB HBM3": 3350,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 2000,
    "GH200": 4000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100-SXM4-40GB": 1555,
    "A100-PCIE-40GB": 1555,
    "A100": 1555,
    "L40S": 864,
    "L40": 864,
    "L4": 300,
    "A40": 696,
    "A10G": 600,
    "A10": 600,
    "T4": 320,
    "V100": 900,
    "RTX PRO 6000": 1792,
    "RTX 6000 Ada": 960,
    "RTX A6000": 768,
    "RTX A5000": 768,
    "RTX A4000": 448,
    "RTX 5090": 1792,
    "RTX 5080": 960,
    "RTX 5070 Ti": 896,
    "RTX 5060 Ti": 448,
    "RTX 4090": 1008,
    "RTX 4080 SUPER": 736,
    "RTX 4080": 717,
    "RTX 4070 Ti SUPER": 672,
    "RTX 4060 Ti": 288,
    "RTX 3090 Ti": 1008,
    "RTX 3090": 936,
    "RTX 3080 Ti": 912,
    "RTX 3080": 760,
    "RTX 3060": 360,
    "R9700": 640,
}
ESTIMATED_BANDWIDTH_GBS = 500.0
"""Bandwidth assumed for a card the table does not know (flagged as an estimate in the plan)."""

_SMI_QUERY = ("--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MAX_HEADER = 100 << 20


def _problem(loaded: LoadedProfile, key: str, message: str) -> ProfileError:
    origin = loaded.origin(key)
    file = origin.file if origin else loaded.path
    return ProfileError(Problem(file, origin.line if origin else None, key, message))


# ---- machine -------------------------------------------------------------------------------------


def known_bandwidth(name: str) -> float | None:
    """The bandwidth of a card by (a part of) its name, or None for a card the table does not know."""
    matches = [k for k in KNOWN_BANDWIDTH_GBS if k.lower() in name.lower()]
    return KNOWN_BANDWIDTH_GBS[max(matches, key=len)] if matches else None


def parse_nvidia_smi(text: str) -> list[GpuFacts]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` output."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, rest = line.split(",", 1)
        name, mem = (part.strip() for part in rest.rsplit(",", 1))
        bandwidth = known_bandwidth(name)
        gpus.append(
            GpuFacts(
                index=int(index.strip()),
                name=name,
                vram_mib=int(float(mem)),
                bandwidth_gbs=bandwidth or ESTIMATED_BANDWIDTH_GBS,
                bandwidth_estimated=bandwidth is None,
            )
        )
    return gpus


def probe_nvidia_smi() -> str:
    """Run nvidia-smi and return its CSV; raises OSError when there is no usable nvidia-smi."""
    import shutil  # only when probing: keeps `strata plan` on a written [machine] from paying for it
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise OSError("nvidia-smi was not found on PATH")
    try:
        done = subprocess.run([exe, *_SMI_QUERY], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi did not answer within 20 s") from None
    if done.returncode != 0:
        raise OSError(f"nvidia-smi failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def machine_facts(loaded: LoadedProfile, *, probe: Callable[[], str] = probe_nvidia_smi) -> MachineFacts:
    """The machine's GPUs from ``[machine]``, or from ``probe`` when it says ``probe = true``."""
    m = loaded.profile.machine
    if m is None or (m.gpus is None and not m.probe):
        raise _problem(
            loaded,
            "machine",
            "no GPUs given: write [machine] gpus = [{ name, vram_mib, bandwidth_gbs }, ...] or probe = true",
        )
    backend = m.backend or "cuda"
    if m.gpus is not None:
        gpus = tuple(
            GpuFacts(index=i, name=g.name, vram_mib=g.vram_mib, bandwidth_gbs=g.bandwidth_gbs)
            for i, g in enumerate(m.gpus)
        )
        return MachineFacts(backend=backend, gpus=gpus, source="profile")
    if backend == "cpu":
        raise _problem(loaded, "machine.probe", "virtual CPU devices cannot be probed: write [machine] gpus")
    try:
        found = parse_nvidia_smi(probe())
    except (OSError, ValueError, IndexError) as exc:
        raise _problem(
            loaded, "machine.probe", f"cannot probe the GPUs ({exc}); write [machine] gpus instead"
        ) from None
    if not found:
        raise _problem(loaded, "machine.probe", "the probe found no GPUs; write [machine] gpus instead")
    return MachineFacts(backend="cuda", gpus=tuple(found), source="probe")


# ---- model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointHeader:
    """What the safetensors headers of a model directory say, without reading any tensor."""

    names: tuple[str, ...]
    dtype_bytes: dict[str, int]
    """Bytes of tensors by safetensors dtype name (``BF16``: 123)."""

    @property
    def mtp_layers(self) -> int:
        """MTP decoder layers present (``mtp.layers.N.*``); 1 for MTP weights without numbered layers."""
        layers = {int(m.group(1)) for n in self.names if (m := _MTP_LAYER.match(n))}
        if layers:
            return max(layers) + 1
        return 1 if any(n.startswith("mtp.") for n in self.names) else 0

    @property
    def dtype(self) -> str | None:
        """The floating dtype that holds most of the bytes, in profile spelling."""
        if not self.dtype_bytes:
            return None
        name = max(self.dtype_bytes, key=lambda k: self.dtype_bytes[k])
        return _ST_DTYPES.get(name)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file: 8 bytes of little-endian length, then that much JSON."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"header of {n} bytes is not plausible")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def read_checkpoint(files: Iterable[Path]) -> CheckpointHeader:
    names: list[str] = []
    dtype_bytes: Counter[str] = Counter()
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            names.append(name)
            start, end = info["data_offsets"]
            dtype_bytes[info["dtype"]] += end - start
    return CheckpointHeader(tuple(names), dict(dtype_bytes))


def model_dir(loaded: LoadedProfile) -> Path:
    """``model.path`` as a directory, relative to the profile file that wrote it; or a packaged model's."""
    m = loaded.profile.model
    assert m is not None
    if m.packaged is not None:
        return packaged_dir(m.packaged)
    assert m.path is not None
    origin = loaded.origin("model.path")
    base = Path(origin.file).parent if origin and origin.file != "--set" else Path.cwd()
    return (base / os.path.expanduser(m.path)).resolve()


def model_facts(loaded: LoadedProfile, backend: str) -> ModelFacts:
    """The model's shapes: from a synthetic preset, or from a model directory's config and headers."""
    m = loaded.profile.model
    if m is None or (m.path is None and m.synthetic is None and m.packaged is None):
        raise _problem(loaded, "model", 'no model given: write [model] synthetic = "tiny" or path = "..."')
    if m.synthetic is not None:
        dtype = run_dtype(backend, m.dtype)
        return ModelFacts.from_config(
            preset_config(m.synthetic), source=f"synthetic:{m.synthetic}", dtype=dtype
        )
    directory = model_dir(loaded)
    if m.packaged is not None and not directory.is_dir():
        raise _problem(loaded, "model.packaged", f"packaged model {m.packaged!r} is missing: {directory}")
    if not directory.is_dir():
        raise _problem(loaded, "model.path", f"no model directory at {directory}")
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _problem(loaded, "model.path", f"{directory} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise _problem(loaded, "model.path", f"cannot read {config_path}: {exc}") from None
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise _problem(loaded, "model.path", f"{directory} has no *.safetensors weights")
    try:
        header = read_checkpoint(shards)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _problem(
            loaded, "model.path", f"cannot read the safetensors headers in {directory}: {exc}"
        ) from None
    ckpt_dtype = header.dtype
    if ckpt_dtype is None:
        kinds = ", ".join(sorted(header.dtype_bytes)) or "none"
        raise _problem(
            loaded, "model.path", f"weights in {directory} are not float32/float16/bfloat16 ({kinds})"
        )
    if config.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise _problem(
            loaded, "model.path", f"model_type {config.get('model_type')!r} is not supported (qwen3_moe)"
        )
    # The runtime computes in float16 on GPUs; bfloat16 and float32 checkpoints are converted on load.
    dtype = run_dtype(backend, m.dtype)
    try:
        return ModelFacts.from_config(
            config, source=str(directory), dtype=dtype, mtp_layers=header.mtp_layers
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _problem(
            loaded, "model.path", f"{config_path} lacks what a qwen3_moe config needs: {exc}"
        ) from None


def gather_facts(
    loaded: LoadedProfile, *, probe: Callable[[], str] = probe_nvidia_smi
) -> tuple[MachineFacts, ModelFacts]:
    """Machine and model facts for a loaded profile, reporting problems of both together."""
    problems: list[Problem] = []
    machine: MachineFacts | None = None
    model: ModelFacts | None = None
    try:
        machine = machine_facts(loaded, probe=probe)
    except ProfileError as exc:
        problems += exc.problems
    m = loaded.profile.machine
    backend = machine.backend if machine else (m.backend if m and m.backend else "cuda")
    try:
        model = model_facts(loaded, backend)
    except ProfileError as exc:
        problems += exc.problems
    if problems or machine is None or model is None:
        raise ProfileError(problems)
    return machine, model
