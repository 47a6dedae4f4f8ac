"""The `strata` entry point: lazy subcommands and shared exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from strata_cfg import cli


def test_usage_lists_every_command(capsys):
    assert cli.main(["--help"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    for name, (_, help_) in cli.COMMANDS.items():
        assert f"{name}" in out and help_ in out


def test_unknown_command_is_a_usage_error(capsys):
    assert cli.main(["plaan"]) == cli.EXIT_USAGE
    assert "unknown command 'plaan'" in capsys.readouterr().err


def test_bad_option_is_a_usage_error(capsys):
    assert cli.main(["schema", "--no-such-option"]) == cli.EXIT_USAGE


def test_every_registered_command_builds_its_parser():
    for name in cli.COMMANDS:
        parser, module = cli.build_parser(name)
        assert parser.prog == f"strata {name}"
        assert callable(module.run)


def test_only_the_chosen_command_is_imported():
    code = (
        "import sys; from strata_cfg import cli; cli.main(['schema']);"
        "print(sorted(m for m in sys.modules if m.startswith('strata_cfg.commands.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['strata_cfg.commands.schema']"


def test_schema_command_prints_the_profile_schema(capsys):
    assert cli.main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Profile"
    assert schema["additionalProperties"] is False
    assert "slots" in schema["$defs"]["BatchSection"]["properties"]


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `strata plan --json | head -1`: the reader is gone before strata writes (it takes a moment to start).
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_cfg", "plan", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.EXIT_PIPE_CLOSED
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
