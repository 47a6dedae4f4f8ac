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
    liveness_s: float | None = None
    """Seconds a ready engine may go without answering ``/health`` at all before the supervisor takes it for
    hung, stops it and starts it again (`liveness`); 0: never. None: the plan's ``serve.step_timeout_s``
    and `LIVENESS_MARGIN_S` more, off where that is 0."""
    health_every_s: float = 5.0
    """How often the supervisor asks a ready engine's ``/health``."""

    def liveness(self, step_timeout_s: float) -> float:
        """The bound `liveness_s` gives for a plan whose steps may take ``step_timeout_s`` (0: off). The
        engine's own watchdog ends a hung step after ``step_timeout_s``; this one reaches an engine that
        watchdog cannot, whose process no longer runs Python at all (a call into a driver that never
        returns while it holds the interpreter's lock, a stopped process), and which so answers nothing."""
        if self.liveness_s is not None:
            return self.liveness_s
        return step_timeout_s + LIVENESS_MARGIN_S if step_timeout_s > 0 else 0.0

    def argv(self) -> list[str]:
        """These options as ``strata launch`` flags (for the detached supervisor)."""
        out = [
            f"--max-restarts={self.max_restarts}",
            f"--grace={self.grace_s}",
            f"--start-timeout={self.start_timeout_s}",
        ]
        if self.liveness_s is not None:
            out.append(f"--liveness-timeout={self.liveness_s}")
        return out


LIVENESS_MARGIN_S = 60.0
"""How much longer than ``serve.step_timeout_s`` the supervisor waits for any answer to ``/health``, so that
the engine's own watchdog, which says where the step hung, acts first."""
