"""The safetensors header: the one reader of a checkpoint file's table of tensors.

A ``.safetensors`` file starts with 8 bytes holding a little-endian length N, then N bytes of JSON: an
object mapping each tensor name to ``{"dtype", "shape", "data_offsets": [start, end]}`` (offsets counted
from the end of the header), plus an optional ``"__metadata__"`` entry. The tensor bytes follow.

The facts step reads headers to learn a checkpoint's dtype and MTP layers without reading any tensor; the
runtime's loader reads them to find each tensor's bytes. Both go through `read_header`, which refuses a
header that could not describe the file it sits in (standard library only, so the runtime may import it).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from .bounded_read import require_regular_file

LENGTH_BYTES = 8
"""The header length field: an unsigned 64-bit little-endian integer at the start of the file."""

MAX_HEADER_BYTES = 100 << 20
"""A header longer than this is not a real checkpoint's (the reference reader refuses the same size)."""

METADATA = "__metadata__"
"""The header entry that holds free-form string metadata instead of a tensor."""

ITEM_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of the safetensors dtypes whose size is known; others are not size-checked."""


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of one safetensors file, ``__metadata__`` included.

    Raises ValueError with a plain reason when the file cannot hold a safetensors header, and OSError when
    it cannot be read.
    """
    return read_header_and_data_start(path)[0]


def read_header_and_data_start(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The header, and the byte offset in the file where tensor data starts (offsets count from there)."""
    where = Path(path)
    require_regular_file(where)  # a FIFO named *.safetensors would block the open below
    with where.open("rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        raw = f.read(LENGTH_BYTES)
        if len(raw) != LENGTH_BYTES:
            raise ValueError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"header of {n} bytes is not plausible")
        if n > file_size - LENGTH_BYTES:
            raise ValueError(f"header of {n} bytes is longer than the file ({file_size} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise ValueError(f"header is not JSON ({exc})") from None
    except RecursionError:  # a real header nests three levels; json recurses once per level
        raise ValueError("header is JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_start = LENGTH_BYTES + n
    data_bytes = file_size - data_start
    for name, info in header.items():
        if name != METADATA:
            _check_entry(name, info, data_bytes)
    return header, data_start


def _check_entry(name: str, info: object, data_bytes: int) -> None:
    """Refuse a tensor entry whose fields are missing or whose bytes do not fit its shape or the file."""
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name!r}: entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"tensor {name!r}: no dtype")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [start, end]")
    start, end = offsets
    if start > end or end > data_bytes:
        raise ValueError(
            f"tensor {name!r}: data_offsets [{start}, {end}] do not fit the {data_bytes} bytes of data"
        )
    item = ITEM_BYTES.get(dtype)
    if item is not None and end - start != item * math.prod(shape):
        raise ValueError(
            f"tensor {name!r}: {end - start} bytes do not hold a {dtype} tensor of shape {shape}"
        )


def _count(value: object) -> bool:
    """A JSON integer that is zero or more (JSON booleans are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
