"""Loading profiles: the extends chain, --set overrides, origins, and errors that speak TOML."""

from __future__ import annotations

import os

import pytest
from cfg_fixtures import raised_within

from strata_cfg.profile.extends import MAX_CHAIN
from strata_cfg.profile.load import load_profile, load_profile_text
from strata_cfg.profile.overrides import SET_ORIGIN, parse_set
from strata_cfg.profile.toml_file import MAX_NESTING, MAX_PROFILE_BYTES
from strata_cfg.schema.errors import ProfileError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_extends_merges_tables_and_child_wins(tmp_path):
    base = 'name = "base"\n[batch]\nslots = 2\nmtp = true\n[spec]\ndraft_tokens = 3\n'
    write(tmp_path / "base" / "common.toml", base)
    child = write(tmp_path / "box.toml", 'extends = "base/common.toml"\n\n[batch]\nslots = 4\n')
    lp = load_profile(child)
    assert lp.profile.batch is not None
    assert (lp.profile.batch.slots, lp.profile.batch.mtp) == (4, True)
    assert lp.profile.spec is not None and lp.profile.spec.draft_tokens == 3
    assert lp.origins["batch.slots"].file == str(child) and lp.origins["batch.slots"].line == 4
    base_file = str(tmp_path / "base" / "common.toml")
    assert lp.origins["batch.mtp"].file == base_file and lp.origins["batch.mtp"].line == 4
    assert lp.files == (base_file, str(child))


def test_name_is_not_inherited(tmp_path):
    write(tmp_path / "base.toml", 'name = "base"\n')
    lp = load_profile(write(tmp_path / "rig-7.toml", 'extends = "base.toml"\n'))
    assert lp.profile.name is None
    assert lp.name == "rig-7"


def test_arrays_are_replaced_whole_with_their_origins(tmp_path):
    write(tmp_path / "base.toml", "[split]\nlayers = [10, 20, 30]\n")
    lp = load_profile(write(tmp_path / "c.toml", 'extends = "base.toml"\n[split]\nlayers = [17]\n'))
    assert lp.profile.split is not None and lp.profile.split.layers == [17]
    assert "split.layers.2" not in lp.origins
    assert lp.origins["split.layers.0"].line == 3


def test_extends_cycle_is_refused_with_the_chain(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", '# b\nextends = "a.toml"\n')
    with pytest.raises(ProfileError) as err:
        load_profile(tmp_path / "a.toml")
    (p,) = err.value.problems
    assert p.key == "extends" and p.line == 2 and p.file.endswith("b.toml")
    assert "cycle" in p.message and "a.toml -> " in p.message


def test_missing_base_names_the_extends_line(tmp_path):
    f = write(tmp_path / "a.toml", '\n\nextends = "nope.toml"\n')
    with pytest.raises(ProfileError) as err:
        load_profile(f)
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == (str(f), 3, "extends")
    assert "no such profile file" in p.message


def test_set_overrides_with_toml_values_and_set_origin():
    lp = load_profile_text(
        "[batch]\nslots = 2\n", "p.toml", ["batch.slots=6", "split.layers=[3]", "model.synthetic=tiny"]
    )
    assert lp.profile.batch is not None and lp.profile.batch.slots == 6
    assert lp.profile.split is not None and lp.profile.split.layers == [3]
    assert lp.profile.model is not None and lp.profile.model.synthetic == "tiny"
    assert lp.origins["batch.slots"].file == SET_ORIGIN
    assert lp.origins["batch"].file == "p.toml"  # the table is still the file's
    assert lp.origins["split.layers.0"].file == SET_ORIGIN


@pytest.mark.parametrize("bad", ["batch.slots", "=4", "a..b=1", "x=[1,"])
def test_malformed_set_is_rejected(bad):
    with pytest.raises(ValueError, match="--set"):
        parse_set(bad)


def test_every_validation_problem_is_reported_with_line_and_did_you_mean():
    text = (
        '[batch]\nslot = 2\ngroups = "two"\n'
        '[machine]\ngpus = [{name = "a", vram_mib = -1, bandwidth_gbs = 1}]\n'
    )
    with pytest.raises(ProfileError) as err:
        load_profile_text(text, "p.toml")
    got = {(p.key, p.line): p.message for p in err.value.problems}
    assert "did you mean `slots`" in got[("batch.slot", 2)]
    assert "'auto'" in got[("batch.groups", 3)] and "integer" in got[("batch.groups", 3)]
    assert "greater than 0" in got[("machine.gpus.0.vram_mib", 5)]


def test_toml_syntax_error_names_the_line():
    with pytest.raises(ProfileError) as err:
        load_profile_text('name = "x"\n[batch\n', "p.toml")
    (p,) = err.value.problems
    assert p.line == 2 and "not valid TOML" in p.message


def test_set_indexes_into_an_array_and_keeps_the_rest(tmp_path):
    f = tmp_path / "box.toml"
    f.write_text(
        '[machine]\ngpus = [\n  { name = "a", vram_mib = 1024, bandwidth_gbs = 20 },\n'
        '  { name = "b", vram_mib = 2048, bandwidth_gbs = 30 },\n]\n'
    )
    lp = load_profile(f, ["machine.gpus.1.vram_mib=16384"])
    assert lp.profile.machine is not None and lp.profile.machine.gpus is not None
    assert [g.vram_mib for g in lp.profile.machine.gpus] == [1024, 16384]
    assert lp.origins["machine.gpus.1.vram_mib"].file == SET_ORIGIN
    assert lp.origins["machine.gpus.1.name"].line == 4  # the rest of that element is still the file's


def test_set_with_an_index_past_the_array_is_refused(tmp_path):
    f = tmp_path / "box.toml"
    f.write_text('[machine]\ngpus = [{ name = "a", vram_mib = 1024, bandwidth_gbs = 20 }]\n')
    with pytest.raises(ProfileError) as err:
        load_profile(f, ["machine.gpus.3.vram_mib=1"])
    (p,) = err.value.problems
    assert p.file == SET_ORIGIN and "not an index" in p.message


# ---- bounded reads: no input hangs the loader or exhausts its stack ---------------------------------


def test_an_extends_chain_of_a_thousand_files_is_refused_at_the_line_past_the_limit(tmp_path):
    for i in range(1000):
        write(tmp_path / f"p{i}.toml", f'# {i}\nextends = "p{i + 1}.toml"\n')
    write(tmp_path / "p1000.toml", "[batch]\nslots = 2\n")
    with pytest.raises(ProfileError) as err:
        load_profile(tmp_path / "p0.toml")
    (p,) = err.value.problems
    assert (p.key, p.line) == ("extends", 2) and p.file == str(tmp_path / f"p{MAX_CHAIN - 1}.toml")
    assert f"longer than {MAX_CHAIN} files" in p.message


def test_a_chain_at_the_limit_still_loads(tmp_path):
    for i in range(MAX_CHAIN - 1):
        write(tmp_path / f"p{i}.toml", f'extends = "p{i + 1}.toml"\n')
    write(tmp_path / f"p{MAX_CHAIN - 1}.toml", "[batch]\nslots = 3\n")
    lp = load_profile(tmp_path / "p0.toml")
    assert lp.profile.batch is not None and lp.profile.batch.slots == 3 and len(lp.files) == MAX_CHAIN


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("[" * 5000 + "]" * 5000, ""),
        ("{ a = " * 5000 + "1" + " }" * 5000, ""),
        ("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1), ""),
    ],
    ids=["arrays-5000", "inline-tables-5000", "arrays-past-the-limit"],
)
def test_nesting_past_the_limit_is_refused_at_its_line(value, key):
    with pytest.raises(ProfileError) as err:
        load_profile_text(f'name = "x"\n\n[split]\nlayers = {value}\n', "p.toml")
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == ("p.toml", 4, key)
    assert f"nested more than {MAX_NESTING} deep" in p.message


def test_deep_dotted_keys_are_refused_naming_the_key():
    with pytest.raises(ProfileError) as err:
        load_profile_text("[batch]\n" + "a." * 3000 + "b = 1\n", "p.toml")
    (p,) = err.value.problems
    assert p.line == 2 and p.key.startswith("batch.a.a.") and "nested more than" in p.message


def test_extends_naming_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "base.toml")
    f = write(tmp_path / "box.toml", 'extends = "base.toml"\n')
    err = raised_within(20, lambda: load_profile(f))  # opening a FIFO to read waits for a writer
    assert isinstance(err, ProfileError)
    (p,) = err.problems
    assert (p.file, p.line, p.key) == (str(f), 1, "extends") and "not a regular file (a FIFO)" in p.message


def test_a_profile_larger_than_the_limit_is_refused_unread(tmp_path):
    f = write(tmp_path / "big.toml", "# " + "x" * MAX_PROFILE_BYTES + "\n")
    with pytest.raises(ProfileError) as err:
        load_profile(f)
    (p,) = err.value.problems
    assert p.file == str(f) and "larger than 1 MiB" in p.message


# ---- strict types: what docs/PROFILES.md calls an error is one, from a file or from --set ---------------


@pytest.mark.parametrize(
    ("item", "key", "expected"),
    [
        ("batch.slots=true", "batch.slots", "expected a valid integer (got true)"),
        ("batch.slots='2'", "batch.slots", 'expected a valid integer (got "2")'),
        ("batch.mtp=1", "batch.mtp", "expected a valid boolean (got 1)"),
        ("serve.port=8000.0", "serve.port", "expected a valid integer (got 8000.0)"),
        ("memory.context=true", "memory.context", "expected a valid integer (got true)"),
    ],
)
def test_set_values_of_the_wrong_type_are_refused_at_the_set(item, key, expected):
    with pytest.raises(ProfileError) as err:
        load_profile_text("[batch]\nslots = 2\n[serve]\nport = 8000\n", "p.toml", [item])
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == (SET_ORIGIN, None, key) and expected in p.message


def test_an_integer_is_still_a_float():
    lp = load_profile_text('[machine]\ngpus = [{ name = "a", vram_mib = 1024, bandwidth_gbs = 760 }]\n')
    assert lp.profile.machine is not None and lp.profile.machine.gpus is not None
    assert lp.profile.machine.gpus[0].bandwidth_gbs == 760.0


# ---- --set: an override that cannot apply is refused at the --set, never silently dropped ---------------


def test_set_extends_is_refused_instead_of_ignored(tmp_path):
    write(tmp_path / "other.toml", "[batch]\nslots = 5\n")
    f = write(tmp_path / "box.toml", "[batch]\nslots = 2\n")
    with pytest.raises(ProfileError) as err:
        load_profile(f, [f"extends={tmp_path / 'other.toml'}"])
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == (SET_ORIGIN, None, "extends")
    assert "cannot be set from the command line" in p.message


def test_set_through_a_value_blames_the_set_not_the_profile_line():
    with pytest.raises(ProfileError) as err:
        load_profile_text("[batch]\nslots = 2\n", "p.toml", ["batch.slots.x=2"])
    (p,) = err.value.problems
    assert (p.file, p.line, p.key) == (SET_ORIGIN, None, "batch.slots.x")
    assert "batch.slots is 2, not a table" in p.message
