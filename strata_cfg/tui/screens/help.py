"""The help screen: every key binding of the app, the editor's own keys, and what the plan's colours mean."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table
from rich.text import Text
from textual.binding import Binding

from ..widgets.plan_view import REQUESTED_STYLE, SEVERITY_STYLE, TERMS
from .dialogs import PageScreen

EDITOR_KEYS = (
    ("Tab / Shift+Tab", "move focus: profile list, editor, plan"),
    ("arrows, PgUp/PgDn", "move; in the plan, scroll"),
    ("Ctrl+Z / Ctrl+Y", "undo / redo"),
    ("Ctrl+X / Ctrl+C / Ctrl+V", "cut / copy / paste"),
    ("Ctrl+K", "delete to the end of the line"),
    ("Enter", "in the profile list: open the profile"),
)


def key_names(binding: Binding) -> str:
    """``ctrl+t,f2`` -> ``Ctrl+T / F2``."""

    def one(key: str) -> str:
        return "+".join(part.capitalize() if len(part) > 1 else part.upper() for part in key.split("+"))

    return " / ".join(one(k) for k in binding.key.split(","))


def help_text(bindings: Iterable[Binding]) -> Table:
    """The bindings (those with a description), the editor keys, and a colour legend."""
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True, style="bold")
    table.add_column()
    table.add_row(Text("keys", style="bold underline"), "")
    for b in bindings:
        if b.description:
            table.add_row(key_names(b), b.tooltip or b.description)
    table.add_row("", "")
    table.add_row(Text("in the editor", style="bold underline"), "")
    for key, what in EDITOR_KEYS:
        table.add_row(key, what)
    table.add_row("", "")
    table.add_row(Text("the plan", style="bold underline"), "")
    marks = Text()
    for sev in ("error", "off", "clamp", "warn", "note"):
        marks.append(sev.upper() if sev != "note" else "note", style=SEVERITY_STYLE[sev]).append("  ")
    table.add_row("decisions", marks)
    table.add_row(
        Text("! OFF", style=REQUESTED_STYLE), "a setting the profile asked for that a rule turned off"
    )
    bar = Text()
    for name, colour in TERMS:
        bar.append("░" if name == "free" else "█", style=colour).append(f" {name}  ")
    table.add_row("VRAM bars", bar)
    table.add_row("highlighted", Text("a line of the plan the last edit changed (the view scrolls to it)"))
    table.add_row("line numbers", Text("red: the profile has a problem on that line", style="#ff5f5f"))
    table.add_row(
        Text("12!", style=REQUESTED_STYLE), "the setting on that line was asked for and a rule turned it off"
    )
    table.add_row("", "")
    table.add_row(Text("the status line", style="bold underline"), "")
    table.add_row("engine", "the engine a launch started: its profile, port and state; Ctrl+L shows its page")
    table.add_row("changed on disk", "the file changed elsewhere while you edit it; Ctrl+R shows how")
    return table


class HelpScreen(PageScreen):
    def __init__(self, bindings: Iterable[Binding]) -> None:
        super().__init__("help: strata tui", help_text(bindings))
