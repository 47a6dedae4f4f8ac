"""The profile list: every ``*.toml`` under the directory the app was opened on, bases included."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import OptionList
from textual.widgets.option_list import Option

from ..messages import ProfileChosen


def find_profiles(root: Path) -> list[Path]:
    """Profiles in ``root`` and one level of subdirectories (``base/``), its own files first, each sorted.

    Hidden directories are skipped, and the search goes no deeper, so opening a profile in a large
    directory stays quick.
    """
    found = [*root.glob("*.toml"), *root.glob("[!.]*/*.toml")]
    return sorted(
        (p for p in found if p.is_file()),
        key=lambda p: (len(p.relative_to(root).parts), p.relative_to(root).as_posix()),
    )


class ProfileList(OptionList):
    """Profiles by their path under the root; Enter opens one."""

    def __init__(self, root: Path, *, id: str | None = None) -> None:
        self.root = root
        self.paths = find_profiles(root)
        super().__init__(*self._profile_options(), id=id)
        self.border_title = f"{root.as_posix().rstrip('/')}/"

    def _profile_options(self) -> list[Option]:
        return [Option(p.relative_to(self.root).as_posix()) for p in self.paths]

    def reload(self) -> None:
        """Look for profiles again (after one was created)."""
        self.paths = find_profiles(self.root)
        self.clear_options()
        self.add_options(self._profile_options())

    def mark_open(self, path: Path) -> None:
        """Highlight the profile now in the editor."""
        for i, p in enumerate(self.paths):
            if p == path:
                self.highlighted = i

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.post_message(ProfileChosen(self.paths[event.option_index]))
