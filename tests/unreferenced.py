"""Definitions in the package that nothing reads (issue 29 item 7), found with `ast`.

A definition is a module-level function, class or constant of `plamo2_tools`, or a method, property
or class-level field of one of its classes.  It is referenced when its name is read anywhere in the
package, bench/ or tests/ (a `Name` or an attribute in a load, a name in `__all__` or any other
string, as `module:attr` registries and `getattr` spell them), outside its own definition.  Being
written (a keyword argument, an assignment) is not being read: a dataclass field that every caller
fills and nobody reads is dead.  Names are matched by spelling, not by type, so the finder misses a
dead method that shares its name with a live one; what it reports is dead, except definitions read
without their name: called by other libraries (transformers' hooks, uvicorn's methods) or a field
that `vars()`, `asdict()` or pydantic serialises; the caller allows those, each with its reason.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# Called by name from outside our code: Python's protocols, the libraries we plug into.
@dataclass(frozen=True)
class Definition:
    name: str
    where: str  # "path:line"
    qualname: str  # "module.Class.name"


def _relative(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(path.name)


def _module_name(path: Path) -> str:
    return ".".join(_relative(path).with_suffix("").parts).removesuffix(".__init__")


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def definitions(path: Path) -> list[Definition]:
    """What one package module defines (module docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module, rel = _module_name(path), str(_relative(path))
    found = []

    def add(name: str, node: ast.AST, owner: str = "") -> None:
        if not (name.startswith("__") and name.endswith("__")):
            found.append(Definition(name, f"{rel}:{node.lineno}", f"{module}.{owner}{name}"))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.decorator_list and not isinstance(node, ast.ClassDef):
                continue  # registered by its decorator (a route, a model, a fixture)
            add(node.name, node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in item.decorator_list}
                        if decorators <= {"property", "staticmethod", "classmethod", "cached_property"}:
                            add(item.name, item, f"{node.name}.")
                    for name in _targets(item):
                        add(name, item, f"{node.name}.")
        for name in _targets(node):
            add(name, node)
    return found


def references(path: Path) -> Counter[str]:
    """Names read in one file (module docstring), each counted once per reading."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    seen: Counter[str] = Counter()
    for node in ast.walk(tree):
        if id(node) in prose:
            continue  # a docstring mentions a name, it does not read it
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            seen[node.id] += 1
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            seen[node.attr] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 400:
            seen.update(WORD.findall(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            seen.update(alias.name.rpartition(".")[2] for alias in node.names)
    return seen


def python_files(*folders: str, root: Path = ROOT) -> list[Path]:
    return [p for folder in folders for p in sorted((root / folder).rglob("*.py")) if "__pycache__" not in p.parts]


def unreferenced(
    package: Iterable[Path] | None = None, readers: Iterable[Path] | None = None, allowed: Iterable[str] = ()
) -> list[Definition]:
    """Definitions of `package` (default: plamo2_tools) whose name nothing in `readers` (default:
    the package, bench/ and tests/) reads, less `allowed` (qualified names).
    A docstring's mention is no reading; any other string's is (registries, `getattr`)."""
    package = python_files("plamo2_tools") if package is None else list(package)
    if readers is None:  # the guard test's own list of names is no reading
        readers = [p for p in python_files("plamo2_tools", "bench", "tests") if p.name != "test_unreferenced.py"]
    defined = [d for path in package for d in definitions(path)]
    reads: Counter[str] = Counter()
    for path in readers:
        reads.update(references(path))
    allowed = set(allowed)
    return [d for d in defined if reads[d.name] == 0 and d.qualname not in allowed]
