"""The one safetensors header reader: what a real checkpoint's header says, and plain refusals of files
whose header could not describe them."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from cfg_fixtures import FIXTURES, raised_within
from safetensors.numpy import save_file

from strata_cfg.schema.safetensors_header import (
    LENGTH_BYTES,
    METADATA,
    read_header,
    read_header_and_data_start,
)

MTP_MICRO = FIXTURES / "models" / "mtp-micro" / "model.safetensors"


def write_raw(path, header: object, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_reference_writer_headers_read_back_with_the_data_start(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.integers(1, 9, 4).astype(np.int64),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    header, start = read_header_and_data_start(path)
    assert header[METADATA] == {"format": "np"}
    assert header["a"]["shape"] == [3, 5] and header["b"]["dtype"] == "I64"
    raw = path.read_bytes()
    assert start == LENGTH_BYTES + struct.unpack("<Q", raw[:8])[0]
    a0, a1 = header["a"]["data_offsets"]
    assert np.array_equal(np.frombuffer(raw[start + a0 : start + a1], np.float32).reshape(3, 5), tensors["a"])
    assert read_header(path) == header


def test_the_fixture_checkpoint_header():
    header = read_header(MTP_MICRO)
    assert header["model.embed_tokens.weight"]["shape"] == [48, 16]
    assert header["mtp.fc.weight"]["dtype"] == "BF16"


GOOD = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize(
    ("header", "data", "reason"),
    [
        ([1, 2], b"", "header is not a JSON object"),
        ({"t": [1]}, b"", "tensor 't': entry is not a JSON object"),
        ({"t": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4), "tensor 't': no dtype"),
        (
            {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
            bytes(4),
            "shape [-1] is not a list",
        ),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4), "data_offsets [0] is not"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), "do not fit the 4 bytes"),
        (GOOD, bytes(12), "data_offsets [0, 16] do not fit the 12 bytes of data"),
        (
            {"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}},
            bytes(16),
            "16 bytes do not hold",
        ),
    ],
)
def test_a_header_that_cannot_describe_its_file_is_refused(tmp_path, header, data, reason):
    path = tmp_path / "m.safetensors"
    write_raw(path, header, data)
    with pytest.raises(ValueError) as err:
        read_header(path)
    assert reason in str(err.value)


def test_a_good_raw_header_passes(tmp_path):
    path = tmp_path / "m.safetensors"
    write_raw(path, {**GOOD, "u": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [16, 16]}}, bytes(16))
    assert read_header(path)["t"]["shape"] == [2, 2]  # an unknown dtype is not size-checked


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x01\x02", "file shorter than a safetensors header"),
        (struct.pack("<Q", 1 << 40), "header of 1099511627776 bytes is not plausible"),
        (struct.pack("<Q", 50) + b"{}", "header of 50 bytes is longer than the file (10 bytes)"),
        (struct.pack("<Q", 10) + b"not json!!", "header is not JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "header is not JSON"),
    ],
)
def test_a_file_that_is_not_safetensors_is_refused_with_a_plain_reason(tmp_path, raw, reason):
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ValueError) as err:
        read_header(path)
    assert reason in str(err.value)


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    path = tmp_path / "m.safetensors"
    os.mkfifo(path)
    err = raised_within(20, lambda: read_header(path))  # opening a FIFO to read waits for a writer
    assert isinstance(err, ValueError) and "not a regular file (a FIFO)" in str(err)
