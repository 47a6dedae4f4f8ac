"""The resolver's record book: every resolved value with its source, every decision, every refusal.

A rule that changes a value does it through the ledger, which records the new value, its source and the
`Decision` in the same call. Provenance is therefore never reconstructed after the fact, and a value cannot
change without a decision saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..schema.errors import Problem
from ..schema.plan import Decision, Origin, Setting, Source, find_origin
from .rules import rule


def _plain(value: Any) -> Any:
    """Values as JSON has them (tuples become lists), so a plan survives a round trip unchanged."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


class Ledger:
    """Resolved settings, decisions and problems, filled in the order the rules run."""

    def __init__(
        self, origins: Mapping[str, Origin] | None = None, *, default_file: str | None = None
    ) -> None:
        self.origins: Mapping[str, Origin] = origins or {}
        self.default_file = default_file
        """Named by problems about a key the user did not write."""
        self._values: dict[str, Any] = {}
        self._sources: dict[str, Source] = {}
        self._asked: dict[str, Any] = {}
        self._requested: dict[str, Any] = {}
        self._rules: dict[str, list[str]] = {}
        self._gates: dict[str, list[str]] = {}
        self.decisions: list[Decision] = []
        self.problems: list[Problem] = []

    # ---- reading ----------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def get(self, key: str, rule_id: str) -> Any:
        """The resolved value of ``key``, noting that ``rule_id`` read it."""
        self._touch(key, rule_id)
        return self._values[key]

    def asked(self, key: str) -> Any:
        """What the user wrote for ``key`` (None when they wrote nothing)."""
        return self._asked.get(key)

    def user_set(self, key: str) -> bool:
        return self._asked.get(key) is not None

    # ---- setting ----------------------------------------------------------------------------------

    def take(self, key: str, asked: Any, default: Any) -> Any:
        """Resolve ``key`` to what the user wrote, else to ``default``. Returns the value."""
        if asked is not None:
            self._asked[key] = asked
            self._values[key] = asked
            self._sources[key] = Source(kind="user", origin=find_origin(self.origins, key))
        else:
            self._values[key] = default
            self._sources[key] = Source(kind="default")
        self._rules.setdefault(key, [])
        return self._values[key]

    def resolve_auto(self, key: str, value: Any, rule_id: str, message: str | None = None) -> None:
        """Replace an ``auto`` (written or defaulted) by its concrete value, derived by ``rule_id``."""
        origin = find_origin(self.origins, key) if self.user_set(key) else None
        self._values[key] = value
        self._sources[key] = Source(kind="derived", origin=origin, rule=rule_id)
        self._touch(key, rule_id)
        if message is not None:
            self._decide(rule_id, key, message, requested=False)

    def gate(self, key: str, rule_id: str) -> Any:
        """The value of feature ``key``, noting that gate ``rule_id`` checked it (and could turn it off)."""
        gates = self._gates.setdefault(key, [])
        if rule_id not in gates:
            gates.append(rule_id)
        return self.get(key, rule_id)

    def change(
        self, key: str, value: Any, rule_id: str, message: str, *, because: tuple[str, ...] = ()
    ) -> None:
        """A rule sets ``key`` to ``value``: ``forced`` over what the user asked, else ``derived``.

        Always records the decision; it is marked ``requested`` when it overrides what the user wrote.
        ``because`` names the keys whose values made the rule fire.
        """
        requested = self.user_set(key) and self._asked[key] != value
        if requested:
            self._requested[key] = self._asked[key]
            self._sources[key] = Source(kind="forced", origin=find_origin(self.origins, key), rule=rule_id)
        else:
            self._sources[key] = Source(kind="derived", rule=rule_id)
        self._values[key] = value
        self._touch(key, rule_id)
        self._decide(rule_id, key, message, requested=requested, because=because)

    def note(
        self,
        rule_id: str,
        key: str,
        message: str,
        *,
        requested: bool = False,
        because: tuple[str, ...] = (),
    ) -> None:
        """A decision that changes no value (a note or a warning); ``because`` as for `change`."""
        self._touch(key, rule_id)
        self._decide(rule_id, key, message, requested=requested, because=because)

    def refuse(self, rule_id: str, key: str, message: str) -> None:
        """An error: the plan is refused. Collected, so every refusal of a step is reported together."""
        origin = find_origin(self.origins, key)
        file = origin.file if origin else self.default_file
        self.problems.append(Problem(file, origin.line if origin else None, key, message, rule_id))

    # ---- results ----------------------------------------------------------------------------------

    def settings(self) -> dict[str, Setting]:
        return {
            key: Setting(
                value=_plain(self._values[key]),
                source=self._sources[key],
                requested=_plain(self._requested.get(key)),
                rules=tuple(self._rules.get(key, ())),
                gates=tuple(self._gates.get(key, ())),
            )
            for key in sorted(self._values)
        }

    def _touch(self, key: str, rule_id: str) -> None:
        rules = self._rules.setdefault(key, [])
        if rule_id not in rules:
            rules.append(rule_id)

    def _decide(
        self, rule_id: str, key: str, message: str, *, requested: bool, because: tuple[str, ...] = ()
    ) -> None:
        r = rule(rule_id)
        origin = find_origin(self.origins, key) if self.user_set(key) or requested else None
        for cause in because:
            if cause in self._values:
                self._touch(cause, rule_id)
        self.decisions.append(
            Decision(
                rule=rule_id,
                severity=r.severity,
                key=key,
                message=message,
                requested=requested,
                origin=origin,
                because=because,
            )
        )
