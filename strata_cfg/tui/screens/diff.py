"""The diff page: the editor's text against the file on disk, and what that does to the plan.

The plan part is `strata diff`'s own comparison (`plan_changes`, `changes_text`) of the saved profile's plan
with the editor's. From here the file on disk can be reloaded, dropping the edits (the app asks first, and
Ctrl+Z brings them back).
"""

from __future__ import annotations

import difflib
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType

from ...report.diff import changes_text, plan_changes
from ...schema.plan import LaunchPlan
from .dialogs import PageScreen


def text_diff(on_disk: str, text: str, name: str) -> Text:
    """A unified diff of the file on disk and the editor's text, coloured."""
    lines = list(
        difflib.unified_diff(
            on_disk.splitlines(), text.splitlines(), f"{name} (on disk)", f"{name} (editor)", lineterm=""
        )
    )
    if not lines:
        return Text("the editor's text is what is on disk", style="dim")
    out = Text()
    for line in lines:
        style = "bold" if line.startswith(("---", "+++")) else ""
        if not style:
            style = {"+": "#5fd75f", "-": "#ff5f5f", "@": "#5fafd7"}.get(line[:1], "")
        out.append(line + "\n", style=style)
    return out


def diff_page(
    on_disk: str | None,
    text: str,
    name: str,
    disk_plan: LaunchPlan | str | None,
    plan: LaunchPlan | str | None,
    changed_on_disk: bool,
) -> Text:
    """The whole page. A plan given as a string is the reason it did not resolve."""
    page = Text()
    if changed_on_disk:
        page.append(
            f"{name} changed on disk since it was opened: saving is refused until you reload\n\n",
            style="bold #ff8700",
        )
    if on_disk is None:
        page.append(f"{name} is not on disk yet: saving creates it\n", style="dim")
        return page
    page.append("text\n", style="bold underline")
    page.append_text(text_diff(on_disk, text, name))
    page.append("\nplan\n", style="bold underline")
    if isinstance(disk_plan, LaunchPlan) and isinstance(plan, LaunchPlan):
        page.append(changes_text(plan_changes(disk_plan, plan), f"{name} (on disk)", f"{name} (editor)"))
    else:
        for label, p in (("on disk", disk_plan), ("editor", plan)):
            if isinstance(p, str):
                page.append(f"the {label} profile does not resolve:\n{p}\n", style="#ff5f5f")
    return page


class DiffScreen(PageScreen):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("r", "reload", "Reload from disk")]

    def __init__(self, title: str, body: Text) -> None:
        super().__init__(
            title,
            body,
            keys="[b]Esc[/b] close   [b]r[/b] reload the file from disk (drops the edits, after asking)",
        )

    def action_reload(self) -> None:
        self.dismiss("reload")
