"""Small modal screens: a yes/no question and a scrollable page of text (explain, diff)."""

from __future__ import annotations

from typing import ClassVar

from rich.console import RenderableType
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmScreen(ModalScreen[bool]):
    """A question answered with y or n (Escape: no)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="dialog-body")
            yield Static("[b]y[/b] yes   [b]n[/b] no", classes="dialog-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


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
