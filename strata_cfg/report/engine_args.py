"""The Strata C++ engine's command line equivalent to a plan (`strata plan --emit engine-args`), every
value resolved (no ``auto``).

That engine is the reference this project models, and ``strata-engine`` is its program: this package does
not install it. The line is for people who run that engine; our own engine (`strata_runtime`) reads
``plan.json`` instead of flags.
"""

from __future__ import annotations

import shlex

from ..schema.plan import LaunchPlan

ENGINE = "strata-engine"
"""The Strata C++ engine's command (not installed by this package), for ``--emit engine-args``."""


def engine_args(plan: LaunchPlan) -> list[str]:
    """The Strata engine command line equivalent to the plan, with every value resolved (no ``auto``)."""
    args = [ENGINE, "--model", plan.model.path or f"synthetic:{plan.model.synthetic}"]
    if len(plan.stages) > 1:
        args += ["--layer-split", ",".join(str(s.layers[0]) for s in plan.stages[1:])]
        args += ["--split-device", ",".join(str(s.gpu) for s in plan.stages)]
    b = plan.batch
    args += ["--batch", str(b.slots), "--batch-groups", str(b.groups)]
    if b.mtp:
        args.append("--batch-mtp")
    args += ["--spec", str(plan.spec.draft_tokens)]
    m = plan.memory
    reserve = str(m.vram_reserve_mib)
    if m.vram_reserve_later_mib != m.vram_reserve_mib:
        reserve += f",{m.vram_reserve_later_mib}"
    args += ["--vram-reserve-mib", reserve, "--max-context", str(m.context), "--kv", m.kv_dtype]
    e = plan.experts
    if e.cache is not None:
        args += ["--expert-cache", str(e.cache)]
    for i, d in enumerate(e.helper_devices, start=1):
        args += [f"--expert-cache-device{i}", str(d)]
    if e.remote_opt:
        args.append("--remote-expert-opt")
    if plan.spec.pipeline_windows:
        args += ["--pipeline-windows", str(plan.spec.pipeline_windows)]
    if e.peer_device is not None:
        args += ["--peer-device", str(e.peer_device)]
    if plan.serve:
        args += ["--serve", "--host", plan.serve.host, "--port", str(plan.serve.port)]
    return args


def engine_args_text(plan: LaunchPlan) -> str:
    """The command line; a plan that runs batch MTP inside pipelined groups gets a comment line first,
    since the C++ engine refuses ``--batch-mtp`` with more than one group, and so does one whose solo path
    drafts by n-gram lookup, which no flag of the line says."""
    note = (
        "# batch.mtp_in_groups: the Strata C++ engine refuses --batch-mtp with --batch-groups > 1; "
        "strata_runtime runs it\n"
        if plan.batch.mtp_in_groups
        else ""
    )
    if plan.spec.ngram:
        note += (
            '# spec.method = "ngram": no flag of this line asks for n-gram lookup (--spec is the window); '
            "strata_runtime drafts by it\n"
        )
    return note + shlex.join(engine_args(plan)) + "\n"
