"""New profile from a machine probe: probe the GPUs, name the file, and open the new profile unsaved."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from ..probe import ProbeResult, probe_profile_text, run_probe

SCHEMA_FILE = "strata-profile.schema.json"


def default_name(root: Path) -> Path:
    """``root/<hostname>.toml``, numbered when that exists."""
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "machine"
    path, n = root / f"{stem}.toml", 1
    while path.exists():
        n += 1
        path = root / f"{stem}-{n}.toml"
    return path


def probe_summary(result: ProbeResult) -> str:
    if not result.gpus:
        return f"[#ff8700]no GPU found[/] ({result.error}): the profile will use one virtual CPU device"
    rows = [f"  {g.index}: {g.name}, {g.vram_mib} MiB, {g.bandwidth_gbs:g} GB/s" for g in result.gpus]
    return f"[#5fd75f]{len(result.gpus)} GPU(s) found:[/]\n" + "\n".join(rows)


class NewProfileScreen(ModalScreen[tuple[Path, str] | None]):
    """Dismisses with (path, text) of the new profile, or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, root: Path, probe: Callable[[], str]) -> None:
        super().__init__()
        self.root = root
        self.probe = probe
        self.result: ProbeResult | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]new profile from a probe of this machine[/b]")
            yield Static("probing the GPUs (nvidia-smi)...", id="probe-result")
            yield Static("file:")
            yield Input(default_name(self.root).as_posix(), id="new-path")
            yield Static("", id="new-error")
            yield Static(
                "[b]Enter[/b] create and open it (unsaved)   [b]Esc[/b] cancel", classes="dialog-keys"
            )

    def on_mount(self) -> None:
        self.query_one(Input).focus()
        self.run_probe()

    @work(thread=True, exclusive=True)
    def run_probe(self) -> None:
        result = run_probe(self.probe)
        self.app.call_from_thread(self._probed, result)

    def _probed(self, result: ProbeResult) -> None:
        self.result = result
        self.query_one("#probe-result", Static).update(probe_summary(result))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        error = self.query_one("#new-error", Static)
        if self.result is None:
            error.update("[#ff8700]the probe is still running[/]")
            return
        value = event.value.strip()
        if not value:
            error.update("[#ff5f5f]give a file name[/]")
            return
        path = Path(value if value.endswith(".toml") else value + ".toml")
        if path.exists():
            error.update(f"[#ff5f5f]{path} already exists: choose another name[/]")
            return
        schema = path.parent / SCHEMA_FILE
        text = probe_profile_text(
            path.stem, self.result, schema=f"./{SCHEMA_FILE}" if schema.exists() else None
        )
        self.dismiss((path, text))

    def action_cancel(self) -> None:
        self.dismiss(None)
