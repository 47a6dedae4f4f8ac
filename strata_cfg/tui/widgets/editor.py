"""The TOML editor: Textual's TextArea with TOML highlighting, and each problem shown at its line.

Highlighting needs tree-sitter and its TOML grammar (``tree-sitter``, ``tree-sitter-toml``); without them the
editor is plain text and says so in the status bar, and nothing else changes. A problem is shown the way
editors show diagnostics: the line number turns red and the message follows the line's text. A setting the
profile asks for that a rule turned off (or changed) is marked the same way, with a ``!`` beside its line
number and the rule after its text.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

from rich.cells import cell_len
from rich.segment import Segment
from textual.strip import Strip
from textual.widgets import TextArea

LANGUAGE = "toml"


def toml_highlighting() -> bool:
    """Whether TOML can be highlighted: tree-sitter and its TOML grammar are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("tree_sitter", "tree_sitter_toml"))


class ProfileEditor(TextArea):
    """A TOML editor that marks the lines its profile's problems point at, and the settings rules changed."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        *TextArea.COMPONENT_CLASSES,
        "profile-editor--problem",
        "profile-editor--problem-gutter",
        "profile-editor--override",
        "profile-editor--override-gutter",
    }
    DEFAULT_CSS = """
    ProfileEditor > .profile-editor--problem { color: $error; text-style: italic; }
    ProfileEditor > .profile-editor--problem-gutter { background: $error; color: $text; text-style: bold; }
    ProfileEditor > .profile-editor--override { color: #ff8700; text-style: italic; }
    ProfileEditor > .profile-editor--override-gutter { background: #af0000; color: white; text-style: bold; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        self.highlighting = toml_highlighting()
        super().__init__(
            "",
            language=LANGUAGE if self.highlighting else None,
            soft_wrap=False,  # one screen row per line: a problem's row is its line
            tab_behavior="focus",  # Tab moves focus, as everywhere else in the app
            show_line_numbers=True,
            id=id,
        )
        self.problems: dict[int, str] = {}
        """0-based line -> the problem shown there."""
        self.overrides: dict[int, str] = {}
        """0-based line -> what rules did to the setting asked for there (``off: <rule id>``)."""

    def show_marks(self, problems: dict[int, str], overrides: dict[int, str]) -> None:
        if (problems, overrides) != (self.problems, self.overrides):
            self.problems, self.overrides = problems, overrides
            self.refresh()

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        if row in self.problems:
            kind, message = "problem", self.problems[row]
        elif row in self.overrides:
            kind, message = "override", self.overrides[row]
        else:
            return strip
        if not self.text:
            return strip
        gutter = self.gutter_width
        width = self.scrollable_content_region.width
        number = strip.crop(0, gutter).text
        if kind == "override" and gutter > 2:
            number = number[:-2] + "! "  # in the gutter's margin, right after the line number
        gutter_style = self.get_component_rich_style(f"profile-editor--{kind}-gutter")
        marked = Strip([Segment(number, gutter_style)], gutter)
        text_cells = cell_len(self.document.get_line(row).expandtabs(self.indent_width))
        start = gutter + max(0, text_cells - scroll_x) + 2
        body = strip.crop(gutter, max(start, gutter))
        if start >= width:
            return Strip.join([marked, strip.crop(gutter)])
        note_style = self.get_component_rich_style(f"profile-editor--{kind}")
        note = Strip([Segment(f"◀ {message}", note_style)]).crop(0, width - start)
        rest = strip.crop(start + note.cell_length)
        return Strip.join([marked, body, note, rest])
