"""The package's shape, read from its source with `ast`: its parts import one way (model/ never
engine/, the engine nothing of workloads), module-level imports form no cycle, every part ships in the
wheel, and functions (Triton kernels aside) stay under 60 lines."""

import ast
import tomllib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexgemma"
MAX_LINES = 60


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _targets(node, importer: str, known: set[str]) -> list[str]:
    """The flexgemma modules one import statement names (`from a import b` counts b when b is a
    module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level:  # relative: resolve against the importer's package
        base = importer.split(".")[: len(importer.split(".")) - node.level]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
    return out or ([source] if source in known else [])


def imports(tree: ast.Module, importer: str, known: set[str], module_level: bool) -> set[str]:
    """flexgemma modules `tree` imports: at module level only (also inside if/try at the top), or
    anywhere (function bodies too)."""
    nodes = ast.walk(tree) if not module_level else _top_level(tree.body)
    return {t for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _targets(n, importer, known)}


def _top_level(body):
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_level(block)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_model_never_imports_engine():
    mods = modules()
    known = set(mods)
    bad = {name: sorted(t for t in imports(tree, name, known, module_level=False) if t.startswith("flexgemma.engine"))
           for name, tree in mods.items() if name.startswith("flexgemma.model")}
    assert {k: v for k, v in bad.items() if v} == {}


# what each part may import besides itself: config/ nothing (its resolve.py the model's dtype rule),
# model/ the config and tokenizers, the engine the model, workloads (tasks/, rl/) the engine; run/,
# builder, api and the CLI sit on top
MAY_IMPORT = {"config": set(), "tokenizers": set(), "model": {"config", "tokenizers"},
              "engine": {"config", "model"}, "report": {"config"}, "rl": {"config", "engine", "model"},
              "tasks": {"config", "engine", "model", "rl"}}
EXCEPTIONS = {("flexgemma.config.resolve", "flexgemma.model.load")}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_parts_import_one_way():
    mods = modules()
    known = set(mods)
    bad = sorted((name, t) for name, tree in mods.items() if _part(name) in MAY_IMPORT
                 for t in imports(tree, name, known, module_level=False)
                 if _part(t) not in MAY_IMPORT[_part(name)] | {_part(name)} and (name, t) not in EXCEPTIONS)
    assert bad == []


def test_every_part_ships_in_the_wheel():
    """pyproject lists packages by hand; an editable install finds a missing one, a wheel does not."""
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    parts = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert parts - listed == set()


def test_no_import_cycle_at_module_level():
    mods = modules()
    known = set(mods)
    graph = {name: imports(tree, name, known, module_level=True) for name, tree in mods.items()}
    assert cycles(graph) == []


def test_no_import_cycle_even_through_function_level_imports():
    """A function-level import hides a cycle from Python's loader, not from the reader (issue 15 named
    two: block_mask <-> runner, fused <-> moe_kernel)."""
    mods = modules()
    known = set(mods)
    graph = {name: imports(tree, name, known, module_level=False) for name, tree in mods.items()}
    assert cycles(graph) == []


def test_the_import_graph_sees_imports():
    """The checks above could pass by reading nothing: the graph must hold edges we know of."""
    mods = modules()
    known = set(mods)
    top = imports(mods["flexgemma.builder"], "flexgemma.builder", known, module_level=True)
    assert {"flexgemma.engine.kv_cache", "flexgemma.model.forward", "flexgemma.model.compiled"} <= top
    anywhere = imports(mods["flexgemma.model.glue"], "flexgemma.model.glue", known, module_level=False)
    assert "flexgemma.model.moe_kernel" in anywhere  # a function-level import
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def test_functions_are_short():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long[f"{rel}:{node.name}"] = lines
    assert long == {}
