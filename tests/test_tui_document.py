"""Saving a profile from the editor (atomic, with a backup, refusing to clobber) and finding keys by line.

These drive `strata_cfg.tui.document` directly; the Pilot tests drive the same code through the app.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from strata_cfg.schema.errors import Problem
from strata_cfg.tui.document import (
    ProfileFile,
    SaveFailed,
    SaveRefused,
    backup_path,
    key_at,
    problems_by_row,
)


def _profile(tmp_path: Path) -> tuple[Path, str]:
    slots = 2 + secrets.randbelow(6)
    path = tmp_path / "box.toml"
    text = f'name = "box"\n\n[batch]\nslots = {slots}\nmtp = true\n'
    path.write_text(text)
    return path, text


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_save_writes_the_file_and_keeps_the_previous_version_as_a_backup(tmp_path):
    path, before = _profile(tmp_path)
    file = ProfileFile.open(path)
    after = before.replace("mtp = true", f"mtp = false\ngroups = {1 + secrets.randbelow(4)}")
    backup = file.save(after)
    assert path.read_text() == after
    assert backup == backup_path(path) and backup.read_text() == before
    assert not file.is_modified(after) and file.is_modified(before)
    # A second save keeps the version it replaces, not the first one.
    again = after + "# tuned\n"
    file.save(again)
    assert path.read_text() == again and backup.read_text() == after
    assert _leftovers(tmp_path) == []


def test_a_save_that_would_clobber_a_change_made_on_disk_is_refused(tmp_path):
    path, before = _profile(tmp_path)
    file = ProfileFile.open(path)
    elsewhere = before + f"# edited in another editor {secrets.token_hex(4)}\n"
    path.write_text(elsewhere)
    assert file.changed_on_disk()
    with pytest.raises(SaveRefused, match="changed on disk since it was opened"):
        file.save(before.replace("slots", "# slots"))
    assert path.read_text() == elsewhere
    assert not backup_path(path).exists()


def test_a_deleted_file_is_not_silently_recreated(tmp_path):
    path, _ = _profile(tmp_path)
    file = ProfileFile.open(path)
    path.unlink()
    with pytest.raises(SaveRefused, match="was deleted on disk"):
        file.save("name = 'x'\n")
    assert not path.exists()


def test_a_new_file_is_created_once_and_refused_if_something_appeared_there(tmp_path):
    path = tmp_path / "new.toml"
    file = ProfileFile.new(path)
    assert file.is_modified("")
    assert file.save("name = 'new'\n") is None  # nothing to back up
    assert path.read_text() == "name = 'new'\n" and not backup_path(path).exists()
    other = ProfileFile.new(tmp_path / "raced.toml")
    (tmp_path / "raced.toml").write_text("name = 'first'\n")
    with pytest.raises(SaveRefused, match="was created on disk"):
        other.save("name = 'second'\n")
    assert (tmp_path / "raced.toml").read_text() == "name = 'first'\n"


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o600])
def test_the_saved_file_and_its_backup_keep_the_files_permissions(tmp_path, mode):
    path, before = _profile(tmp_path)
    path.chmod(mode)
    ProfileFile.open(path).save(before + "# tuned\n")
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert stat.S_IMODE(backup_path(path).stat().st_mode) == mode


def test_a_new_file_gets_the_permissions_the_umask_leaves(tmp_path):
    old = os.umask(0o027)
    try:
        ProfileFile.new(tmp_path / "new.toml").save("name = 'new'\n")
        assert os.umask(0o027) == 0o027  # reading the umask left it as it was
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.toml").stat().st_mode) == 0o640


def test_a_crash_at_the_rename_leaves_the_original_intact(tmp_path, monkeypatch):
    path, before = _profile(tmp_path)
    file = ProfileFile.open(path)
    real_replace = os.replace

    def crash_on_the_profile(src, dst):
        if Path(dst) == path:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_profile)
    with pytest.raises(SaveFailed, match="the file on disk is unchanged"):
        file.save("name = 'half'\n")
    assert path.read_text() == before
    assert _leftovers(tmp_path) == []
    # The editor still holds unsaved text: the file is what was opened, so a retry is not refused.
    monkeypatch.setattr(os, "replace", real_replace)
    file.save("name = 'whole'\n")
    assert path.read_text() == "name = 'whole'\n"


def test_a_crash_while_writing_leaves_the_original_intact(tmp_path, monkeypatch):
    path, before = _profile(tmp_path)
    file = ProfileFile.open(path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(SaveFailed, match="No space left on device"):
        file.save(before + "# more\n")
    assert path.read_text() == before
    assert not backup_path(path).exists()
    assert _leftovers(tmp_path) == []


def test_key_at_names_the_key_on_a_line_or_the_table_above_it():
    text = (
        'name = "x"\n'  # 0
        "\n"  # 1
        "[machine]\n"  # 2
        'gpus = [{ name = "a", vram_mib = 1, bandwidth_gbs = 2 }]\n'  # 3
        "\n"  # 4
        "[batch]\n"  # 5
        "slots = 2\n"  # 6
        "# a comment\n"  # 7
    )
    assert key_at(text, 0) == "name"
    assert key_at(text, 2) == "machine"
    assert key_at(text, 3) == "machine.gpus"
    assert key_at(text, 6) == "batch.slots"
    assert key_at(text, 7) == "batch"  # a comment belongs to the table it is in
    assert key_at("# only a comment\n", 0) is None


def test_problems_are_placed_at_their_rows_in_this_file_only(tmp_path):
    here = str(tmp_path / "a.toml")
    problems = [
        Problem(here, 4, "batch.slot", "unknown key `slot`; did you mean `slots`?"),
        Problem(here, 4, "batch.slot", "second"),
        Problem(str(tmp_path / "base.toml"), 2, "model", "elsewhere"),
        Problem(here, None, "machine", "no line"),
    ]
    assert problems_by_row(problems, here) == {3: "unknown key `slot`; did you mean `slots`?; second"}
