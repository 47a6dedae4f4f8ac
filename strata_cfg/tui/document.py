"""A profile file open in the editor: what was on disk when it was opened, and saving it safely.

Saving is atomic: the new text goes to a temporary file in the same directory, is flushed to disk, and is
then renamed over the original, so a crash at any point leaves either the old file or the new one, never a
half-written one. The version being replaced is kept as ``<file>.bak``. Both keep the original file's
permissions (a new profile gets what the umask allows, as any editor's new file does). A save is refused
when the file changed on disk since it was opened (or last saved), so an edit made elsewhere is never
overwritten silently.

Nothing here imports textual: these are plain functions the app calls, and tests call them directly too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..profile.toml_lines import key_lines
from ..schema.errors import Problem
from ..schema.plan import Decision

BACKUP_SUFFIX = ".bak"


class SaveRefused(Exception):
    """The file changed on disk since it was opened; nothing was written."""


class SaveFailed(Exception):
    """Writing failed part-way; the file on disk is unchanged."""


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def current_umask() -> int:
    """The process's umask. Reading it means setting it: the stand-in meanwhile is the strictest one, so a
    file another thread creates in between is at worst more private, never less."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def save_mode(path: Path) -> int:
    """The permission bits a save gives ``path``: its own when it exists, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def _write_synced(directory: Path, stem: str, data: bytes, mode: int) -> Path:
    """Write ``data`` to a new temporary file in ``directory`` with permissions ``mode``, flushed to disk;
    return its path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes it 0600, which the rename would give the profile
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def _replace(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` over ``target``; the temporary file goes when that fails."""
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, data: bytes, *, previous: bytes | None) -> Path | None:
    """Replace ``path`` with ``data`` atomically, first keeping ``previous`` (its current bytes) as a backup.

    Returns the backup's path (None for a new file). Raises `SaveFailed` when any step fails; the file at
    ``path`` is then what it was before.
    """
    directory = path.parent if str(path.parent) else Path(".")
    backup = None
    try:
        mode = save_mode(path)
        new = _write_synced(directory, path.name, data, mode)
        if previous is not None:
            # The backup is itself written atomically, so a crash cannot leave a torn one either.
            backup = backup_path(path)
            try:
                _replace(_write_synced(directory, backup.name, previous, mode), backup)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(new)
                raise
        _replace(new, path)
    except OSError as exc:
        raise SaveFailed(
            f"could not save {path}: {exc.strerror or exc}; the file on disk is unchanged"
        ) from exc
    with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return backup


@dataclass
class ProfileFile:
    """One profile file in the editor: its path and the bytes on disk when it was opened or last saved."""

    path: Path
    on_disk: bytes | None
    """What the file held when opened or last saved; None for a file that did not exist yet."""

    @classmethod
    def open(cls, path: Path) -> ProfileFile:
        data = read_bytes(path)
        if data is None:
            raise FileNotFoundError(f"no such profile: {path}")
        return cls(path, data)

    @classmethod
    def new(cls, path: Path) -> ProfileFile:
        """A file that does not exist yet (its first save creates it)."""
        return cls(path, None)

    @property
    def saved_text(self) -> str:
        """The text as last opened or saved ("" for a new file)."""
        return (self.on_disk or b"").decode("utf-8", errors="replace")

    def is_modified(self, text: str) -> bool:
        return self.on_disk is None or text != self.saved_text

    def disk_now(self) -> bytes | None:
        return read_bytes(self.path)

    def disk_stamp(self) -> tuple[int, int, int] | None:
        """(inode, size, mtime in ns) of the file on disk, None when it is not there: a cheap look that
        changes whenever the file is rewritten or replaced, for watching it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed_on_disk(self) -> bool:
        """True when the file on disk is no longer what was opened or last saved."""
        return self.disk_now() != self.on_disk

    def save(self, text: str) -> Path | None:
        """Save ``text``: refused (`SaveRefused`) when the file changed on disk, atomic, with a backup.

        Returns the backup's path (None for a new file).
        """
        now = self.disk_now()
        if now != self.on_disk:
            what = "was created" if self.on_disk is None else "was deleted" if now is None else "changed"
            raise SaveRefused(
                f"{self.path} {what} on disk since it was opened; not saved "
                "(see the difference with the diff view, and reload from there)"
            )
        data = text.encode("utf-8")
        backup = write_atomic(self.path, data, previous=now)
        self.on_disk = data
        return backup


# ---- where things are in the text ----------------------------------------------------------------


def key_at(text: str, row: int) -> str | None:
    """The dotted key written on 0-based line ``row``; on a line without one, the table above it.

    On a line with several keys (an inline table) the outermost one is taken: ``machine.gpus.0``.
    """
    lines = key_lines(text)
    on_row = [k for k, n in lines.items() if n == row + 1]
    if on_row:
        return min(on_row, key=lambda k: k.count("."))
    above = [(n, k) for k, n in lines.items() if n <= row + 1]
    if not above:
        return None
    _, nearest = max(above)
    return nearest.split(".")[0] if "." in nearest else nearest


def _by_row(marks: Iterable[tuple[str | None, int | None, str]], path: str | None) -> dict[int, str]:
    """0-based line -> message, for the (file, line, message) marks that point at a line of ``path``
    (several on one line: joined)."""
    target = os.path.realpath(path) if path else None
    rows: dict[int, list[str]] = {}
    for file, line, message in marks:
        if line is None or file is None or target is None or os.path.realpath(file) != target:
            continue
        rows.setdefault(line - 1, []).append(message)
    return {row: "; ".join(msgs) for row, msgs in rows.items()}


def problems_by_row(problems: Iterable[Problem], path: str | None) -> dict[int, str]:
    """0-based line -> message, for the problems that point at a line of ``path``.

    The key is left out: the line shows it, and the editor has little room beside it.
    """
    return _by_row(((p.file, p.line, p.message) for p in problems), path)


def overrides_by_row(decisions: Iterable[Decision], path: str | None) -> dict[int, str]:
    """0-based line -> what rules did to the setting the profile asks for there: ``off: <rule id>``."""
    marks = (
        (d.origin.file, d.origin.line, f"{d.severity}: {d.rule}")
        for d in decisions
        if d.requested and d.origin is not None
    )
    return _by_row(marks, path)
