"""How the supervisor waits, restarts and stops: the options `strata launch` takes and hands on to a
detached supervisor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchOptions:
    """How the supervisor waits, restarts and stops."""

    max_restarts: int = 5
    """Restarts allowed in a row; the count starts again once an engine has stayed up for `stable_s`."""
    backoff_s: float = 1.0
    """Wait before the first restart; doubled after each further one."""
    backoff_max_s: float = 30.0
    stable_s: float = 120.0
    grace_s: float = 15.0
    """After SIGTERM, how long the engine may take to drain before it gets SIGKILL."""
    start_timeout_s: float = 900.0
    """How long loading may take before the launch is called failed."""
    poll_s: float = 0.2

    def argv(self) -> list[str]:
        """These options as ``strata launch`` flags (for the detached supervisor)."""
        return [
            f"--max-restarts={self.max_restarts}",
            f"--grace={self.grace_s}",
            f"--start-timeout={self.start_timeout_s}",
        ]
