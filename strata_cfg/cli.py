"""The `strata` command: one subcommand per module, imported only when chosen.

Each subcommand is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``. It is registered
here by name with its module path and a one-line help. Only the chosen command's module is imported, so
``strata plan`` does not pay for the TUI, the server or the engine.

Exit codes shared by every command: 0 success, 1 a profile was refused (or the command failed),
2 usage error (bad arguments). Output into a pipe that closes early (``strata plan --json | head -1``)
ends the command quietly with 141, as a command killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, Protocol, cast

from . import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("strata_cfg.commands.check", "validate and resolve profiles, reporting every problem"),
    "plan": ("strata_cfg.commands.plan", "show what a profile resolves to: stages, batch, VRAM, decisions"),
    "explain": (
        "strata_cfg.commands.explain",
        "one resolved key: its value, where it came from, which rules",
    ),
    "diff": ("strata_cfg.commands.diff", "what changes in the plan between two profiles or with --set"),
    "rules": ("strata_cfg.commands.rules", "list every resolution rule with its id and severity"),
    "schema": ("strata_cfg.commands.schema", "print the profile JSON Schema (for editors)"),
    "serve": ("strata_cfg.commands.serve", "run the engine's HTTP server from a plan file, unsupervised"),
    "stop": ("strata_cfg.commands.stop", "stop an engine started by `strata launch` (default: the latest)"),
    "status": ("strata_cfg.commands.status", "what the engines `strata launch` started are doing"),
    "logs": ("strata_cfg.commands.logs", "a launch's engine log: its last lines, or followed with -f"),
    "launch": ("strata_cfg.commands.launch", "start a profile's engine, wait until it serves, supervise it"),
    "loadtest": ("strata_cfg.commands.loadtest", "N clients for T seconds against a running engine"),
    "generate": ("strata_cfg.commands.generate", "one request through the engine: text, or JSON with --json"),
    "chat": ("strata_cfg.commands.chat", "talk to the model in the terminal, a line a message"),
    "gguf": ("strata_cfg.commands.gguf", "write a profile's model as a GGUF file for llama.cpp"),
    "bench": (
        "strata_cfg.commands.bench",
        "benchmark arms of a profile on a named workload (docs/PERFORMANCE.md)",
    ),
    "tui": ("strata_cfg.commands.tui", "edit profiles and watch the resolved plan change as you type"),
}
"""Subcommand name -> (module path, one-line help). Other parts of strata add their commands here."""

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_PIPE_CLOSED = 128 + 13
"""What a shell reports for a command that SIGPIPE ended (128 + the signal's number)."""


class Command(Protocol):
    """What a subcommand module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        f"usage: strata {{{','.join(COMMANDS)}}} ...",
        "",
        "Declarative hardware profiles for the strata MoE engine.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()),
        "",
        "Run `strata COMMAND --help` for a command's options. Exit codes: 0 ok, 1 refused, 2 usage.",
    ]
    return "\n".join(lines)


def build_parser(name: str) -> tuple[argparse.ArgumentParser, Command]:
    """Import command ``name`` and build its parser."""
    module_path, help_ = COMMANDS[name]
    module = cast(Command, importlib.import_module(module_path))
    parser = argparse.ArgumentParser(prog=f"strata {name}", description=help_)
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``strata`` with ``argv`` (default: the process arguments) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return EXIT_OK if args else EXIT_USAGE
    if args[0] == "--version":
        print(f"strata {__version__}")
        return EXIT_OK
    name = args[0]
    if name not in COMMANDS:
        print(_usage(), file=sys.stderr)
        print(f"\nstrata: unknown command {name!r}", file=sys.stderr)
        return EXIT_USAGE
    parser, module = build_parser(name)
    try:
        parsed = parser.parse_args(args[1:])
    except SystemExit as exc:  # argparse exits 0 for --help and 2 for usage errors
        return int(exc.code or 0)
    return int(module.run(parsed))


def entry() -> NoReturn:
    """The ``strata`` console command: `main`, and a reader that closed the pipe ends it quietly.

    SIGPIPE is not reset to its default, which would kill the serving commands on any closed socket;
    instead stdout's BrokenPipeError is caught here, and stdout is pointed at /dev/null so that the
    interpreter's last flush does not fail a second time.
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_PIPE_CLOSED)
    sys.exit(code)


if __name__ == "__main__":
    entry()
