"""Reading a file a user named: only a regular file, and never more than a limit.

A profile's ``extends``, a model directory's ``config.json`` and a safetensors header are all named by the
user. Opening ``/dev/zero`` would read without end, and opening a FIFO would wait for a writer that never
comes, so a path must name a regular file before it is opened, and no read takes more than its limit.
Errors are OSError (the file cannot be read) or ValueError (it is not what it should be), each with a plain
reason that does not repeat the path, for the caller to put beside the key and the path it names.
"""

from __future__ import annotations

import os
import stat


def require_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """The file's status; ValueError when ``path`` is a device, a FIFO, a socket or a directory."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"not a regular file ({_kind(st.st_mode)})")
    return st


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path``; ValueError when it holds more than ``limit`` bytes."""
    require_regular_file(path)
    # O_NONBLOCK: should the path be swapped for a FIFO after the check, opening it still cannot hang.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {_size(limit)}")
    return data


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"
