"""`strata tui` as a command: what it opens, its refusals, and that nothing else pays for textual."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from strata_cfg.commands.tui import where


def test_the_tui_command_does_not_load_textual_until_the_app_runs():
    code = (
        "import sys, json, argparse\n"
        "from strata_cfg import cli\n"
        "parser, module = cli.build_parser('tui')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'textual')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_where_opens_profiles_a_directory_or_a_file_beside_its_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "no profiles/ directory here" in where(None)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "box.toml").write_text('name = "box"\n')
    assert where(None) == (Path("profiles"), None)
    assert where(Path("profiles")) == (Path("profiles"), None)
    assert where(Path("profiles/box.toml")) == (Path("profiles"), Path("profiles/box.toml"))
    assert "no such profile or directory: nope.toml" in where(Path("nope.toml"))


def test_strata_tui_on_a_missing_path_is_a_usage_error(tmp_path):
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "strata_cfg", "tui", str(missing)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"strata tui: no such profile or directory: {missing}" in done.stderr
