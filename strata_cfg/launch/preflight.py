"""Checks before an engine starts, each refusal one sentence: a plan that does not serve, a missing model
directory, an unset API key variable, a busy port. Also the address a client uses to reach the engine."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from ..schema.plan import LaunchPlan, ServePlan


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
