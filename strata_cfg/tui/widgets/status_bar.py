"""The status line under the panes: which file, saved or not, changed on disk or not, and what the last
resolution said."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.widgets import Static

from ...schema.plan import LaunchPlan


def status_text(
    path: Path | None,
    modified: bool,
    plan: LaunchPlan | None,
    problems: int,
    highlighting: bool,
    changed_on_disk: bool = False,
) -> Text:
    text = Text()
    if path is None:
        return Text("no profile open: Ctrl+O lists them, Ctrl+N makes one", style="dim")
    text.append(path.as_posix(), style="bold")
    text.append(" ● modified" if modified else " saved", style="#ffd75f" if modified else "dim")
    if changed_on_disk:
        text.append("  ! changed on disk (Ctrl+R)", style="bold #ff8700")
    text.append("  ")
    if problems:
        text.append(f"refused: {problems} problem{'s' * (problems != 1)}", style="bold #ff5f5f")
    elif plan is not None:
        text.append("resolves", style="#5fd75f")
        asked = sum(1 for d in plan.decisions if d.requested)
        if asked:
            text.append(f"  ! {asked} asked-for setting{'s' * (asked != 1)} changed", style="bold #ff8700")
    if not highlighting:
        text.append("  (plain text: install tree-sitter-toml for highlighting)", style="dim")
    return text


class StatusBar(Static):
    pass
