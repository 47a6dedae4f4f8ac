"""The layering docs/ARCHITECTURE.md describes, checked two ways.

* Statically: every module's imports, read from its source (imports inside functions included), against
  the packages each part of strata_cfg may import, and against circles.
* At run time: importing a package in a fresh interpreter loads no array library, TUI or engine.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("numpy", "cupy", "textual", "strata_runtime")


# ---- the import graph, read from the source -------------------------------------------------------------


@dataclass
class ImportGraph:
    """The modules of one package and what each imports: its own modules, and other top-level names."""

    modules: dict[str, Path]
    internal: dict[str, set[str]] = field(default_factory=dict)
    """Module -> the package's modules it imports (a ``from pkg import name`` of a submodule counts)."""
    external: dict[str, set[str]] = field(default_factory=dict)
    """Module -> top-level names of other packages it imports, the standard library left out."""


def _module_names(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: Set[str]) -> list[str]:
    """The dotted names one import statement reaches (a submodule where ``from X import name`` names one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(root: Path, package: str) -> ImportGraph:
    """Every import statement of every module of ``package`` under ``root``, at any depth of the code."""
    graph = ImportGraph(_module_names(root, package))
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for module, path in graph.modules.items():
        internal, external = (
            graph.internal.setdefault(module, set()),
            graph.external.setdefault(module, set()),
        )
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, module, path, graph.modules):
                top = name.split(".")[0]
                if top == package:
                    while name not in graph.modules:  # `import pkg.a.b` of a name inside a module
                        name = name.rsplit(".", 1)[0]
                    internal.add(name)
                elif top not in stdlib:
                    external.add(top)
    return graph


def find_circle(edges: Mapping[str, Set[str]]) -> list[str] | None:
    """One import circle (``[a, b, a]``), or None when the graph has none."""
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


# ---- strata_cfg ------------------------------------------------------------------------------------------

CFG_MAY_IMPORT: dict[str, tuple[set[str], set[str]]] = {
    # part: (parts of strata_cfg it may import besides itself, packages outside the standard library)
    "schema": (set(), {"pydantic"}),
    "profile": ({"schema"}, {"pydantic"}),
    "facts": ({"schema", "profile"}, set()),
    "resolve": ({"schema"}, {"pydantic"}),
    "plan": ({"schema", "profile", "facts", "resolve"}, set()),
    "report": ({"schema"}, set()),
    "launch": ({"schema"}, set()),
    "bench": ({"schema"}, set()),
    "tui": ({"schema", "profile", "facts", "plan", "report", "launch"}, {"textual", "rich"}),
    "commands": ({"schema", "profile", "facts", "resolve", "plan", "report", "launch", "bench"}, set()),
    "cli": ({"strata_cfg"}, set()),
    "__main__": ({"cli"}, set()),
    "strata_cfg": (set(), set()),
}
"""What each part of strata_cfg may import, in the order data flows: profile -> facts -> resolve -> plan ->
report / launch. The TUI command alone reaches the TUI (`strata_cfg.commands.tui`, inside its `run`)."""


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def cfg_graph() -> ImportGraph:
    return import_graph(REPO, "strata_cfg")


def test_every_part_of_strata_cfg_has_a_layering_rule(cfg_graph):
    assert {_part(m) for m in cfg_graph.modules} == set(CFG_MAY_IMPORT)


def test_each_part_of_strata_cfg_imports_only_what_the_data_flow_allows(cfg_graph):
    wrong = []
    for module in cfg_graph.modules:
        part = _part(module)
        ours, others = CFG_MAY_IMPORT[part]
        if module == "strata_cfg.commands.tui":
            ours = ours | {"tui"}
        for target in cfg_graph.internal[module]:
            if _part(target) not in ours | {part}:
                wrong.append(f"{module} imports {target}")
        wrong += [f"{module} imports {name}" for name in cfg_graph.external[module] - others]
    assert sorted(wrong) == []


def test_no_part_of_strata_cfg_reaches_the_engine_or_an_array_library(cfg_graph):
    # Stated on its own, because it is the rule that keeps `strata plan` light and the engine swappable.
    reached = {name for names in cfg_graph.external.values() for name in names}
    assert reached.isdisjoint({"strata_runtime", "numpy", "cupy"})


def test_strata_cfg_has_no_import_circle(cfg_graph):
    circle = find_circle(cfg_graph.internal)
    assert circle is None, "import circle: " + " -> ".join(circle or ())


def test_the_circle_finder_finds_circles_and_only_circles():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": set()}) is None  # a diamond
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"x": {"y"}, "y": {"y"}}) == ["y", "y"]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nimport numpy\n")
    (pkg / "b.py").write_text("def late():\n    from .sub import c\n    from .a import thing\n")
    (pkg / "sub" / "c.py").write_text("import json\nfrom pkg.sub import d\n")
    (pkg / "sub" / "d.py").write_text("")
    graph = import_graph(tmp_path, "pkg")
    assert graph.internal["pkg.a"] == {"pkg.b"} and graph.external["pkg.a"] == {"numpy"}
    assert graph.internal["pkg.b"] == {"pkg.sub.c", "pkg.a"}
    assert graph.internal["pkg.sub.c"] == {"pkg.sub.d"} and graph.external["pkg.sub.c"] == set()
    assert find_circle(graph.internal) == ["pkg.a", "pkg.b", "pkg.a"]


# ---- strata_cfg at run time ------------------------------------------------------------------------------


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
        ("strata_cfg.profile.load", "strata_cfg.facts.gather", "strata_cfg.plan.from_profile"),
        ("strata_cfg.report.plan_text", "strata_cfg.report.explain", "strata_cfg.report.diff"),
        ("strata_cfg.launch.supervisor", "strata_cfg.launch.summary", "strata_cfg.bench.http_workloads"),
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
    # No I/O of our own in the pure core: only the schema and the resolver themselves are loaded.
    ours = {_part(m) for m in modules if m.startswith("strata_cfg.")}
    assert ours == {"schema", "resolve"}


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

RUNTIME_MAY_IMPORT_FROM_CFG = {
    "strata_cfg.schema.plan": "the launch plan: the one contract the runtime executes",
    "strata_cfg.schema.facts": "ModelFacts, the model's shapes as the plan carries them (bench arithmetic)",
    "strata_cfg.schema.windows": "the window row layout and its limits, one rule for resolver and engine",
    "strata_cfg.schema.plan_file": "the one reader of plan.json",
    "strata_cfg.schema.safetensors_header": "the one reader of a checkpoint file's header",
    "strata_cfg.schema.presets": "a synthetic model's config.json: the preset table defines the model",
    "strata_cfg.schema.workloads": "the bench workloads, shared with the HTTP bench driver",
    "strata_cfg.schema.sampling_options": (
        "the sampling options, checked as strata's own commands check them, and OpenAI's bounds on them"
    ),
}
"""Every strata_cfg module the runtime imports, and why."""
ONLY_FROM = {
    "strata_cfg.schema.presets": ("strata_runtime.weights.synthetic", "strata_runtime.bench.peer"),
    "strata_cfg.schema.workloads": ("strata_runtime.bench.", "strata_runtime.commands.bench"),
    "strata_cfg.schema.sampling_options": (
        "strata_runtime.commands.bench",
        "strata_runtime.commands.chat",
        "strata_runtime.commands.generate",
        "strata_runtime.api",
        "strata_runtime.server.protocol",
    ),
}
"""Those that are not the plan's own contract, and the only runtime modules that may import them."""


@pytest.fixture(scope="module")
def runtime_graph() -> ImportGraph:
    return import_graph(REPO, "strata_runtime")


def test_the_runtime_imports_exactly_the_listed_strata_cfg_modules():
    cfg = set(_module_names(REPO, "strata_cfg"))
    used: dict[str, set[str]] = {}
    for module, path in _module_names(REPO, "strata_runtime").items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _imported(node, module, path, cfg):
                    if name.split(".")[0] == "strata_cfg":
                        used.setdefault(name, set()).add(module)
    assert set(used) == set(RUNTIME_MAY_IMPORT_FROM_CFG), {m: sorted(by) for m, by in used.items()}
    for name, importers in ONLY_FROM.items():
        assert all(m.startswith(importers) for m in used[name]), (name, sorted(used[name]))


def test_the_runtime_loads_no_strata_cfg_module_the_listed_ones_do_not():
    """In a fresh interpreter: importing every runtime module that runs without CuPy loads no strata_cfg
    module beyond what the listed modules load themselves."""
    modules = _module_names(REPO, "strata_runtime")

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


def test_the_runtime_has_no_import_circle_even_inside_functions(runtime_graph):
    edges = runtime_graph.internal
    assert edges["strata_runtime.model.stage"] >= {"strata_runtime.cuda.decode", "strata_runtime.cuda.layers"}
    assert find_circle(edges) is None, find_circle(edges)


RUNTIME_MAY_IMPORT: dict[str, set[str]] = {
    # part of strata_runtime: the parts it may import besides itself, in the order a request's data flows
    "api": set(),
    "backend": set(),
    "layout": set(),
    "reference": set(),
    "chat": set(),
    "xml_calls": {"chat"},
    "thinking": {"chat"},
    "masks": set(),
    "structured": {"api", "masks", "thinking"},
    "bad_words": {"api", "masks"},
    "models": {"layout", "reference"},
    "experts": {"backend", "layout", "reference"},
    "weights": {"backend", "chat", "experts", "models", "reference", "xml_calls"},
    "cuda": {"backend", "layout", "models", "reference", "experts"},
    "model": {"api", "backend", "layout", "models", "weights", "cuda", "experts"},
    "engine": {"api", "backend", "bad_words", "experts", "layout", "masks", "model", "structured", "weights"},
    "server": {"api", "chat", "structured", "thinking", "xml_calls"},
    "bench": {"api", "backend", "cuda", "engine", "experts", "model", "models", "weights"},
    "commands": {
        "api",
        "backend",
        "bench",
        "chat",
        "engine",
        "model",
        "server",
        "structured",
        "thinking",
        "weights",
    },
    "__main__": set(),
    "strata_runtime": set(),
}
"""The runtime's own layering: the foundation (the request interface, devices, a window's rows, the kernels'
references, the chat layouts of tools and reasoning, grammars and bad words over a tokenizer), then the
architecture, its weights and its CUDA path, the placed model, the engine, and the server, bench and
commands on top. The server reaches the engine only through `api.EngineCore`."""


def test_each_part_of_the_runtime_imports_only_the_parts_before_it(runtime_graph):
    graph = runtime_graph.internal
    assert {_part(m) for m in graph} == set(RUNTIME_MAY_IMPORT)
    wrong = sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if _part(t) != _part(m) and _part(t) not in RUNTIME_MAY_IMPORT[_part(m)]
    )
    assert wrong == []
