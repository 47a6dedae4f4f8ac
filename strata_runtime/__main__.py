"""`python -m strata_runtime COMMAND --plan plan.json ...`: the engine process.

The `strata` command (strata_cfg) resolves a profile into a plan and starts this module as a process, so the
runtime only ever sees a resolved `LaunchPlan`. Each command lives in `strata_runtime.commands.<name>` and
exposes ``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "generate": "one request from a plan, printed as text or JSON",
    "chat": "a conversation with the model in the terminal, a line a message",
    "bench": "benchmark workloads over resolved arm plans",
    "serve": "the OpenAI-compatible HTTP server",
    "gguf": "the plan's model written as a GGUF file for llama.cpp",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(f"usage: python -m strata_runtime {{{names}}} --plan plan.json ...", file=sys.stderr)
        return 2
    name = argv[0]
    module = importlib.import_module(f"strata_runtime.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"python -m strata_runtime {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv[1:])))


if __name__ == "__main__":
    sys.exit(main())
