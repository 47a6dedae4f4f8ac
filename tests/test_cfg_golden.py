"""Golden files for what `strata plan` prints, one per shipped profile, emulated boxes included (and one
with a feature turned off).

Regenerate after an intended change with:  STRATA_REGEN_GOLDEN=1 python -m pytest tests/test_cfg_golden.py
and read the diff before committing it.
"""

from __future__ import annotations

import os

import pytest
from cfg_fixtures import HERE, REPO

from strata_cfg import cli

GOLDEN = HERE / "golden"
REGEN = os.environ.get("STRATA_REGEN_GOLDEN") == "1"
CASES = {
    **{f"plan-{p.stem}": ["plan", f"profiles/{p.name}"] for p in sorted((REPO / "profiles").glob("*.toml"))},
    **{
        f"plan-emulate-{p.stem}": ["plan", f"profiles/emulate/{p.name}"]
        for p in sorted((REPO / "profiles" / "emulate").glob("*.toml"))
    },
    "plan-groups-turn-batch-mtp-off": ["plan", "profiles/rtx3080-20g-x2.toml", "--set", "batch.groups=2"],
    "engine-args-rtx3080-20g-x2": ["plan", "profiles/rtx3080-20g-x2.toml", "--emit", "engine-args"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_text_matches_its_golden_file(name, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the text names the profile file as given, relative to the repository
    assert cli.main(CASES[name]) == 0
    out = capsys.readouterr().out
    path = GOLDEN / f"{name}.txt"
    if REGEN:
        path.write_text(out)
    assert path.exists(), f"no golden file {path.name}; run with STRATA_REGEN_GOLDEN=1"
    assert out == path.read_text()


def test_every_golden_file_has_a_case():
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(CASES)
