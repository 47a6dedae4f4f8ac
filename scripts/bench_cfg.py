"""How fast the configuration side is: resolving a profile, and `strata plan` from a cold process.

    python scripts/bench_cfg.py [--repeats 15] [--inner 200]

* resolve: the pure `resolve()` on already loaded profiles and facts, per shipped profile: the median over
  ``--repeats`` batches of ``--inner`` calls. The TUI re-resolves on every keystroke, so this must stay far
  below 5 ms. The load (TOML + validation) and facts steps are timed the same way, for context.
* startup: ``python -m strata_cfg plan PROFILE`` as a fresh process against a bare ``python -c pass``,
  interleaved (A B A B ...), medians and their ratio, so the noise of a shared machine hits both arms alike.

Prints a Markdown table for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from strata_cfg.facts.gather import gather_facts  # noqa: E402
from strata_cfg.profile.load import LoadedProfile, load_profile, load_profile_text  # noqa: E402
from strata_cfg.resolve import resolve  # noqa: E402


def _auto(preset: str, vram_mib: int, speeds: list[int]) -> str:
    """A profile text with an auto split of ``preset`` over one GPU per speed."""
    gpus = ", ".join(
        f'{{ name = "g{i}", vram_mib = {vram_mib}, bandwidth_gbs = {bw} }}' for i, bw in enumerate(speeds)
    )
    tables = f'[model]\nsynthetic = "{preset}"\n[split]\nlayers = "auto"\n[batch]\nslots = 4\n'
    return f"[machine]\ngpus = [{gpus}]\n{tables}"


AUTO_CASES = {
    # The auto split's heaviest cases: many stages, many layers, mixed speeds.
    "auto 4x 16 GB qwen3-30b-a3b": _auto("qwen3-30b-a3b", 16376, [672] * 4),
    "auto 4x mixed qwen3-30b-a3b": _auto("qwen3-30b-a3b", 24576, [500, 900, 700, 1000]),
    "auto 8x 80 GB qwen3-235b-a22b": _auto("qwen3-235b-a22b", 81920, [2000] * 8),
    "auto 8x mixed qwen3-235b-a22b": _auto(
        "qwen3-235b-a22b", 81920, [2000, 3350, 2000, 1555, 2000, 3350, 2039, 2000]
    ),
}


def per_call_ms(fn: Callable[[], object], *, repeats: int, inner: int) -> float:
    """Median over ``repeats`` batches of the mean time of one call, in ms."""
    fn()  # warm caches (pydantic validators, imports)
    batches = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        batches.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(batches)


def bench_resolve(
    loaders: dict[str, Callable[[], LoadedProfile]], *, repeats: int, inner: int
) -> list[tuple[str, float, float, float]]:
    rows = []
    for name, load_one in loaders.items():
        loaded = load_one()
        machine, model = gather_facts(loaded)

        def one(loaded=loaded, machine=machine, model=model) -> object:
            return resolve(loaded.profile, machine, model, origins=loaded.origins, profile_file=loaded.path)

        def facts_one(loaded=loaded) -> object:
            return gather_facts(loaded)

        rows.append(
            (
                name,
                per_call_ms(load_one, repeats=repeats, inner=max(inner // 10, 5)),
                per_call_ms(facts_one, repeats=repeats, inner=inner),
                per_call_ms(one, repeats=repeats, inner=inner),
            )
        )
    return rows


def wall_ms(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return (time.perf_counter() - t) * 1e3


def bench_startup(profile: str, repeats: int) -> tuple[float, float]:
    plan = [sys.executable, "-m", "strata_cfg", "plan", profile]
    bare = [sys.executable, "-c", "pass"]
    wall_ms(plan)  # warm the file cache
    a, b = [], []
    for _ in range(repeats):
        a.append(wall_ms(plan))
        b.append(wall_ms(bare))
    return statistics.median(a), statistics.median(b)


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args()
    loaders: dict[str, Callable[[], LoadedProfile]] = {
        p.stem: partial(load_profile, p) for p in sorted((REPO / "profiles").glob("*.toml"))
    }
    loaders |= {name: partial(load_profile_text, text, f"{name}.toml") for name, text in AUTO_CASES.items()}

    print("| profile | load (TOML + validate) ms | facts ms | resolve ms |")
    print("| --- | ---: | ---: | ---: |")
    rows = bench_resolve(loaders, repeats=args.repeats, inner=args.inner)
    for name, load_ms, facts_ms, resolve_ms in rows:
        print(f"| {name} | {load_ms:.2f} | {facts_ms:.3f} | {resolve_ms:.3f} |")

    plan_ms, bare_ms = bench_startup("profiles/rtx3080-20g-x2.toml", args.repeats)
    print()
    print("| arm | median wall ms |")
    print("| --- | ---: |")
    print(f"| `python -m strata_cfg plan profiles/rtx3080-20g-x2.toml` | {plan_ms:.0f} |")
    print(f"| `python -c pass` | {bare_ms:.0f} |")
    print(f"| ratio | {plan_ms / bare_ms:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
