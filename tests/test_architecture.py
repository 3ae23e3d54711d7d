"""The import graph docs/architecture.md promises, read from the source with `ast` (lazy imports
inside functions count too):

* packages: the model home below everything but the foundation (and the tokenizer leaf), the shard
  format below its users, the converter imported only by the commands, no cycles between packages;
* the runtime's three rooms: the rank below the batching loop below the processes;
* the server (`serve/`) a consumer of the runtime, like eval: imported by the commands alone, its
  HTTP layer apart from the runtime (only the engine, batch and service modules load it);
* the result kinds (`kinds.py`) a leaf, and the report standing on them and the foundation alone;
* files: no import cycle between any two modules of the package, and no module importing another
  module's `_private` names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "plamo2_tools"
FOUNDATION = {
    "errors",
    "jsonio",
    "safe_files",
    "dtypes",
    "numerics",
    "parallel",
    "safetensors_io",
    "digest",
    "outputs",
    "kinds",
    "token_ids",
    "generation_request",
    "version",
    "output_lock",
    "file_output",
    "check_report",
    "__init__",
}
# PLaMo's tokenizer format is a leaf (it imports only errors); synth writes one for every checkpoint.
LEAVES = {"tokenizer"}
# What each result file is (kinds.py: kind and schema version), part of the foundation: it imports
# nothing; the writers of every result and the report read it.
KINDS = "kinds"


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_of(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None) for every import in the file."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("plamo2_tools")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("plamo2_tools"):
                continue
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:  # `from . import x`: the module x itself
                    found.append((f"{target}.{a.name}", None))
                else:
                    found.append((target, a.name))
    return found


def _file_graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


FILES = _file_graph()


def _unit(module: str) -> str:
    """plamo2_tools.model.layout -> 'model'; plamo2_tools.errors -> 'errors'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, deps in FILES.items():
        unit = _unit(m)
        graph.setdefault(unit, set()).update({_unit(d) for d in deps} - {unit, "__init__"})
    return graph


GRAPH = _package_graph()


def _floor(graph: dict[str, set[str]], unit: str, path: frozenset[str] = frozenset()) -> int:
    """1 for a unit that imports no other, else one above the highest unit it imports (a cycle, which
    test_no_cycles_between_packages reports, is cut where it closes)."""
    below = graph.get(unit, set()) - path - {unit}
    return 1 + max((_floor(graph, d, path | {unit}) for d in below), default=0)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), set()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_model_home_imports_only_the_foundation() -> None:
    assert GRAPH["model"] <= FOUNDATION | LEAVES, GRAPH["model"] - FOUNDATION - LEAVES
    assert GRAPH["tokenizer"] <= FOUNDATION, GRAPH["tokenizer"] - FOUNDATION


def test_the_shard_format_home_imports_only_the_model_and_foundation() -> None:
    assert GRAPH["shards"] <= FOUNDATION | {"model"}, GRAPH["shards"] - FOUNDATION - {"model"}


def test_kernels_know_no_model() -> None:
    assert GRAPH["kernels"] <= FOUNDATION, GRAPH["kernels"] - FOUNDATION


@pytest.mark.parametrize(
    "unit", ["runtime", "eval", "inspect", "kernels", "shards", "model", "tokenizer", "verify", "serve", "deploy"]
)
def test_nothing_but_the_commands_imports_convert(unit: str) -> None:
    assert "convert" not in GRAPH.get(unit, set())


def test_kinds_is_a_leaf() -> None:
    assert GRAPH[KINDS] == set(), GRAPH[KINDS]


def test_the_report_reads_kinds_not_their_writers() -> None:
    """report/ renders JSON: it stands on the foundation and the kinds leaf alone, never on the code
    that writes the files (convert, verify, eval, ... and through them the runtime and PyTorch), so
    `plamo2-tools report` starts as fast as a byte-moving command; its floor is 4 (jsonio, 3, below it)."""
    assert GRAPH["report"] <= FOUNDATION, GRAPH["report"] - FOUNDATION
    assert _floor(GRAPH, "report") <= 4


def test_the_package_never_imports_the_benchmarks() -> None:
    """bench/ stands beside the installed package and on it, never under it: an installed
    plamo2-tools has no `bench` to import."""
    users = set()
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "bench" or n.startswith("bench.") for n in names):
                users.add(m)
    assert not users, users


def test_export_stands_on_what_convert_reads() -> None:
    """export/ (issue 31) writes other runtimes' formats from the sources convert reads (convert/sources.py), so it
    is a command library like convert: the model, the shard format, convert, deploy (to verify what it wrote) and
    the foundation below it."""
    allowed = FOUNDATION | LEAVES | {"model", "shards", "convert", "deploy"}
    assert GRAPH.get("export", set()) <= allowed, GRAPH["export"] - allowed


def test_nothing_imports_the_cli() -> None:
    users = {m for m, deps in FILES.items() if any(_unit(d) == "cli" for d in deps) and _unit(m) != "cli"}
    assert not users, users


def test_nothing_but_the_commands_imports_serve() -> None:
    users = {
        m for m, deps in FILES.items() if any(_unit(d) == "serve" for d in deps) and _unit(m) not in ("serve", "cli")
    }
    assert not users, users


def test_serve_is_a_consumer_of_the_runtime_like_eval() -> None:
    """serve/ stands on the runtime and the foundation, never on eval, convert, verify or the cli;
    its HTTP layer (app, handlers, protocol, ...) needs no runtime at all: only the engines over the
    online loop (in this process, across the pipe: loop_engine, runtime_engine, engine_core, front),
    batch files and the per-rank service do.  The HTTP process's modules (front, loop_engine) take
    only the runtime's torch-free text rules (tests/serve/test_http_process.py checks torch stays out)."""
    assert GRAPH["serve"] <= FOUNDATION | {"runtime"}, GRAPH["serve"] - FOUNDATION - {"runtime"}
    runtime_users = {
        f"plamo2_tools.serve.{m}" for m in ("runtime_engine", "batch", "service", "engine_core", "front", "loop_engine")
    }
    for m, deps in FILES.items():
        if _unit(m) == "serve" and m not in runtime_users:
            assert not {_unit(d) for d in deps} & {"runtime", "kernels", "model", "shards"}, (m, sorted(deps))


def test_deploy_judges_from_above_the_runtime() -> None:
    """deploy/ (`verify TARGET`) stands on the reference forward (model), the runtime, the shard
    format, verify's prompt helpers and the foundation; it speaks HTTP to servers itself, so it never
    imports serve/ (our server is a target like any other), eval, convert or the cli.  Only the
    commands, the public face (whose `verify` is the command's call), export (which verifies what it
    writes) and the report (for the result kind) import it."""
    allowed = FOUNDATION | {"model", "runtime", "shards", "verify", "tokenizer"}
    assert GRAPH["deploy"] <= allowed, GRAPH["deploy"] - allowed
    users = {m for m, deps in FILES.items() if any(_unit(d) == "deploy" for d in deps)}
    assert {_unit(m) for m in users} <= {"deploy", "cli", "api", "export", "report"}, users


def test_the_public_face_stands_above_everything() -> None:
    """`plamo2_tools/__init__.py` exports the library API (`api.py`) lazily: no module of the
    package imports the package's `__init__` or `api` (the version lives in `version.py`), so the
    face can import anything without a cycle, and every name it exports has a home that exists."""
    import plamo2_tools

    users = {m for m, deps in FILES.items() if {"plamo2_tools", "plamo2_tools.api"} & deps}
    assert not users, users
    for name, home in plamo2_tools._HOMES.items():
        assert f"plamo2_tools{home}" in MODULES, (name, home)


def test_the_exports_are_a_consumer_like_convert() -> None:
    """export/ (the formats other runtimes load) is imported by the commands and the public face
    (api.py: `export`) alone; it reads what
    convert reads (convert/sources.py) and verifies through deploy/'s targets and the reference, never
    through our runtime, the server or eval."""
    users = {
        m
        for m, deps in FILES.items()
        if any(_unit(d) == "export" for d in deps) and _unit(m) not in ("export", "cli", "api")
    }
    assert not users, users
    assert not GRAPH["export"] & {"runtime", "serve", "eval", "verify"}, GRAPH["export"]
    allowed = FOUNDATION | LEAVES | {"model", "shards", "deploy", "convert", "tokenizer"}
    assert GRAPH["export"] <= allowed, GRAPH["export"] - allowed


def test_no_cycles_between_packages() -> None:
    cycles = sorted(u for u in GRAPH if u in _reach(GRAPH, u))
    assert not cycles, {u: sorted(GRAPH[u]) for u in cycles}


def test_the_runtime_rooms_stack_rank_batching_process() -> None:
    """rank (the rank's weights and collectives) <- batching (the loop) <- process (launch, jobs)."""
    order = ["rank", "batching", "process"]
    for m, deps in FILES.items():
        parts = m.split(".")
        if parts[:2] != ["plamo2_tools", "runtime"] or len(parts) < 4:
            continue
        room = order.index(parts[2])
        for d in deps:
            dp = d.split(".")
            if dp[:2] == ["plamo2_tools", "runtime"] and len(dp) >= 4:
                assert order.index(dp[2]) <= room, f"{m} imports {d}: a lower room imports a higher one"


def test_no_cycles_between_files() -> None:
    """Not even between two modules of one package (a lazy import inside a function counts)."""
    cycles = sorted(m for m in FILES if m in _reach(FILES, m))
    assert not cycles, {m: sorted(FILES[m]) for m in cycles}


def test_no_private_names_across_files() -> None:
    offenders = [
        (m, t, name)
        for m, p in MODULES.items()
        for t, name in _imports(p)
        if name and name.startswith("_") and not name.startswith("__")
    ]
    assert not offenders, offenders


def test_the_graph_is_read_at_all() -> None:
    """Guards the guard: the parser sees the imports it should, and finds a planted cycle."""
    assert "model" in GRAPH["shards"] and "shards" in GRAPH["runtime"] and "convert" in GRAPH["cli"]
    assert "runtime" in GRAPH["serve"] and "serve" in GRAPH["cli"]
    assert "plamo2_tools.model.layout" in FILES["plamo2_tools.model.family"]
    assert _floor(GRAPH, "cli") > _floor(GRAPH, "runtime") > _floor(GRAPH, "model") > _floor(GRAPH, "errors") == 1
    planted = {**FILES, "plamo2_tools.model.layout": FILES["plamo2_tools.model.layout"] | {"plamo2_tools.model.family"}}
    assert "plamo2_tools.model.layout" in _reach(planted, "plamo2_tools.model.layout")
