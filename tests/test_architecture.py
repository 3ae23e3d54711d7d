"""The import graph docs/architecture.md promises: the model home below everything, the shard
format below its users, the converter imported only by the commands, and no cycles between
packages.  Read from the source with `ast` (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "plamo2_tools"
FOUNDATION = {"errors", "dtypes", "parallel", "safetensors_io", "digest", "outputs", "__init__"}
# PLaMo's tokenizer format is a leaf (it imports only errors); synth writes one for every checkpoint.
LEAVES = {"tokenizer"}


def _unit(module: str) -> str:
    """plamo2_tools.model.tensors -> 'model'; plamo2_tools.errors -> 'errors'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("plamo2_tools")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("plamo2_tools"):
                names = [f"{target}.{a.name}" for a in node.names] if node.module is None or not node.level else []
                found |= {target, *[n for n in names if (ROOT.parent / n.replace(".", "/")).exists()]}
    return found


def _graph() -> dict[str, set[str]]:
    """unit -> units it imports (self-imports dropped)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = _unit(_module_of(path)) if path.parent != ROOT or path.name != "__init__.py" else "__init__"
        deps = {_unit(m) for m in _imports(path) if m.count(".") >= 1}
        graph.setdefault(unit, set()).update(deps - {unit, "__init__"})
    return graph


GRAPH = _graph()


def test_the_model_home_imports_only_the_foundation() -> None:
    assert GRAPH["model"] <= FOUNDATION | LEAVES, GRAPH["model"] - FOUNDATION - LEAVES
    assert GRAPH["tokenizer"] <= FOUNDATION, GRAPH["tokenizer"] - FOUNDATION


def test_the_shard_format_home_imports_only_the_model_and_foundation() -> None:
    assert GRAPH["shards"] <= FOUNDATION | {"model"}, GRAPH["shards"] - FOUNDATION - {"model"}


@pytest.mark.parametrize("unit", ["runtime", "eval", "inspect", "kernels", "shards", "model", "tokenizer"])
def test_nothing_but_the_commands_imports_convert(unit: str) -> None:
    assert "convert" not in GRAPH.get(unit, set())


def test_no_cycles_between_packages() -> None:
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in GRAPH.get(todo.pop(), set()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = sorted(u for u in GRAPH if u in reach(u))
    assert not cycles, {u: sorted(GRAPH[u]) for u in cycles}


def test_the_graph_is_read_at_all() -> None:
    """Guards the guard: the parser sees the imports it should."""
    assert "model" in GRAPH["shards"] and "shards" in GRAPH["runtime"] and "convert" in GRAPH["cli"]
