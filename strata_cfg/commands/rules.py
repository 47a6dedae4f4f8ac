"""`strata rules`: every resolution rule with its stable id, step, severity and summary."""

from __future__ import annotations

import argparse
import json

from ..report.table import table
from ..resolve import RULES, STEPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rules as JSON")


def run(args: argparse.Namespace) -> int:
    if args.json:
        rows = [
            {"id": r.id, "step": r.step, "severity": r.severity, "summary": r.summary} for r in RULES.values()
        ]
        print(json.dumps(rows, indent=2))
        return 0
    step = None
    for r in RULES.values():
        if r.step != step:
            step = r.step
            print(f"{'' if step == 0 else chr(10)}{step}. {STEPS[step]}")
            group = [x for x in RULES.values() if x.step == step]
            for line in table([["  " + x.id, x.severity, x.summary] for x in group]):
                print(line)
    return 0
