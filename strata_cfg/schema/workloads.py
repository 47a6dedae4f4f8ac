"""The benchmark workloads of BENCH.md, shared by the in-process harness and the HTTP driver.

Both measure the same requests: the same workload names, client counts and prompts.
"""

from __future__ import annotations

WORKLOADS = ("two-decodes", "clients", "read-beside-decode", "solo")
"""Workload names, as `strata bench --workload` takes them."""
CLIENT_COUNTS = (1, 2, 4, 8)
"""Concurrent clients of the ``clients`` workload."""
PROMPTS = (
    "The quick brown fox",
    "Once upon a time",
    "In the beginning",
    "Hello, world",
    "A long time ago",
    "Dear reader",
    "It was a dark night",
    "Call me Ishmael",
)
"""Short prompts; request i uses prompt i modulo their number."""
