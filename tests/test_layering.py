"""The layering DESIGN.md requires, checked by importing each package in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numpy", "cupy", "textual", "strata_runtime")


def loaded_modules(*imports: str) -> set[str]:
    code = (
        "import sys, json\n"
        + "".join(f"import {m}\n" for m in imports)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _offenders(modules: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in banned)


@pytest.mark.parametrize(
    "imports",
    [
        ("strata_cfg",),
        ("strata_cfg.schema",),
        ("strata_cfg.resolve",),
        ("strata_cfg.cli",),
        ("strata_cfg.load", "strata_cfg.facts_io", "strata_cfg.pipeline", "strata_cfg.runner"),
    ],
)
def test_config_side_loads_no_array_library_tui_or_runtime(imports):
    assert _offenders(loaded_modules(*imports), HEAVY) == []


def test_schema_and_resolver_import_only_pydantic_and_the_stdlib():
    modules = loaded_modules("strata_cfg.schema", "strata_cfg.resolve")
    stdlib = set(sys.stdlib_module_names)
    allowed = {
        "strata_cfg",
        "pydantic",
        "pydantic_core",
        "typing_extensions",
        "annotated_types",
        "typing_inspection",
    }
    foreign = sorted(m for m in modules if m.split(".")[0] not in stdlib | allowed and not m.startswith("_"))
    assert foreign == []
    # No I/O modules of our own: the loader, facts and runner stay out of the pure core.
    ours = {m for m in modules if m.startswith("strata_cfg.")}
    assert not ours & {"strata_cfg.load", "strata_cfg.facts_io", "strata_cfg.pipeline", "strata_cfg.runner"}


def test_strata_plan_imports_only_its_own_command():
    code = (
        "import sys, io, contextlib\nfrom strata_cfg import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()): cli.main(['plan'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('strata_cfg.commands.') and '._' not in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['strata_cfg.commands.plan']"


# ---- strata_runtime --------------------------------------------------------------------------------------
# The runtime executes a resolved plan and knows nothing else of strata_cfg: it may import only the modules
# below, each for the reason given. Imports are read from the source (inside functions too), and checked
# again in a fresh interpreter.

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

RUNTIME_MAY_IMPORT_FROM_CFG = {
    "strata_cfg.schema.plan": "the launch plan: the one contract the runtime executes",
    "strata_cfg.schema.facts": "ModelFacts, the model's shapes as the plan carries them (bench arithmetic)",
    "strata_cfg.schema.windows": "the window row layout and its limits, one rule for resolver and engine",
    "strata_cfg.schema.plan_file": "the one reader of plan.json",
    "strata_cfg.schema.safetensors_header": "the one reader of a checkpoint file's header",
    "strata_cfg.schema.presets": "a synthetic model's config.json: the preset table defines the model",
    "strata_cfg.schema.workloads": "the bench workloads, shared with the HTTP bench driver",
}
"""Every strata_cfg module the runtime imports, and why."""
ONLY_FROM = {
    "strata_cfg.schema.presets": ("strata_runtime.weights.synthetic", "strata_runtime.bench.peer"),
    "strata_cfg.schema.workloads": ("strata_runtime.bench.", "strata_runtime.commands.bench"),
}
"""The two that are not the plan's own contract, and the only runtime modules that may import them."""


def package_modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def runtime_modules() -> dict[str, Path]:
    return package_modules("strata_runtime")


def imports_of(module: str, path: Path, modules: set[str]) -> list[tuple[str, ast.stmt]]:
    """Every dotted name an import statement of ``module`` reaches, at any depth of its code: a submodule
    where ``from package import name`` names one of ``modules``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in modules else base, node))
    return out


def runtime_graph() -> dict[str, set[str]]:
    """Module -> the runtime modules it imports."""
    modules = runtime_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, set())
        for name, _ in imports_of(module, path, set(modules)):
            if name.split(".")[0] == "strata_runtime":
                while name not in modules:  # an attribute of a module, `import pkg.mod.name`
                    name = name.rsplit(".", 1)[0]
                edges.add(name)
    return graph


def one_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """An import circle (``[a, b, a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_runtime_imports_exactly_the_listed_strata_cfg_modules():
    modules = runtime_modules()
    known = set(modules) | set(package_modules("strata_cfg"))
    used: dict[str, set[str]] = {}
    for module, path in modules.items():
        for name, _ in imports_of(module, path, known):
            if name.split(".")[0] == "strata_cfg":
                used.setdefault(name, set()).add(module)
    assert set(used) == set(RUNTIME_MAY_IMPORT_FROM_CFG), {m: sorted(by) for m, by in used.items()}
    for name, importers in ONLY_FROM.items():
        assert all(m.startswith(importers) for m in used[name]), (name, sorted(used[name]))


def test_the_runtime_loads_no_strata_cfg_module_the_listed_ones_do_not():
    """In a fresh interpreter: importing every runtime module that runs without CuPy loads no strata_cfg
    module beyond what the listed modules load themselves."""
    modules = runtime_modules()

    def needs_cupy(path: Path) -> bool:
        top = ast.parse(path.read_text(encoding="utf-8")).body
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        return any(n.split(".")[0] in ("cupy", "cupy_backends") for n in names)

    importable = [m for m, path in modules.items() if not needs_cupy(path)]
    assert "strata_runtime.engine.scheduler" in importable and "strata_runtime.server.app" in importable
    cfg = {m for m in loaded_modules(*importable) if m.startswith("strata_cfg")}
    listed = {m for m in loaded_modules(*RUNTIME_MAY_IMPORT_FROM_CFG) if m.startswith("strata_cfg")}
    assert cfg <= listed, sorted(cfg - listed)


def test_the_runtime_has_no_import_circle_even_inside_functions():
    graph = runtime_graph()
    assert graph["strata_runtime.model.stage"] >= {"strata_runtime.cuda.decode", "strata_runtime.cuda.layers"}
    assert one_circle(graph) is None, one_circle(graph)


def test_the_circle_finder_finds_a_function_level_circle():
    assert one_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert one_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


RUNTIME_MAY_IMPORT: dict[str, set[str]] = {
    # part of strata_runtime: the parts it may import besides itself, in the order a request's data flows
    "api": set(),
    "backend": set(),
    "layout": set(),
    "reference": set(),
    "models": {"layout", "reference"},
    "weights": {"backend", "models", "reference"},
    "cuda": {"backend", "layout", "models", "reference"},
    "model": {"api", "backend", "layout", "models", "weights", "cuda"},
    "engine": {"api", "backend", "layout", "model", "weights"},
    "server": {"api"},
    "bench": {"api", "backend", "cuda", "engine", "model", "models", "weights"},
    "commands": {"api", "backend", "bench", "engine", "model", "server", "weights"},
    "__main__": set(),
    "strata_runtime": set(),
}
"""The runtime's own layering: the foundation (the request interface, devices, a window's rows, the kernels'
references), then the architecture, its weights and its CUDA path, the placed model, the engine, and the
server, bench and commands on top. The server reaches the engine only through `api.EngineCore`."""


def test_each_part_of_the_runtime_imports_only_the_parts_before_it():
    def part(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    graph = runtime_graph()
    assert {part(m) for m in graph} == set(RUNTIME_MAY_IMPORT)
    wrong = sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if part(t) != part(m) and part(t) not in RUNTIME_MAY_IMPORT[part(m)]
    )
    assert wrong == []
