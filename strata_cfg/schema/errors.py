"""The project's one error type for profiles and plans: a list of problems, each speaking TOML."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a profile: where, which key, and what was expected."""

    file: str | None
    line: int | None
    key: str
    message: str
    rule: str | None = None

    def __str__(self) -> str:
        where = self.file or "<profile>"
        if self.line is not None:
            where += f":{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"file": self.file, "line": self.line, "key": self.key}
        out["message"] = self.message
        if self.rule:
            out["rule"] = self.rule
        return out


class ProfileError(Exception):
    """A profile that cannot be loaded, validated or resolved. Carries every problem found."""

    def __init__(self, problems: list[Problem] | Problem) -> None:
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
