"""The demo model's corpus: Jane Austen's six novels, read from Debian's ``r-cran-janeaustenr`` package.

The novels (1811-1818) are in the public domain; the R package that ships them (Julia Silge's janeaustenr) is
MIT-licensed. Get it with one command (no R needed; any directory will do)::

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*_all.deb /tmp/austen

and pass ``/tmp/austen`` (or any folder above ``janeaustenr/data/Rdata.rdb``) as ``--corpus``.

The package keeps each novel as an R character vector (one element per printed line) in R's lazy-load
database: ``Rdata.rdx`` is a gzip-compressed serialized index of (offset, length) per object, and each object
in ``Rdata.rdb`` is a 4-byte length followed by a zlib stream of R's XDR serialization. `read_novels` parses
just the parts of that format these two files use. `clean` joins the wrapped lines into one line per
paragraph, drops the ``_italic_`` underscores and double spaces, so the model writes running prose.
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from pathlib import Path
from typing import Any

HELD_OUT = "persuasion"
"""The novel kept out of training, for the held-out loss and the drafter's acceptance."""

EOS = "<|endoftext|>"
"""Written after each novel; the runtime's byte tokenizer reads it as one special token."""


class _RReader:
    """R's XDR serialization (``serialize(..., xdr = TRUE)``), for the types a data package's index and
    character vectors use: NULL, symbols, pairlists (attributes), strings, logical/int/double and lists."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.data, self.at, self.refs = data, 2, []  # refs: symbols, in the order they were first seen
        version = self._int()
        self.at += 8  # the writer's and the minimum reader's R versions
        if version == 3:
            self.at += 4 + self._int()  # the native encoding's name

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.at)
        self.at += 4
        return int(v)

    def item(self) -> Any:
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 253, 241):  # NULL and the empty, global and base environments
            return None
        if kind == 255:  # a reference to an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # a symbol: its name follows as a CHARSXP
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP: a length (-1 for NA) and bytes
            n = self._int()
            text = None if n < 0 else self.data[self.at : self.at + n].decode("utf-8")
            self.at += max(n, 0)
            return text
        if kind == 2:  # a pairlist node: [attributes] [tag] value, then the rest of the list
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            node = {tag: self.item()}
            rest = self.item()
            return node | (rest if isinstance(rest, dict) else {})
        n = self._int()
        if kind in (10, 13):  # logical, integer
            value: list[Any] = list(struct.unpack_from(f">{n}i", self.data, self.at))
            self.at += 4 * n
        elif kind == 14:  # double
            value = list(struct.unpack_from(f">{n}d", self.data, self.at))
            self.at += 8 * n
        elif kind in (16, 19):  # character vector, list
            value = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"R type {kind} is not read here")
        attrs = self.item() if has_attr else None
        if isinstance(attrs, dict) and "names" in attrs:
            return dict(zip(attrs["names"], value, strict=True))
        return value


def _unserialize(data: bytes) -> Any:
    return _RReader(data).item()


def find_data(root: Path) -> Path:
    """The ``janeaustenr/data`` folder at or below ``root``."""
    hits = sorted(root.rglob("janeaustenr/data/Rdata.rdb")) or sorted(root.rglob("data/Rdata.rdb"))
    if not hits:
        raise FileNotFoundError(f"no janeaustenr/data/Rdata.rdb under {root} (see scripts/demo_corpus.py)")
    return hits[0].parent


def read_novels(root: Path) -> dict[str, list[str]]:
    """Each novel's printed lines, by the package's object name (``emma``, ``persuasion``, ...)."""
    data = find_data(root)
    index = _unserialize(gzip.decompress((data / "Rdata.rdx").read_bytes()))
    blob = (data / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index["variables"].items():
        start = int(offset) + 4  # the uncompressed length, which zlib does not need
        lines = _unserialize(zlib.decompress(blob[start : int(offset) + int(length)]))
        novels[name] = [line or "" for line in lines]
    return novels


def clean(lines: list[str]) -> str:
    """One line per paragraph, single spaces, no italic underscores."""
    paragraphs, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(re.sub(r"\s+", " ", " ".join(current).replace("_", "")))
            current = []
    return "\n".join(paragraphs) + "\n"


def split(root: Path) -> tuple[str, str]:
    """(training text, held-out text): every novel but `HELD_OUT`, each ended by `EOS`; and `HELD_OUT`."""
    novels = {name: clean(lines) for name, lines in sorted(read_novels(root).items())}
    held = novels.pop(HELD_OUT)
    return "".join(text + EOS for text in novels.values()), held
