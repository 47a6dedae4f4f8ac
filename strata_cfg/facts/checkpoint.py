"""What a checkpoint's safetensors headers say about it, without reading any tensor: its names (and so
its MTP layers) and the bytes held in each dtype."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..schema.safetensors_header import METADATA, read_header

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


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


def read_checkpoint(files: Iterable[Path]) -> CheckpointHeader:
    """The headers of every shard, summed; raises OSError or ValueError for a file that is not safetensors."""
    names: list[str] = []
    dtype_bytes: Counter[str] = Counter()
    for path in files:
        for name, info in read_header(path).items():
            if name == METADATA:
                continue
            names.append(name)
            start, end = info["data_offsets"]
            dtype_bytes[info["dtype"]] += end - start
    return CheckpointHeader(tuple(names), dict(dtype_bytes))
