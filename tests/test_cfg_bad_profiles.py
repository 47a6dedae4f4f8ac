"""One small bad profile per failure mode (profiles/bad/): each is refused with its message, key and line.

Each file says what it expects in its header (``# expect:`` text, ``# expect-key:``, and ``# expect-file:``
when the error is reported in another file of the ``extends`` chain); the offending line is marked
``# <- here`` in the file that holds it, so no line number is written twice.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cfg_fixtures import BAD_DIR, problems_of

BAD = sorted(BAD_DIR.glob("*.toml"))


def expectations(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^# (expect(?:-key|-file)?):[ \t]*(.*)$", path.read_text(), flags=re.M))


def marked_line(path: Path) -> int | None:
    lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if "# <- here" in line]
    return lines[0] if lines else None


def test_there_is_a_bad_profile_per_failure_mode():
    assert len(BAD) >= 20
    for path in BAD:
        assert "expect" in expectations(path), f"{path.name} says nothing about what it expects"


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_profile_is_refused_with_message_key_and_line(path):
    want = expectations(path)
    problems = problems_of(path)
    matching = [p for p in problems if p.key == want.get("expect-key", "")]
    assert matching, f"no problem on key {want.get('expect-key')!r}: {[str(p) for p in problems]}"
    p = matching[0]
    assert want["expect"] in p.message
    where = path.parent / want["expect-file"] if "expect-file" in want else path
    assert Path(p.file).resolve() == where.resolve()
    assert p.line == marked_line(where)
    assert str(p).startswith(f"{p.file}")
