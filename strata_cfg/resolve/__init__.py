"""The pure resolver: profile + machine facts + model facts -> `LaunchPlan`, step by step.

Imports only pydantic and the standard library, and does no I/O.
"""

from .core import resolve
from .rules import RULES, STEPS, Rule

__all__ = ["RULES", "STEPS", "Rule", "resolve"]
