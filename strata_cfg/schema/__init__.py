"""Typed models shared by every part of strata: the profile, the facts, and the launch plan."""

from .errors import Problem, ProfileError
from .facts import GpuFacts, MachineFacts, ModelFacts
from .plan import LaunchPlan
from .profile import Profile

__all__ = ["GpuFacts", "LaunchPlan", "MachineFacts", "ModelFacts", "Problem", "Profile", "ProfileError"]
