"""The profile commands as a user runs them: output, the JSON contracts, and exit codes."""

from __future__ import annotations

import json

from cfg_fixtures import BAD_DIR, PROFILES, REPO, RULES_DIR, line_of

from strata_cfg import cli
from strata_cfg.commands.schema import schema_text
from strata_cfg.profile.load import demo_text
from strata_cfg.resolve import RULES

BOX = str(PROFILES / "rtx3080-20g-x2.toml")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_public_fields(capsys):
    code, out, _ = run(capsys, "plan", BOX, "--json")
    plan = json.loads(out)
    assert code == 0
    assert [(s["index"], s["gpu"], s["layers"]) for s in plan["stages"]] == [
        (0, 0, [0, 23]),
        (1, 1, [23, 48]),
    ]
    assert plan["stages"][1]["drafters"] == [0, 1] and "lm_head" in plan["stages"][1]["holds"]
    assert {k: plan["batch"][k] for k in ("slots", "groups", "mode", "mtp")} == {
        "slots": 2,
        "groups": 1,
        "mode": "serial",
        "mtp": True,
    }
    assert plan["spec"]["draft_tokens"] == 4
    for g in plan["gpus"]:
        mib = g["budget_mib"]
        assert set(mib) == {"total", "weights", "kv", "drafters", "workspace", "reserve", "experts", "free"}
        assert abs(sum(v for k, v in mib.items() if k != "total") - mib["total"]) < 0.5
    assert all({"rule", "severity", "key", "message"} <= set(d) for d in plan["decisions"])


def test_refused_profile_prints_the_errors_json_and_exits_1(capsys):
    code, out, _ = run(capsys, "plan", str(BAD_DIR / "unknown-key.toml"), "--json")
    assert code == 1
    (error,) = json.loads(out)["errors"]
    assert set(error) >= {"file", "line", "key", "message"}
    assert error["key"] == "batch.slot" and error["line"] == line_of(BAD_DIR / "unknown-key.toml", "slot = 2")


def test_refused_profile_text_goes_to_stderr_with_file_and_line(capsys):
    path = RULES_DIR / "split.rising.toml"
    code, out, err = run(capsys, "plan", str(path))
    assert code == 1 and out == ""
    assert f"{path}:{line_of(path, 'layers')}: split.layers:" in err and "[split.rising]" in err


def test_plan_without_a_profile_is_the_embedded_demo(capsys):
    code, out, _ = run(capsys, "plan")
    assert code == 0 and out.startswith("demo  (<embedded>/demo.toml)")
    assert "batch MTP on" in out


def test_embedded_demo_is_the_shipped_demo_profile():
    assert demo_text() == (PROFILES / "demo.toml").read_text()


def test_engine_args_carry_every_resolved_value(capsys):
    code, out, _ = run(capsys, "plan", BOX, "--emit", "engine-args")
    args = out.split()
    assert code == 0 and args[0] == "strata-engine"
    flags = dict(zip(args[1::1], args[2::1], strict=False))
    assert flags["--layer-split"] == "23" and flags["--split-device"] == "0,1"
    assert flags["--batch"] == "2" and flags["--batch-groups"] == "1" and "--batch-mtp" in args
    assert (
        flags["--spec"] == "4" and flags["--max-context"] == "4096" and flags["--vram-reserve-mib"] == "700"
    )
    assert "--serve" in args
    _, pipelined, _ = run(capsys, "plan", BOX, "--emit", "engine-args", "--set", "batch.groups=2")
    assert "--batch-mtp" not in pipelined.split() and "--batch-groups 2" in pipelined


def test_engine_args_warn_that_the_cpp_engine_refuses_batch_mtp_in_groups(capsys):
    code, out, _ = run(capsys, "plan", str(PROFILES / "h200-x2-mtp-groups.toml"), "--emit", "engine-args")
    note, line = out.splitlines()
    assert code == 0 and note.startswith("# batch.mtp_in_groups: the Strata C++ engine refuses --batch-mtp")
    assert "--batch-groups 2 --batch-mtp" in line


def test_check_reports_every_problem_of_every_file_and_exits_1(capsys):
    bad = [BAD_DIR / "unknown-key.toml", BAD_DIR / "wrong-type.toml", PROFILES / "demo.toml"]
    code, out, _ = run(capsys, "check", *map(str, bad))
    assert code == 1
    assert out.count("refused") == 2 and "ok       " in out
    assert "did you mean `slots`" in out and "expected a valid integer" in out


def test_check_json_and_exit_0_on_good_profiles(capsys):
    good = sorted(str(p) for p in [*PROFILES.glob("*.toml"), *PROFILES.glob("emulate/*.toml")])
    code, out, _ = run(capsys, "check", "--json", *good)
    assert code == 0
    assert [r["ok"] for r in json.loads(out)["profiles"]] == [True] * len(good)


def test_check_strict_refuses_an_asked_for_feature_turned_off(capsys):
    code, out, _ = run(capsys, "check", BOX, "--strict", "--set", "batch.groups=2")
    assert code == 1 and "strict: batch MTP is off" in out
    assert run(capsys, "check", BOX, "--strict")[0] == 0


def test_check_help_documents_exit_codes(capsys):
    code, out, _ = run(capsys, "check", "--help")
    assert code == 0 and "exit codes: 0" in out and "2 usage" in out


def test_bad_set_is_a_usage_error(capsys):
    code, _, err = run(capsys, "plan", BOX, "--set", "batch.slots")
    assert code == 2 and "KEY=VALUE" in err


def test_explain_shows_value_source_rules_and_decisions(capsys):
    code, out, _ = run(capsys, "explain", BOX, "batch.groups", "--set", "batch.groups=2")
    assert code == 0 and out.startswith("batch.groups = 2\n") and "source     user (--set)" in out
    code, out, _ = run(capsys, "explain", BOX, "batch.mtp", "--set", "batch.groups=2")
    assert "batch.mtp = false" in out and "forced by batch-mtp.pipelined-groups" in out
    assert "asked for  true" in out and "OFF" in out


def test_explain_unknown_key_suggests(capsys):
    code, _, err = run(capsys, "explain", BOX, "batch.slot")
    assert code == 1 and "batch.slots" in err


def test_diff_with_set_shows_plan_changes_and_decisions(capsys):
    code, out, _ = run(capsys, "diff", BOX, "--set", "batch.groups=2")
    assert code == 0
    assert "batch.mode" in out and '"serial" -> "pipelined"' in out and "batch.mtp" in out
    assert "+ off   batch-mtp.pipelined-groups" in out and "- note  groups.batch-mtp-yield" in out


def test_diff_of_a_profile_with_itself_is_empty(capsys):
    code, out, _ = run(capsys, "diff", BOX, BOX)
    assert code == 0 and "no change in the plan" in out


def test_diff_json_of_two_profiles(capsys):
    code, out, _ = run(capsys, "diff", str(PROFILES / "h200.toml"), str(PROFILES / "h200-x2.toml"), "--json")
    changes = json.loads(out)
    paths = {c["path"] for c in changes["changed"]}
    assert code == 0 and {"stages.1", "batch.groups", "batch.mode"} <= paths


def test_rules_lists_every_rule(capsys):
    code, out, _ = run(capsys, "rules", "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)] == list(RULES)
    _, text, _ = run(capsys, "rules")
    assert all(rule_id in text for rule_id in RULES)


def test_committed_schema_file_is_what_strata_schema_prints():
    assert (REPO / "profiles" / "strata-profile.schema.json").read_text() == schema_text()


def test_every_shipped_profile_points_at_the_schema():
    for path in [*PROFILES.glob("*.toml"), *PROFILES.glob("base/*.toml"), *PROFILES.glob("emulate/*.toml")]:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#:schema ") and first.endswith("strata-profile.schema.json"), path


# ---- explain: the cause, the gates, the GPUs -------------------------------------------------------------


def test_explain_shows_the_effect_under_the_key_that_caused_it(capsys):
    path = str(RULES_DIR / "batch-mtp.pipelined-groups.toml")
    code, out, _ = run(capsys, "explain", path, "batch.groups")
    assert code == 0 and out.startswith("batch.groups = 2\n")
    assert "  effects\n    turned batch.mtp off (rule batch-mtp.pipelined-groups): batch MTP is off" in out


def test_explain_a_feature_that_is_on_says_every_gate_passed_instead_of_listing_them(capsys):
    code, out, _ = run(capsys, "explain", BOX, "batch.mtp")
    assert code == 0 and "  on         every gate passed (9 checked)" in out
    assert "batch-mtp.needs-batching" not in out  # the gates are counted, not listed
    # the one rule that read it without gating it, and what batch MTP on did to the groups
    assert "  rules      groups.batch-mtp-yield\n" in out
    assert "made batch.groups = 1 (rule groups.batch-mtp-yield)" in out


def test_explain_a_feature_turned_off_names_the_gate(capsys):
    code, out, _ = run(capsys, "explain", BOX, "batch.mtp", "--set", "batch.groups=2")
    assert "off        turned off by the gate batch-mtp.pipelined-groups; the 8 before it passed" in out


def test_explain_a_gpu_entry_explains_that_gpu_not_another_key(capsys):
    code, out, _ = run(capsys, "explain", BOX, "machine.gpus.1")
    assert code == 0 and out.startswith("machine.gpus.1 = RTX 3080 20GB, 20480 MiB, 760 GB/s\n")
    assert "machine.backend" not in out and "machine.gpus.0" not in out
    assert "role       stage 1 (layers 23-47)" in out and "drafters 26.5" in out
    # the TUI asks for the key under the cursor
    _, name, _ = run(capsys, "explain", BOX, "machine.gpus.0.name")
    assert name.startswith("machine.gpus.0 = RTX 3080 20GB")


def test_explain_a_profile_without_a_key_is_a_usage_error(capsys):
    code, out, err = run(capsys, "explain", BOX)
    assert code == 2 and out == "" and "give a KEY after the profile" in err


def test_plan_help_says_engine_args_are_the_cpp_engines_not_a_program_installed_here(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    text = " ".join(out.split())  # argparse wraps the help
    assert code == 0 and "command line of the Strata C++ engine (strata-engine)" in text
    assert "this package does not install it" in text


def test_check_strict_takes_every_shipped_profile_base_and_emulated_box_included(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, _ = run(capsys, "check", "--strict", "profiles/**/*.toml")  # quoted: check expands it
    lines = out.splitlines()
    assert code == 0 and all(line.startswith("ok ") for line in lines)
    checked = {line.split()[1] for line in lines}
    assert {"profiles/emulate/rtx3080-20g-x2-on-h200.toml", "profiles/emulate/h200-24g.toml"} <= checked
    assert len(checked) == len(list(PROFILES.glob("**/*.toml")))
    base = next(line for line in lines if "profiles/base/qwen3-30b-a3b.toml" in line)
    assert "base of" in base and "validated, resolved through them" in base


def test_check_a_base_alone_still_resolves_it_and_refuses_what_it_lacks(capsys):
    code, out, _ = run(capsys, "check", str(PROFILES / "base" / "qwen3-30b-a3b.toml"))
    assert code == 1 and "no GPUs given" in out


def test_check_a_pattern_that_matches_nothing_is_refused(capsys, tmp_path):
    code, out, _ = run(capsys, "check", str(tmp_path / "*.toml"))
    assert code == 1 and "no such profile file" in out
