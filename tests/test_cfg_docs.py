"""docs/PROFILES.md stays the reference: it names every profile key and every rule."""

from __future__ import annotations

from cfg_fixtures import REPO

from strata_cfg.profile.validate import _section_model
from strata_cfg.resolve import RULES
from strata_cfg.schema.profile import Profile

DOC = (REPO / "docs" / "PROFILES.md").read_text()


def profile_keys(model=Profile, prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name
        sub = _section_model(field.annotation)
        if sub is not None:
            yield from profile_keys(sub, prefix + name + ("[]." if name == "gpus" else "."))


def test_every_profile_key_is_documented():
    missing = [k for k in profile_keys() if f"`{k}`" not in DOC and f"`[{k}]`" not in DOC]
    assert missing == []


def test_every_rule_is_documented():
    assert [r for r in RULES if f"`{r}`" not in DOC] == []
