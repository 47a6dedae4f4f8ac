"""The supervisor: runs one engine process for a run directory, waits until it is ready, and keeps it
running, restarting an engine that exits on its own with exponential backoff and a limit, and saying why
each time.

The engine runs in its own process group, so stopping it reaches every process it started, and on Linux it
is also told to stop when the supervisor dies, so no engine is ever left without its supervisor. A detached
supervisor (``strata launch --detach``, the TUI) is ``strata launch --supervise RUN_DIR`` in its own session.

This package never imports strata_runtime: the engine is started as ``python -m strata_runtime serve``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType

from ..schema.plan import LaunchPlan
from .engine_process import die_with_parent, engine_command, exit_reason, log_tail
from .health import ReadyOutcome, Say, health, taken_message, wait_ready
from .options import LaunchOptions
from .preflight import base_url
from .run_dir import ENGINE_START_MARK, RunDir, live_supervisor, open_log, pid_alive, read_pid

SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""What systemd passes the process it runs: meant for the launcher, which is that process, not for its
engine (which would otherwise tell systemd it is ready, or take over its watchdog, as `strata serve` run by a
unit of its own does)."""


def engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment the supervisor starts an engine with: its own, without `SYSTEMD_VARS`."""
    return {k: v for k, v in env.items() if k not in SYSTEMD_VARS}


class Supervisor:
    """Runs one engine process for a run directory, restarting it when it exits on its own."""

    def __init__(self, run: RunDir, plan: LaunchPlan, options: LaunchOptions, say: Say = print) -> None:
        assert plan.serve is not None
        self.run_dir = run
        self.plan = plan
        self.options = options
        self.say = say
        self.url = base_url(plan.serve)
        self.engine_id = run.engine_id()
        """Every engine of this run answers ``/health`` with it; no other server's answer is "ready"."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.ready_s: float | None = None
        """Seconds the first start took to become ready."""
        self._log_offset = 0
        self._stop_signal: int | None = None

    # ---- signals -------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    @property
    def stopping(self) -> bool:
        return self._stop_signal is not None

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # ---- one engine ----------------------------------------------------------------------------------------

    def start(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        cmd = engine_command(self.run_dir.plan, self.engine_id)
        with open_log(self.run_dir.engine_log) as log:
            self._log_offset = log.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(ENGINE_START_MARK + f"{self.starts} at {stamp}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one signal reaches all of it
                preexec_fn=die_with_parent(os.getpid()),
                env={**engine_env(os.environ), "PYTHONUNBUFFERED": "1"},
            )
        self.run_dir.engine_pid.write_text(f"{self.proc.pid}\n")
        return self.proc

    def wait_ready(self, proc: subprocess.Popen[bytes]) -> ReadyOutcome:
        return wait_ready(
            self.url,
            engine_id=self.engine_id,
            running=lambda: proc.poll() is None,
            stopping=lambda: self.stopping,
            options=self.options,
            say=self.say,
        )

    def wait_exit(self, proc: subprocess.Popen[bytes]) -> int | None:
        """Wait for the ready engine to exit, asking its ``/health`` every `LaunchOptions.health_every_s`;
        None when the supervisor was asked to stop first. An engine that answers nothing for the
        liveness bound (`LaunchOptions.liveness`) is taken for hung: it is stopped, and its exit code
        returned as if it had exited."""
        assert self.plan.serve is not None
        bound = self.options.liveness(self.plan.serve.step_timeout_s)
        every = min(self.options.health_every_s, bound / 3)  # asked at least three times within the bound
        answered = asked = time.monotonic()
        while not self.stopping:
            try:
                return proc.wait(timeout=self.options.poll_s)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if not bound or now - asked < every:
                continue
            asked = now
            if health(self.url, timeout=min(2.0, every)) is not None:
                answered = time.monotonic()
            elif time.monotonic() - answered >= bound:
                self.say(
                    f"the engine has not answered {self.url}/health for {time.monotonic() - answered:.0f} s "
                    f"(the bound: {bound:g} s, --liveness-timeout); taking it for hung and stopping it"
                )
                return self.stop_engine(proc)
        return None

    def stop_engine(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM the engine's process group; SIGKILL it after the grace period. Returns the exit code."""
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.options.grace_s)
            except subprocess.TimeoutExpired:
                self.say(f"the engine did not stop within {self.options.grace_s:g} s; killing it")
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Anything the engine started and left in its group goes too.
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode

    def report_exit(self, code: int) -> None:
        self.say(f"the engine {exit_reason(code)}; last lines of {self.run_dir.engine_log}:")
        for line in log_tail(self.run_dir.engine_log, self._log_offset):
            self.say(f"  | {line}")

    # ---- the whole run -------------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """Start, wait until ready, supervise; return the exit code (0 after a requested stop)."""
        with self._signals(), self._pid_file():
            started = time.monotonic()
            proc = self.start()
            self.say(f"starting the engine (pid {proc.pid}), log in {self.run_dir.engine_log}")
            outcome = self.wait_ready(proc)
            if outcome != "ready":
                return self._failed_start(proc, outcome)
            self.ready_s = time.monotonic() - started
            if on_ready is not None:
                on_ready()
            return self._supervise(proc)

    def _failed_start(self, proc: subprocess.Popen[bytes], outcome: ReadyOutcome) -> int:
        if outcome == "stopped":
            return self._shutdown(proc)
        if outcome == "timeout":
            self.say(f"the engine was not ready after {self.options.start_timeout_s:g} s; stopping it")
            self.stop_engine(proc)
        self.report_exit(proc.wait())
        self.say(
            taken_message(self.url, self.engine_id) if outcome == "taken" else "the engine failed to start"
        )
        return 1

    def _supervise(self, proc: subprocess.Popen[bytes]) -> int:
        restarts = 0
        backoff = self.options.backoff_s
        up_since = time.monotonic()
        while True:
            code = self.wait_exit(proc)
            if code is None:
                return self._shutdown(proc)
            self.report_exit(code)
            if time.monotonic() - up_since > self.options.stable_s:
                restarts, backoff = 0, self.options.backoff_s
            if restarts >= self.options.max_restarts:
                self.say(f"giving up: the engine stopped {restarts + 1} times in a row")
                return 1
            restarts += 1
            self.say(
                f"restarting in {backoff:g} s (restart {restarts} of at most {self.options.max_restarts})"
            )
            if self._sleep(backoff):
                return self._shutdown(None)
            backoff = min(backoff * 2, self.options.backoff_max_s)
            proc = self.start()
            up_since = time.monotonic()
            outcome = self.wait_ready(proc)
            if outcome == "stopped":
                return self._shutdown(proc)
            if outcome == "ready":
                self.say(f"the engine is ready again at {self.url}/v1 (pid {proc.pid})")
            elif outcome == "timeout":
                self.say(f"the engine was not ready after {self.options.start_timeout_s:g} s; stopping it")
                self.stop_engine(proc)
            elif outcome == "taken":  # restarting cannot help while another server holds the port
                self.report_exit(proc.wait())
                self.say(f"giving up: {taken_message(self.url, self.engine_id)}")
                return 1
            # "died" (or a timeout) goes round again and is reported as the next exit.

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True when asked to stop."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stopping:
                return True
            time.sleep(min(self.options.poll_s, deadline - time.monotonic()))
        return self.stopping

    def _shutdown(self, proc: subprocess.Popen[bytes] | None) -> int:
        name = signal.Signals(self._stop_signal).name if self._stop_signal else "a stop request"
        self.say(f"{name}: stopping the engine")
        if proc is not None:
            code = self.stop_engine(proc)
            how = "cleanly" if code == 0 else exit_reason(code)
            self.say(f"the engine stopped {how}")
        return 0

    @contextlib.contextmanager
    def _pid_file(self) -> Iterator[None]:
        self.run_dir.launch_pid.write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            # The engine is stopped by now; the pid files say nothing true any more.
            with contextlib.suppress(OSError):
                self.run_dir.engine_pid.unlink()
            if read_pid(self.run_dir.launch_pid) == os.getpid():
                self.run_dir.launch_pid.unlink()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def spawn_detached(run: RunDir, options: LaunchOptions) -> subprocess.Popen[bytes]:
    """Start ``strata launch --supervise RUN_DIR`` in its own session, its output in ``launch.log``."""
    cmd = [sys.executable, "-m", "strata_cfg", "launch", "--supervise", str(run.path), *options.argv()]
    with open_log(run.launch_log) as log:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_run(run: RunDir, grace_s: float, say: Say = print) -> bool:
    """SIGTERM the supervisor of ``run`` and wait for it; force it (and its engine) after ``grace_s``."""
    pid = live_supervisor(run)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        say(f"the supervisor (pid {pid}) did not stop within {grace_s:g} s; killing it and its engine")
        engine = read_pid(run.engine_pid)
        if engine is not None:
            _signal_group(engine, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True
