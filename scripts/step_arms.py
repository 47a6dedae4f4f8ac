"""Time the whole decode step with other decode kernels, in one process on one model: each arm's decode
attention, its split of a row, and what the expert kernels bring into L2.

    python scripts/step_arms.py PROFILE [--set KEY=VALUE ...] [--positions 64,150,300] [--rows 1,2]
        [--rounds 2] [--repeats 30] [--in-step] [--json] ARM [ARM ...]

Each ARM is NAME=SPEC, SPEC one of ``cuda_cores`` (attn_split), ``tc`` (attn_tc, each row split as the
engine splits it) or ``tc:ONE_RUN_CHUNKS/SHORT_SPLITS/SHORT_CHUNKS/SPLITS``
(`strata_runtime.cuda.choices.AttentionSplit`; fields left out keep the engine's), then optionally
``,warm:ROWS``, ``,warm:ROWS/early`` or ``,warm:off``: how the expert kernels bring the next layer's q/k/v
weights into L2 (`strata_runtime.cuda.choices.L2Warm`; left out, the engine's). For example
``kept=tc one=tc:128 split=cuda_cores warm=tc,warm:2``. At every position and row count the step graph
runs with each arm in turn, ``--rounds`` rounds on the same weights and window (`KernelModel.time_arms`,
as ``strata bench --workload step --vary model.decode_attention=auto,cuda_cores`` times the plans'
kernels, without splits or several positions); the table gives each arm's median ms with its change from
the first arm, and whether every arm chose the same argmax tokens; with ``--in-step``, also what each
kernel group costs inside the step in every arm (`KernelModel.time_in_step`), so that an arm's effect
shows in the group it changes. Needs CuPy and a GPU. docs/PERFORMANCE.md's tables of attention splits
measure the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from strata_cfg.plan.from_profile import resolve_profile
from strata_cfg.schema.errors import ProfileError
from strata_runtime.backend import Device
from strata_runtime.bench.step import KernelArm, KernelModel, graph_seconds, step_routing
from strata_runtime.cuda.choices import AttentionSplit, L2Warm
from strata_runtime.cuda.ops import kernels_for


@dataclass(frozen=True)
class Arm:
    name: str
    tensor_cores: bool = True
    split: AttentionSplit | None = None  # None: the engine's
    warm: L2Warm | None = None  # None: the engine's

    @classmethod
    def parse(cls, text: str) -> Arm:
        name, eq, spec = text.partition("=")
        if not eq or not name or not spec:
            raise ValueError(f"arm {text!r}: expected NAME=SPEC, as one=tc:3/16/128/64 or split=cuda_cores")
        spec, comma, extra = spec.partition(",")
        warm = None
        if comma:
            if not extra.startswith("warm:"):
                raise ValueError(f"arm {text!r}: after the comma, expected warm:ROWS, not {extra!r}")
            warm = L2Warm.parse(extra[5:])
        if spec == "cuda_cores":
            return cls(name, False, None, warm)
        if spec == "tc":
            return cls(name, True, None, warm)
        if spec.startswith("tc:"):
            return cls(name, True, AttentionSplit.parse(spec[3:]), warm)
        raise ValueError(
            f"arm {text!r}: SPEC is cuda_cores, tc or tc:ONE_RUN_CHUNKS/SHORT_SPLITS/..., not {spec!r}"
        )

    def describe(self) -> str:
        """The arm's kernels in words."""
        split = self.split or AttentionSplit()
        out = f"tensor cores, split {split}" if self.tensor_cores else "CUDA cores"
        return out + (f", L2 warming {self.warm}" if self.warm is not None else "")

    def context(self, model: KernelModel) -> contextlib.AbstractContextManager[None]:
        """This arm's kernels in force on ``model`` inside the block."""
        return model.arm(KernelArm(self.tensor_cores, self.split, self.warm))


def sweep(
    model: KernelModel,
    arms: Sequence[Arm],
    positions: Sequence[int],
    rows: Sequence[int],
    repeats: int,
    rounds: int,
    timer: Callable[[Any, Callable[[], None], int], float] = graph_seconds,
    in_step: bool = False,
) -> list[dict[str, Any]]:
    """One result per (position, row count): each arm's ms and argmax tokens; with ``in_step``, also what
    each kernel group costs inside the step in each arm (`KernelModel.time_in_step`, µs a layer), so that an
    arm's effect shows in the group it changes."""
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names repeat: {names}")
    contexts = {a.name: partial(a.context, model) for a in arms}
    out = []
    for position in positions:
        for r in rows:
            res = model.time_arms(r, position, repeats, contexts, timer=timer, rounds=rounds)
            if in_step:
                res["in_step"] = {}
                for a in arms:
                    with a.context(model):
                        res["in_step"][a.name] = model.time_in_step(r, position, repeats, timer, rounds)
            out.append({"position": position, **res})
    return out


def render(arms: Sequence[Arm], results: Sequence[Mapping[str, Any]]) -> str:
    """The sweep's table: each arm's ms and its change from the first, whether every arm chose the same
    argmax tokens, and with ``--in-step`` each arm's groups."""
    first = arms[0].name
    lines = ["arms: " + "; ".join(f"{a.name} = {a.describe()}" for a in arms)]
    head = f"{'position':>8} {'rows':>4}  " + "  ".join(f"{a.name:>16}" for a in arms) + "  same argmax"
    lines += [head, "-" * len(head)]
    for res in results:
        ms = res["ms"]
        cells = [f"{ms[first]:>13.3f} ms"]
        cells += [f"{ms[a.name]:>8.3f} ({(ms[a.name] / ms[first] - 1) * 100:+5.1f}%)" for a in arms[1:]]
        same = all(t == res["tokens"][first] for t in res["tokens"].values())
        lines.append(
            f"{res['position']:>8} {res['rows']:>4}  " + "  ".join(cells) + f"  {'yes' if same else 'NO'}"
        )
    for res in results:
        for name, groups in res.get("in_step", {}).items():
            if name == first:
                lines += ["", f"µs a layer inside the step, KV at {res['position']}, {res['rows']} row(s):"]
            lines.append(f"  {name}: " + ", ".join(f"{g} {us:.2f}" for g, us in groups.items()))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("arms", nargs="+", metavar="ARM", help="NAME=SPEC (see the module's docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a profile override")
    ap.add_argument("--positions", type=_ints, default=[64, 150, 300, 600, 1000])
    ap.add_argument("--rows", type=_ints, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30, help="graph replays a timing")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--in-step", action="store_true", help="also each kernel group's cost inside the step, in every arm"
    )
    args = ap.parse_args(argv)
    try:
        arms = [Arm.parse(a) for a in args.arms]
    except ValueError as e:
        ap.error(str(e))
    try:
        plan = resolve_profile(args.profile, args.set)
    except ProfileError as e:
        ap.error(str(e))
    context = plan.memory.context
    if max(args.positions) >= context:
        ap.error(f"a position of {max(args.positions)} does not fit memory.context = {context}")
    try:
        import cupy as cp
    except ImportError:
        print("step_arms: needs CuPy and a GPU", file=sys.stderr)
        return 2
    with cp.cuda.Device(args.device):
        model = KernelModel(
            cp,
            plan.model.facts,
            context,
            kernels_for(args.device),
            args.device,
            step_routing(plan, Device("cuda", args.device)),
        )
        results = sweep(
            model, arms, args.positions, args.rows, args.repeats, args.rounds, in_step=args.in_step
        )
    if args.json:
        print(
            json.dumps(
                {
                    "arms": [
                        a.__dict__ | {"split": str(a.split or ""), "warm": str(a.warm or "")} for a in arms
                    ],
                    "results": results,
                }
            )
        )
    else:
        print(render(arms, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
