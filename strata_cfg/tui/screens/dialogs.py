"""Small modal screens: a question with a few answers (save, discard or cancel; yes or no), and a scrollable
page of text (explain, diff)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.console import RenderableType
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static


@dataclass(frozen=True)
class Choice:
    """One answer to a question: the key that gives it, its label, and the word the dialog returns."""

    key: str
    label: str
    answer: str


SAVE_DISCARD = (Choice("s", "Save", "save"), Choice("d", "Discard the edits", "discard"))
"""The answers to "what about the unsaved edits?" (Esc cancels)."""
YES = (Choice("y", "Yes", "yes"),)


class ChoiceScreen(ModalScreen[str | None]):
    """A question with a few answers, each on its own key and button; Esc (and n) cancel with None.

    The first answer's button has the focus, so Enter gives it.
    """

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,n", "cancel", "Cancel")]

    def __init__(self, question: str, choices: Sequence[Choice]) -> None:
        super().__init__()
        self.question = question
        self.choices = tuple(choices)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                for c in self.choices:
                    yield Button(Content(f"{c.label} [{c.key}]"), name=c.answer, compact=True)
                yield Button(Content("Cancel [Esc]"), name="", compact=True)

    def on_mount(self) -> None:
        self.query(Button).first().focus()

    def on_key(self, event: events.Key) -> None:
        for c in self.choices:
            if event.key == c.key:
                event.stop()
                self.dismiss(c.answer)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.name or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PageScreen(ModalScreen[str | None]):
    """A titled page of text over the app; Escape closes it. Subclasses add keys that dismiss with a word."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "Close")]

    def __init__(self, title: str, body: RenderableType, keys: str = "[b]Esc[/b] close") -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.keys = keys

    def compose(self) -> ComposeResult:
        with Vertical(classes="page"):
            scroll = VerticalScroll(Static(self.body, classes="page-body"), classes="page-scroll")
            scroll.border_title = self.title_text
            yield scroll
            yield Static(self.keys, classes="dialog-keys")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()

    def action_close(self) -> None:
        self.dismiss(None)
