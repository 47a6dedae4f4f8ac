"""How long `strata tui` takes to open, as a user sees it: from starting the process in a terminal to the
first screen with a resolved plan on it.

Each repeat starts ``strata tui DIR`` in a fresh 80x24 pseudo-terminal, reads what it draws, and stops the
clock when the status line says the profile ``resolves`` (drawn only after the first resolution has been
shown); then it presses Ctrl+Q. `strata plan` on the same profile is timed in the same run, interleaved, as
the reference for what any strata command costs to start on this machine.

    python scripts/bench_tui_startup.py [DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

MARKER = b"resolves"
ANSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[PX^_][^\x1b]*\x1b\\|.)")


def time_tui(directory: str, timeout: float = 30.0) -> float:
    """Seconds from fork to the first screen that shows the resolved plan."""
    started = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: an 80x24 terminal, then strata
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        os.environ["TERM"] = "xterm-256color"
        os.execv(sys.executable, [sys.executable, "-m", "strata_cfg", "tui", directory])
    seen = b""
    ready: float | None = None
    try:
        while ready is None:
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"no resolved screen after {timeout} s; the screen said: {seen[-400:]!r}")
            r, _, _ = select.select([fd], [], [], 0.5)
            if not r:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                raise RuntimeError(f"strata tui exited early: {seen[-400:]!r}") from None
            seen += chunk
            if MARKER in ANSI.sub(b"", seen):
                ready = time.perf_counter() - started
        os.write(fd, b"\x11")  # Ctrl+Q
        _wait_exit(pid, fd)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running: it did not quit
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        os.close(fd)
    return ready


def _wait_exit(pid: int, fd: int, timeout: float = 10.0) -> None:
    """Wait for the app to quit, draining what it draws meanwhile (a full pty would block it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        if select.select([fd], [], [], 0.1)[0]:
            with contextlib.suppress(OSError):
                os.read(fd, 65536)


def time_plan(profile: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "strata_cfg", "plan", profile], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="profiles")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    first = sorted(Path(args.directory).glob("*.toml"))[0]
    tui, plan = [], []
    time_tui(args.directory)  # warm the file cache once, as a user's second start would be
    for _ in range(args.repeats):
        tui.append(time_tui(args.directory))
        plan.append(time_plan(str(first)))
    med_tui, med_plan = statistics.median(tui), statistics.median(plan)
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, 1-minute load average {load:.1f} at the end of the run")
    print(
        f"strata tui {args.directory}: first resolved screen after median {med_tui * 1000:.0f} ms "
        f"(min {min(tui) * 1000:.0f}, max {max(tui) * 1000:.0f}, {args.repeats} starts)"
    )
    print(
        f"strata plan {first}: median {med_plan * 1000:.0f} ms (min {min(plan) * 1000:.0f}, "
        f"max {max(plan) * 1000:.0f})"
    )
    print(f"ratio tui / plan: {med_tui / med_plan:.2f}")


if __name__ == "__main__":
    main()
