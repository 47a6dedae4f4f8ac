"""Device memory the engine really holds against the plan's budget, after load and after a full request.

Usage: ``python scripts/bench_vram.py PROFILE [KEY=VALUE ...]`` (``--set`` overrides; needs CuPy and a GPU).
Prints JSON: the plan's budget for the first GPU, the memory in use after load and after one request whose
prompt fills the context, and each against the plan (everything but ``free`` and ``reserve``).
"""

import json
import sys

import cupy as cp

from strata_cfg.pipeline import resolve_path
from strata_runtime.api import Request
from strata_runtime.engine import Engine

plan = resolve_path(sys.argv[1], sys.argv[2:]).plan
free0, total = cp.cuda.runtime.memGetInfo()
eng = Engine(plan)
cp.cuda.Device().synchronize()
free1, _ = cp.cuda.runtime.memGetInfo()
pool = cp.get_default_memory_pool()
g = plan.gpus[0].budget
planned_use = g.total - g.free - g.reserve
after_load = free0 - free1
ctx = plan.memory.context
h = eng.submit(Request(tuple([65 + (i % 26) for i in range(ctx - 40)]), 32))
while eng.step():
    pass
cp.cuda.Device().synchronize()
free2, _ = cp.cuda.runtime.memGetInfo()
peak = free0 - free2
def mib(b):
    return round(b / 2**20, 1)
print(
    json.dumps(
        {
            "planned_mib": {k: v for k, v in plan.gpus[0].budget_mib.items()},
            "planned_in_use_mib": mib(planned_use),
            "after_load_mib": mib(after_load),
            "after_full_context_request_mib": mib(peak),
            "pool_total_mib": mib(pool.total_bytes()),
            "load_vs_plan": round(after_load / planned_use - 1, 4),
            "full_context_vs_plan": round(peak / planned_use - 1, 4),
            "context": ctx,
        },
        indent=1,
    )
)
