"""Typed models shared by every part of strata: the profile, the facts, and the launch plan.

Also the formats both packages read: ``plan.json`` (`plan_file`), safetensors headers
(`safetensors_header`) and the window row rules (`windows`). This package imports only pydantic and the
standard library, and it is the only part of strata_cfg that strata_runtime imports.
"""

from .errors import Problem, ProfileError
from .facts import GpuFacts, MachineFacts, ModelFacts
from .plan import LaunchPlan
from .profile import Profile

__all__ = ["GpuFacts", "LaunchPlan", "MachineFacts", "ModelFacts", "Problem", "Profile", "ProfileError"]
