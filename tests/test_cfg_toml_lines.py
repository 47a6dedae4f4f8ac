"""The TOML key -> line indexer: every shape of key a profile can be written in."""

from __future__ import annotations

import tomllib

from strata_cfg.profile.toml_lines import key_lines

DOC = """\
#:schema ./x.json
name = "a"  # trailing comment
[machine]
gpus = [
  { name = "g", vram_mib = 1, bandwidth_gbs = 2.0 },
  {name="h", vram_mib=3,bandwidth_gbs=4},
]

[split]
layers = [
  12,   # first
  24,
]
"quoted" = 1
a.b . c = \"\"\"two
lines\"\"\"
d = 'literal # not a comment'
e = "x = [not an array]"

[[x.y]]
z = 1
[[x.y]]
z = 2
[batch]
slots = 4
"""


def test_every_key_gets_the_line_it_is_written_on():
    lines = key_lines(DOC)
    expected = {
        "name": 2,
        "machine": 3,
        "machine.gpus": 4,
        "machine.gpus.0": 5,
        "machine.gpus.0.bandwidth_gbs": 5,
        "machine.gpus.1": 6,
        "machine.gpus.1.name": 6,
        "machine.gpus.1.vram_mib": 6,
        "split": 9,
        "split.layers": 10,
        "split.layers.0": 11,
        "split.layers.1": 12,
        "split.quoted": 14,
        "split.a": 15,
        "split.a.b.c": 15,
        "split.d": 17,
        "split.e": 18,
        "x.y": 20,
        "x.y.0": 20,
        "x.y.0.z": 21,
        "x.y.1": 22,
        "x.y.1.z": 23,
        "batch.slots": 25,
    }
    assert {k: lines.get(k) for k in expected} == expected


def test_indexed_keys_match_the_keys_tomllib_reads():
    data = tomllib.loads(DOC)

    def walk(node, prefix):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            yield f"{prefix}{k}"
            yield from walk(v, f"{prefix}{k}.")

    assert set(walk(data, "")) <= set(key_lines(DOC))


def test_invalid_text_keeps_what_came_before():
    lines = key_lines('name = "a"\n[batch]\nslots = \n')
    assert lines["name"] == 1
    assert lines["batch"] == 2


def _walk(node, prefix=""):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield f"{prefix}{k}"
        yield from _walk(v, f"{prefix}{k}.")


def test_every_key_of_every_shipped_and_fixture_profile_is_indexed_on_a_line_holding_it():
    from pathlib import Path

    root = Path(__file__).parent.parent
    files = [*root.glob("profiles/**/*.toml"), *root.glob("tests/profiles/**/*.toml")]
    checked = 0
    for path in files:
        text = path.read_text()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            continue  # the syntax-error fixture
        lines = key_lines(text)
        source = text.splitlines()
        for key in _walk(data):
            assert key in lines, f"{path.name}: {key}"
            leaf = key.rsplit(".", 1)[-1]
            assert leaf.isdigit() or leaf in source[lines[key] - 1], (
                f"{path.name}: {key} on line {lines[key]}"
            )
            checked += 1
    assert checked > 300
