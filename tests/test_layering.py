"""The layering DESIGN.md requires, checked by importing each package in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numpy", "cupy", "textual", "strata_runtime")


def loaded_modules(*imports: str) -> set[str]:
    code = (
        "import sys, json\n"
        + "".join(f"import {m}\n" for m in imports)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _offenders(modules: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in banned)


@pytest.mark.parametrize(
    "imports",
    [
        ("strata_cfg",),
        ("strata_cfg.schema",),
        ("strata_cfg.resolve",),
        ("strata_cfg.cli",),
        (
            "strata_cfg.profile.load",
            "strata_cfg.facts.gather",
            "strata_cfg.plan.from_profile",
            "strata_cfg.launch.engine_process",
        ),
    ],
)
def test_config_side_loads_no_array_library_tui_or_runtime(imports):
    assert _offenders(loaded_modules(*imports), HEAVY) == []


def test_schema_and_resolver_import_only_pydantic_and_the_stdlib():
    modules = loaded_modules("strata_cfg.schema", "strata_cfg.resolve")
    stdlib = set(sys.stdlib_module_names)
    allowed = {
        "strata_cfg",
        "pydantic",
        "pydantic_core",
        "typing_extensions",
        "annotated_types",
        "typing_inspection",
    }
    foreign = sorted(m for m in modules if m.split(".")[0] not in stdlib | allowed and not m.startswith("_"))
    assert foreign == []
    # No I/O modules of our own: the loader, facts and runner stay out of the pure core.
    ours = {m for m in modules if m.startswith("strata_cfg.")}
    assert not ours & {
        "strata_cfg.profile.load",
        "strata_cfg.facts.gather",
        "strata_cfg.plan.from_profile",
        "strata_cfg.launch.engine_process",
    }


def test_strata_plan_imports_only_its_own_command():
    code = (
        "import sys, io, contextlib\nfrom strata_cfg import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()): cli.main(['plan'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('strata_cfg.commands.') and '._' not in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['strata_cfg.commands.plan']"
