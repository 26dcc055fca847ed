"""The package's layers, enforced: calls go one way (docs/architecture.md).

Every import in page_local/ (module level and inside functions) is read from the source and must point
to the importer's own floor or a lower one. Third-party libraries that belong to one layer are
checked too: llama_cpp and the bindings only in native/, click / rich / prompt_toolkit only in cli/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "page_local"

# floor of each part of the package, bottom up (a module not listed here fails the test: give it a floor)
FLOORS = {
    "errors": 0, "defaults": 0, "probe": 0,  # probe: the ProbeResult type native fills and the layers above read
    "native": 1,
    "signal": 2, "gate": 2, "verify": 2, "evictors": 2, "tasks": 2, "store": 2,
    "engine": 3,
    "chat": 4, "eval": 4, "bench": 4,
    "cli": 5, "serve": 5,
}
# third-party modules only one part may import
OWNED = {"llama_cpp": "native", "page_local_bindings": "native", "cffi": "native",
         "click": "cli", "rich": "cli", "prompt_toolkit": "cli"}


def part_of(module: str) -> str | None:
    """'page_local.engine.turn' -> 'engine'; the package face 'page_local' -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "page_local" else None


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in source, relative ones resolved."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # from page_local.serve import ollama: the submodule is the target; a name defined in the
            # package's __init__ (from page_local.engine import Engine): the package
            where = PACKAGE.parent.joinpath(*target.split(".")) if target else None
            subs = [a.name for a in node.names if where is not None
                    and ((where / a.name).is_dir() or (where / f"{a.name}.py").is_file())]
            if target == "page_local" or len(subs) < len(node.names):
                out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{name}") for name in subs]
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What is wrong with one module's imports, in words (empty when it keeps the rule)."""
    mine = part_of(module)
    if mine is None:  # the package face imports lazily from every layer, by design
        return []
    if mine not in FLOORS:
        return [f"{module}: part {mine!r} has no floor in tests/test_layers.py FLOORS"]
    bad = []
    for line, target in imports(source, module, is_package):
        top = target.split(".")[0]
        if top in OWNED and OWNED[top] != mine:
            bad.append(f"{module}:{line} imports {target}, which only {OWNED[top]}/ may use")
        theirs = part_of(target)
        if theirs is None or theirs == mine:
            continue
        if theirs not in FLOORS:
            bad.append(f"{module}:{line} imports {target}: part {theirs!r} has no floor")
        elif FLOORS[theirs] > FLOORS[mine]:
            bad.append(f"{module}:{line} imports {target} (floor {FLOORS[theirs]}) from floor {FLOORS[mine]}: "
                       "calls go one way, down")
    return bad


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down(path):
    assert violations(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py") == []


def test_the_package_has_the_parts_the_floors_name():
    """A part renamed or removed must leave FLOORS too, so the table keeps describing the tree."""
    parts = {part_of(module_name(p)) for p in modules()} - {None}
    assert parts <= set(FLOORS)
    assert parts >= set(FLOORS) - {"serve"}  # the server sits beside cli once it exists


@pytest.mark.parametrize("source, module, expected", [
    ("from page_local.engine import Engine", "page_local.gate", "floor 3) from floor 2"),
    ("from ..cli import main", "page_local.eval.runner", "imports page_local.cli"),
    ("from page_local import engine", "page_local.store.models", "imports page_local.engine"),
    ("def f():\n    import click\n", "page_local.engine.engine", "only cli/ may use"),
    ("from llama_cpp import llama_cpp", "page_local.chat.session", "only native/ may use"),
], ids=["upward", "relative-upward", "submodule-by-name", "click-in-engine", "llama_cpp-in-chat"])
def test_a_crossing_is_reported(source, module, expected):
    found = violations(source, module)
    assert found and expected in found[0]


@pytest.mark.parametrize("source, module", [
    ("from page_local.errors import ContextFull", "page_local.engine.engine"),
    ("from page_local.engine.turn import W", "page_local.eval.runner"),
    ("from .session import ChatSession", "page_local.chat.prompts"),
], ids=["down", "down-two", "same-part"])
def test_a_call_down_is_allowed(source, module):
    assert violations(source, module) == []


# --- no circles inside a part either (issue 41: serve/ had two) ----------------------------------------

def import_graph() -> dict[str, set[str]]:
    """module -> the page_local modules it imports (module level and inside functions), packages resolved
    to their __init__ where the target is a package."""
    mods = {module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for _, target in imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py"):
            # `from page_local.serve.http import x`: the module; `from page_local.serve import http`: resolved
            # by imports() to the submodule too
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_round_a_circle():
    """Inside a part too, calls go one way: a circle of imports (app -> ollama -> app) ties modules that should
    stand one above the other. The package face (page_local/__init__.py, which imports lazily from every layer)
    is left out."""
    graph = {m: ts for m, ts in import_graph().items() if m != "page_local"}
    assert circles(graph) == []


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
