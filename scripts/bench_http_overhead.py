"""What the HTTP server costs: one engine, measured in process and through the server, interleaved.

One `Engine` is built from the profile. Each repeat runs the ``two-decodes`` workload (docs/PERFORMANCE.md)
twice on it: once stepped in this process by the benchmark harness (``in-process``), and once through the
OpenAI-compatible server on loopback (``http``), driven by ``strata bench --url`` in a separate process, as
real clients are, so that the clients do not compete with the engine for this process's interpreter. The
server is started around the same engine object for each run and stopped after it, so the two arms never
step the engine at the same time. Both arms send the same greedy requests. Medians over the repeats and the
ratio http / in-process are printed.

    python scripts/bench_http_overhead.py profiles/h200.toml --repeats 5 --tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from strata_cfg.plan.from_profile import resolve_profile
from strata_runtime.bench.harness import InProcessDriver, measure, workload_arrivals
from strata_runtime.engine import Engine
from strata_runtime.server import ServeOptions, Server


def in_process(engine: Engine, tokens: int, context: int) -> float:
    arrivals = workload_arrivals("two-decodes", engine.tokenizer, tokens, context)
    t0 = time.perf_counter()
    results, stats = InProcessDriver(engine).run(arrivals)
    return measure("two-decodes", results, stats, time.perf_counter() - t0)["tok_s"]


def over_http(engine: Engine, plan: Any, tokens: int) -> float:
    server = Server(plan, lambda progress: engine, ServeOptions("127.0.0.1", 0, "bench", None))
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(stop)))
    thread.start()
    while server.engine is None or server.engine.state != "ready":
        time.sleep(0.01)
    try:
        url = f"http://127.0.0.1:{server.port}"
        args = ["bench", "--url", url, "--workload", "two-decodes", "--repeats", "1", "--tokens", str(tokens)]
        out = subprocess.run(
            [sys.executable, "-m", "strata_cfg", *args, "--json"], capture_output=True, text=True, check=True
        )
        return float(json.loads(out.stdout)["cases"]["two-decodes"]["median"]["tok_s"])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    plan = resolve_profile(args.profile, args.sets)
    engine = Engine(plan)
    in_process(engine, 32, plan.memory.context)  # warm-up: the first windows of each shape
    over_http(engine, plan, 32)
    arms: dict[str, list[float]] = {"in-process": [], "http": []}
    for r in range(args.repeats):
        arms["in-process"].append(in_process(engine, args.tokens, plan.memory.context))
        arms["http"].append(over_http(engine, plan, args.tokens))
        a, b = arms["in-process"][-1], arms["http"][-1]
        print(f"repeat {r + 1}: in-process {a:.1f} tok/s, http {b:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in arms.items()}
    ratio = med["http"] / med["in-process"]
    print(f"two-decodes, {args.tokens} tokens, medians of {args.repeats} interleaved repeats:")
    print(f"  in-process {med['in-process']:.1f} tok/s, http {med['http']:.1f} tok/s, ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
