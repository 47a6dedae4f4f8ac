"""Loading a Hugging Face style checkpoint stage by stage, straight onto each stage's device.

A model directory holds ``config.json`` and safetensors: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. Files are memory-mapped and their headers read by the one safetensors
header reader (`strata_cfg.schema.safetensors_header`, which the facts step uses too), so a stage reads only
the bytes of its own tensors, and bfloat16 tensors load without torch (their bits are widened to
float32 on the host, then cast to the device dtype).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from strata_cfg.schema.safetensors_header import METADATA, read_header_and_data_start

from ..backend import Device
from ..experts.host import host_empty
from ..models.qwen3_moe import Shapes, sanitize
from .progress import Progress


class CheckpointError(RuntimeError):
    """A model directory that does not hold what the model needs."""


_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 by `_widen`
    "I64": np.int64,
    "I32": np.int32,
}


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            header, self._base = read_header_and_data_start(path)
        except ValueError as exc:
            raise CheckpointError(f"{path}: not a safetensors file: {exc}") from None
        header.pop(METADATA, None)
        self._header: dict[str, Any] = header
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as a host array (float32 for bfloat16 tensors)."""
        info = self._header[name]
        dtype = info["dtype"]
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {dtype}, which is not supported")
        start, end = info["data_offsets"]
        raw = self._mmap[self._base + start : self._base + end]
        arr = raw.view(_ST_DTYPES[dtype]).reshape(info["shape"])
        return _widen(arr) if dtype == "BF16" else arr


def _widen(bf16_bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> float32: a bfloat16 is the top half of a float32."""
    return (bf16_bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """A model directory: its config and where each tensor lives."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        config = self.directory / "config.json"
        if not config.is_file():
            raise CheckpointError(f"{self.directory}: no config.json (is this a model directory?)")
        self.config: dict[str, Any] = json.loads(config.read_text())
        self._where = self._index()

    def _index(self) -> dict[str, SafetensorsFile]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = {f: SafetensorsFile(self.directory / f) for f in sorted(set(weight_map.values()))}
            return {name: files[f] for name, f in weight_map.items()}
        paths = sorted(self.directory.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(
                f"{self.directory}: no *.safetensors files and no model.safetensors.index.json"
            )
        where: dict[str, SafetensorsFile] = {}
        for p in paths:
            st = SafetensorsFile(p)
            where.update({n: st for n in st.names()})
        return where

    def names(self) -> set[str]:
        return set(self._where)

    def read(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as a host array, refusing it when missing or of the wrong shape."""
        st = self._where.get(name)
        if st is None:
            raise CheckpointError(
                f"{self.directory}: tensor {name!r} is missing (expected shape {list(expected)})"
            )
        actual = st.shape(name)
        if actual != expected:
            raise CheckpointError(
                f"{st.path}: tensor {name!r} has shape {list(actual)}, expected {list(expected)}"
            )
        return st.read(name)


def load_tensors(
    checkpoint: Checkpoint,
    shapes: Shapes,
    device: Device,
    dtype: Any,
    progress: Progress | None = None,
    label: str = "",
    host: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Read every tensor in ``shapes`` onto ``device`` in ``dtype``, checking names and shapes first; those
    named in ``host`` (a stage's routed experts behind an expert cache) into host memory instead, pinned
    on a GPU machine."""
    available = checkpoint.names()
    tie = bool(checkpoint.config.get("tie_word_embeddings", False))
    sources = {name: sanitize(name, shape, available, tie) for name, shape in shapes.items()}
    for name, src in sources.items():  # fail before any device memory is spent
        for part in src.parts:
            for piece in part:
                if piece not in available:
                    raise CheckpointError(
                        f"{checkpoint.directory}: tensor {piece!r} is missing "
                        f"(needed for {name}, expected shape {list(_piece_shape(shapes[name], src, part))})"
                    )
    total = sum(int(np.prod(s)) * np.dtype(dtype).itemsize for s in shapes.values())
    bar = progress(label or f"loading {device}", total) if progress else None
    out: dict[str, Any] = {}
    with device.use():
        for name, shape in shapes.items():
            src = sources[name]
            on_host = name in host
            if not src.stacked:
                whole = checkpoint.read(src.parts[0][0], shape)
                if on_host:
                    out[name] = host_empty(shape, dtype, pinned=device.is_cuda, near=device.index)
                    out[name][...] = whole
                else:
                    out[name] = device.asarray(whole, dtype)
            else:
                arr = (
                    host_empty(shape, dtype, pinned=device.is_cuda, near=device.index)
                    if on_host
                    else device.empty(shape, dtype)
                )
                for e, part in enumerate(src.parts):
                    piece_shape = _piece_shape(shape, src, part)
                    item = np.concatenate([checkpoint.read(p, piece_shape) for p in part], axis=0)
                    arr[e] = item if on_host else device.asarray(item, dtype)
                out[name] = arr
            if bar:
                bar.advance(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    if bar:
        bar.close()
    return out


def _piece_shape(shape: tuple[int, ...], src: Any, part: tuple[str, ...]) -> tuple[int, ...]:
    if not src.stacked:
        return shape
    return (shape[1] // len(part), *shape[2:])
