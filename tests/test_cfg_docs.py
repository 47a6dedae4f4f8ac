"""The docs stay true: docs/PROFILES.md names every profile key and every rule, and gives the resolver's
defaults; docs/ARCHITECTURE.md every folder and module of strata_cfg; and no document cites a file the
repository does not hold."""

from __future__ import annotations

import re

import pytest
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


# ---- every document cites only what the repository holds ------------------------------------------------

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
REPO_PATH = re.compile(r"\b(?:strata_cfg|strata_runtime|docs|tests|scripts|profiles)/[\w/.-]*\w")
OUTSIDE = re.compile(r"\b(?:RULES|BENCH|DESIGN|STYLE|EXPERTS)\.md\b|\.\./shared")


def _prose(text: str) -> str:
    """The text without fenced code blocks (their paths are examples, not citations)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(doc):
    paths = {m.group(0) for m in REPO_PATH.finditer(_prose(doc.read_text()))}
    assert sorted(p for p in paths if not (REPO / p).exists()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_document_cites_files_outside_the_repository(doc):
    assert OUTSIDE.findall(doc.read_text()) == []


CITATION = re.compile(r'docs/(\w+\.md),? \(?"([^"]+)"')
"""A citation of a document's section by its title: docs/RUNTIME.md, "How deep a request alone drafts"."""
TITLE = re.compile(r"^(?:#+ +(.+?) *$|(?:[*-] )?\*\*([^*]+?)\.?\*\*)", re.M)
"""A section's title: a heading, or the bold words a paragraph or a list item starts with."""


def _titles(doc: str) -> set[str]:
    return {(m.group(1) or m.group(2)).strip() for m in TITLE.finditer((REPO / "docs" / doc).read_text())}


def test_every_section_a_source_or_document_cites_exists():
    """Code, scripts, tests and documents cite a document's sections by title: each cited title begins a
    heading or a paragraph's bold lead of that document, or names a dated run's heading by its lease ("a
    twelfth lease") or by the name it gives itself in quotes (a section renamed leaves no citation
    behind)."""
    sources = [*sorted(REPO.glob("strata_*/**/*.py")), *sorted(REPO.glob("scripts/*.py"))]
    sources += [*sorted(REPO.glob("tests/*.py")), *DOCS]
    titles = {p.name: _titles(p.name) for p in (REPO / "docs").glob("*.md")}
    cited, missing = 0, []
    for path in sources:
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())  # a citation may wrap, in comments too
        for m in CITATION.finditer(text):
            doc, title = m.groups()
            cited += 1
            named = (title, f", {title} (", f'"{title}"')
            if not any(t.startswith(title) or any(n in t for n in named[1:]) for t in titles.get(doc, ())):
                missing.append(f"{path.relative_to(REPO)}: {doc}, {title!r}")
    assert missing == [] and cited > 50


def test_no_strata_cfg_source_cites_files_outside_the_repository():
    cited = [
        f"{path.relative_to(REPO)}: {m.group(0)}"
        for path in sorted((REPO / "strata_cfg").rglob("*.py"))
        for m in OUTSIDE.finditer(path.read_text())
    ]
    assert cited == []


def test_architecture_names_every_folder_and_module_of_strata_cfg():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    root = REPO / "strata_cfg"
    folders = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())
    assert [f for f in folders if f"strata_cfg/{f}/" not in text] == []
    # The steps' modules by name; the interfaces (commands, tui) are described as a whole.
    modules = [
        f"{p.parent.name}/{p.stem}"
        for f in folders
        if f not in ("commands", "tui")
        for p in sorted((root / f).glob("*.py"))
        if p.stem != "__init__"
    ]
    assert [m for m in modules if f"`{m.split('/')[1]}`" not in text] == []


def test_engine_args_are_documented_as_the_cpp_engines_command_line():
    text = " ".join(DOC.split())
    assert "`--emit engine-args` prints a `strata-engine ...` command line: the Strata C++ engine's" in text
    assert "This package does not install a `strata-engine` program" in text


# ---- the documented defaults are the resolver's ---------------------------------------------------------

KEY_ROW = re.compile(r"^\| `([a-z_.\[\]]+)` \| (?:[^|\\]|\\\|)* \| ([^|]*) \|", flags=re.M)
LITERAL = re.compile(r'true|false|-?\d+(?:\.\d+)?|`"[^`"]*"`')


def documented_literal_defaults() -> dict[str, object]:
    """Keys whose documented default is one literal (a bool, a number or a quoted string other than
    ``"auto"``), as values."""
    out: dict[str, object] = {}
    for key, default in KEY_ROW.findall(DOC):
        text = default.strip()
        if not LITERAL.fullmatch(text) or text == '`"auto"`':  # "auto" is resolved by a rule, not taken
            continue
        if text in ("true", "false"):
            out[key] = text == "true"
        elif text.startswith("`"):
            out[key] = text.strip('`"')
        else:
            out[key] = float(text) if "." in text else int(text)
    return out


def test_every_literal_default_in_the_docs_is_what_the_resolver_takes_when_the_key_is_unset():
    """A GPU profile that sets nothing it need not (all experts resident, and under a cache): every key whose
    documented default is a literal resolves to it wherever it is left to its default, and each is checked
    at least once."""
    from strata_cfg.plan.from_profile import resolve_text

    documented = documented_literal_defaults()
    assert {"experts.max_swaps", "experts.swap_margin", "batch.slots", "serve.host"} <= documented.keys()
    checked: set[str] = set()
    present: set[str] = set()  # the keys a plan records (machine.probe acts while loading, before a plan)
    for vram in (143771, 24576):  # every expert resident; a cache
        text = (
            "[machine]\nhost_ram_mib = 262144\n"
            f'gpus = [{{ name = "GPU", vram_mib = {vram}, bandwidth_gbs = 4800 }}]\n'
            '[model]\nsynthetic = "qwen3-30b-a3b"\n[serve]\n'
        )
        settings = resolve_text(text, "defaults.toml").plan.settings
        present |= documented.keys() & settings.keys()
        for key, want in documented.items():
            if key in settings and settings[key].source.kind == "default":
                assert settings[key].value == want, (vram, key, settings[key].value, want)
                checked.add(key)
    assert len(present) >= len(documented) - 1 and checked == present, sorted(present - checked)
