"""Start the engine of a resolved plan as a process, wait until it is ready, and keep it running.

A run directory holds everything about one launch: ``plan.json`` (what runs), ``engine.log`` (the engine's
output, appended across restarts), ``launch.pid`` (the supervisor, while it runs), ``engine.pid`` (the current
engine process) and, for a detached launch, ``launch.log`` (the supervisor's own output).

The engine runs in its own process group, so stopping it reaches every process it started, and on Linux
it is also told to stop when the supervisor dies, so no engine is ever left without its supervisor. The
supervisor restarts an engine that exits on its own, with exponential backoff and a limit, and says why
each time.

This module never imports strata_runtime: the engine is started as ``python -m strata_runtime serve``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from ..schema.plan import LaunchPlan, ServePlan
from ..schema.plan_file import PLAN_FILE, read_plan
from ..schema.profile import is_loopback

ENGINE_LOG = "engine.log"
LAUNCH_LOG = "launch.log"
LAUNCH_PID = "launch.pid"
ENGINE_PID = "engine.pid"
RUNS_ROOT = Path("runs")
"""Where run directories go by default, relative to the working directory."""

Say = Callable[[str], None]
ReadyOutcome = Literal["ready", "died", "timeout", "stopped"]


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

    def argv(self) -> list[str]:
        """These options as ``strata launch`` flags (for the detached supervisor)."""
        return [
            f"--max-restarts={self.max_restarts}",
            f"--grace={self.grace_s}",
            f"--start-timeout={self.start_timeout_s}",
        ]


# ---- the run directory -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def engine_log(self) -> Path:
        return self.path / ENGINE_LOG

    @property
    def launch_log(self) -> Path:
        return self.path / LAUNCH_LOG

    @property
    def launch_pid(self) -> Path:
        return self.path / LAUNCH_PID

    @property
    def engine_pid(self) -> Path:
        return self.path / ENGINE_PID

    def load_plan(self) -> LaunchPlan:
        return read_plan(self.plan)


def new_run_dir(profile: str, root: Path = RUNS_ROOT, now: float | None = None) -> Path:
    """``root/<profile>-<YYYYmmdd-HHMMSS>``, with a suffix when that already exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = root / f"{_safe(profile)}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "profile"


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive; /proc tells, where there is one.
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    return True


def live_supervisor(run: RunDir) -> int | None:
    """The pid of the supervisor of ``run`` when it is still running, else None."""
    pid = read_pid(run.launch_pid)
    if pid is None or not pid_alive(pid):
        return None
    with contextlib.suppress(OSError):  # a recycled pid that is no strata process is not ours
        if b"strata" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
    return pid


# ---- checks before starting ------------------------------------------------------------------------------


def probe_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def base_url(serve: ServePlan) -> str:
    host = probe_host(serve.host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{serve.port}"


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served on, or None when it is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # The server binds with SO_REUSEADDR too, so only a real listener counts as busy, not TIME_WAIT.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use; stop what listens there or set serve.port"
            return f"cannot bind {host}:{port}: {exc.strerror}; check serve.host"
    return None


def preflight(plan: LaunchPlan, env: dict[str, str] | None = None) -> list[str]:
    """Everything that would stop the engine from starting, each as one sentence."""
    env = dict(os.environ) if env is None else env
    if plan.serve is None:
        return [
            f"profile `{plan.profile}` has no [serve] table, so it does not serve; add `[serve]` to launch it"
        ]
    problems = []
    if plan.model.path is not None and not Path(plan.model.path).is_dir():
        problems.append(f"the model directory {plan.model.path} does not exist (model.path)")
    name = plan.serve.api_key_env
    if name is not None and not env.get(name):
        problems.append(f"serve.api_key_env names ${name}, but it is not set in the environment")
    busy = port_problem(plan.serve.host, plan.serve.port)
    if busy:
        problems.append(busy)
    return problems


# ---- describing the plan ---------------------------------------------------------------------------------


def summary(plan: LaunchPlan) -> list[str]:
    """A few lines: model, stages, batching, context, address."""
    model = plan.model.path or f"synthetic `{plan.model.synthetic}` (seed {plan.model.seed})"
    lines = [f"profile {plan.profile}: {model}, {plan.model.facts.num_hidden_layers} layers"]
    for st in plan.stages:
        extra = f" + {', '.join(st.holds)}" if st.holds else ""
        lines.append(f"  stage {st.index} on {st.device}: layers {st.layers[0]}-{st.layers[1] - 1}{extra}")
    b = plan.batch
    mtp = "on" if b.mtp else "off"
    lines.append(f"  batch: {b.slots} slot(s), {b.groups} group(s), {b.mode}, batch MTP {mtp}")
    lines.append(
        f"  spec: {plan.spec.draft_tokens} draft tokens; context {plan.memory.context} tokens per slot"
    )
    if plan.serve is not None:
        key = f", API key from ${plan.serve.api_key_env}" if plan.serve.api_key_env else ", no API key"
        bind = "" if is_loopback(plan.serve.host) else f" (listening on {plan.serve.host}:{plan.serve.port})"
        lines.append(f"  serve: {base_url(plan.serve)}/v1{bind} as model `{plan.serve.model_name}`{key}")
    return lines


def notices(plan: LaunchPlan) -> list[str]:
    """What a user must see before launching: anything they asked for that a rule changed, and warnings."""
    out = []
    for d in plan.decisions:
        if d.requested and d.severity in ("off", "clamp", "error"):
            where = f" (asked at {d.origin})" if d.origin else ""
            out.append(f"  {d.severity.upper()} {d.key}: {d.message}{where} [{d.rule}]")
        elif d.severity == "warn":  # e.g. a non-loopback serve.host without an API key
            out.append(f"  WARN {d.key}: {d.message} [{d.rule}]")
    return out


def client_snippet(plan: LaunchPlan) -> list[str]:
    """How to call the engine: curl and the OpenAI Python client."""
    assert plan.serve is not None
    url = base_url(plan.serve)
    env = plan.serve.api_key_env
    auth = f' -H "Authorization: Bearer ${env}"' if env else ""
    body = json.dumps(
        {"model": plan.serve.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}
    )
    key = f'os.environ["{env}"]' if env else '"none"'
    return [
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"       -d '{body}'",
        f'  python: OpenAI(base_url="{url}/v1", api_key={key})',
    ]


# ---- the engine process ----------------------------------------------------------------------------------


def engine_command(plan_file: Path) -> list[str]:
    return [sys.executable, "-m", "strata_runtime", "serve", "--plan", str(plan_file)]


def _die_with(parent: int) -> Callable[[], None]:
    """A preexec hook: the child gets SIGTERM when ``parent`` dies (Linux), so it is never orphaned."""

    def hook() -> None:
        if sys.platform.startswith("linux"):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the hook ran
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def log_tail(path: Path, start: int = 0, lines: int = 15) -> list[str]:
    """The last ``lines`` lines of ``path`` written after byte offset ``start``."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def health(url: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]] | None:
    """(status, JSON body) of ``url/health``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body
    except (OSError, ValueError):
        return None


def wait_ready(
    url: str, *, running: Callable[[], bool], stopping: Callable[[], bool], options: LaunchOptions, say: Say
) -> ReadyOutcome:
    """Poll ``url/health`` until 200, showing the loading progress; stop early when the process dies."""
    deadline = time.monotonic() + options.start_timeout_s
    shown = ""
    while True:
        if stopping():
            return "stopped"
        if not running():
            return "died"
        answer = health(url, timeout=1.0)
        if answer is not None and answer[0] == 200:
            return "ready"
        if answer is not None:
            body = answer[1]
            frac = body.get("fraction")
            progress = f"{body.get('status', '?')}: {body.get('progress', '')}"
            if isinstance(frac, int | float):
                progress += f" ({frac:.0%})"
            if progress != shown:
                say(f"  {progress}")
                shown = progress
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(options.poll_s)


class Supervisor:
    """Runs one engine process for a run directory, restarting it when it exits on its own."""

    def __init__(self, run: RunDir, plan: LaunchPlan, options: LaunchOptions, say: Say = print) -> None:
        assert plan.serve is not None
        self.run_dir = run
        self.plan = plan
        self.options = options
        self.say = say
        self.url = base_url(plan.serve)
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
        cmd = engine_command(self.run_dir.plan)
        with self.run_dir.engine_log.open("ab") as log:
            self._log_offset = log.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"--- strata launch: engine start {self.starts} at {stamp}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one signal reaches all of it
                preexec_fn=_die_with(os.getpid()),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.run_dir.engine_pid.write_text(f"{self.proc.pid}\n")
        return self.proc

    def wait_ready(self, proc: subprocess.Popen[bytes]) -> ReadyOutcome:
        return wait_ready(
            self.url,
            running=lambda: proc.poll() is None,
            stopping=lambda: self.stopping,
            options=self.options,
            say=self.say,
        )

    def wait_exit(self, proc: subprocess.Popen[bytes]) -> int | None:
        """Wait for the engine to exit; None when the supervisor was asked to stop first."""
        while not self.stopping:
            try:
                return proc.wait(timeout=self.options.poll_s)
            except subprocess.TimeoutExpired:
                continue
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
        self.say("the engine failed to start")
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


# ---- detached supervisors --------------------------------------------------------------------------------


def spawn_detached(run: RunDir, options: LaunchOptions) -> subprocess.Popen[bytes]:
    """Start ``strata launch --supervise RUN_DIR`` in its own session, its output in ``launch.log``."""
    cmd = [sys.executable, "-m", "strata_cfg", "launch", "--supervise", str(run.path), *options.argv()]
    with run.launch_log.open("ab") as log:
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


def find_runs(root: Path = RUNS_ROOT) -> list[RunDir]:
    """Run directories under ``root``, most recent first."""
    if not root.is_dir():
        return []
    runs = [RunDir(p) for p in root.iterdir() if (p / PLAN_FILE).is_file()]
    return sorted(runs, key=lambda r: r.plan.stat().st_mtime, reverse=True)


def run_profile_name(run: RunDir) -> str | None:
    try:
        return str(json.loads(run.plan.read_text())["profile"])
    except (OSError, ValueError, KeyError):
        return None
