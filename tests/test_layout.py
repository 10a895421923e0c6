"""The code's own rules, checked on the source (ast): the layout shows the pipeline and nothing
imports upward, no private names cross modules, no ``global`` state, no function over 60 lines,
``analysis`` never imports TVM or the bridge."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tvmbridge", "analysis")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 250  # a class is not a place to hide a long function

# The bridge's layers, lowest first: a module may import its own layer and the ones below.
# Read top to bottom this is the compile: trace -> convert -> passes -> split -> build -> run.
BRIDGE_LAYERS = {
    "errors": 0, "names": 0, "options": 0, "caches": 0, "sizes": 0, "disk_cache": 0, "devices": 1, "ir": 1,
    "parallel_launch": 1,
    "kernels": 2, "frontend": 3, "passes": 4, "partition": 5, "backend": 6,
    "pipeline": 7, "runtime": 8, "dynamo": 9, "tools": 9, "__init__": 10, "__main__": 10,
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append((".".join(parts), path))
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module imported, names imported from it, line) for every import statement."""
    tree = ast.parse(path.read_text())
    package = module.rsplit(".", 1)[0] if not path.name == "__init__.py" else module
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "tvmbridge":
        return None
    return BRIDGE_LAYERS.get(parts[1] if len(parts) > 1 else "__init__")


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_upward_or_private_imports(module, path):
    own = _layer(module)
    for target, names, line in _imports(module, path):
        where = f"{path.relative_to(ROOT)}:{line}"
        if module.startswith("analysis"):
            assert not target.startswith(("tvm", "tvmbridge")), f"{where}: analysis imports {target}"
        if target.startswith(PACKAGES):
            private = [n for n in names if n.startswith("_")]
            private += [p for p in target.split(".") if p.startswith("_") and p not in ("__init__", "__main__")]
            assert not private, f"{where}: imports private {private} from {target}"
        theirs = _layer(target) if own is not None else None
        if theirs is not None and target != "tvmbridge":
            assert theirs <= own, f"{where}: {module} (layer {own}) imports upward {target} (layer {theirs})"


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_functions_are_short_and_no_globals():
    long, globals_ = [], []
    for module, path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
            if isinstance(node, ast.Global):
                globals_.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    assert not globals_, f"global statements: {globals_}"


def test_every_bridge_module_has_a_layer():
    for module, _ in MODULES:
        if module.startswith("tvmbridge"):
            assert _layer(module) is not None, f"{module}: add its folder to BRIDGE_LAYERS"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself can fail: a pass importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..runtime.dispatch import add_tvm_dispatch\nfrom ..ir import _private\n")
    found = _imports("tvmbridge.passes.bad", bad)
    assert ("tvmbridge.runtime.dispatch", ["add_tvm_dispatch"], 1) in found
    assert _layer("tvmbridge.runtime.dispatch") > _layer("tvmbridge.passes.bad")
    assert ("tvmbridge.ir", ["_private"], 2) in found


MUTABLE_FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque",
                     "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}


def _empty_mutable(value: ast.expr | None) -> str | None:
    """What kind of empty mutable container ``value`` makes, or None: the shape of state that a
    module fills at run time (a cache, a table), which must live in ``tvmbridge.caches.CACHES``
    or an ``analysis.registry.Registry`` instead (bounded, locked, duplicates refused)."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set)):
        empty = not (value.keys if isinstance(value, ast.Dict) else value.elts)
        return type(value).__name__.lower() if empty else None
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        name = ast.unparse(value.func).rsplit(".", 1)[-1]
        return name if name in MUTABLE_FACTORIES else None
    return None


def _module_state(tree: ast.Module) -> list[tuple[int, str, str]]:
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            kind = _empty_mutable(node.value)
            if kind is not None:
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                found.append((node.lineno, ast.unparse(target), kind))
    return found


def test_no_module_level_caches_or_tables_outside_the_shared_objects():
    found = [f"{path.relative_to(ROOT)}:{line} {name} = empty {kind}"
             for _, path in MODULES for line, name, kind in _module_state(ast.parse(path.read_text()))]
    assert not found, ("module-level mutable state: use tvmbridge.caches.CACHES (a BoundedCache) or an "
                       f"analysis.registry.Registry: {found}")


def test_the_state_rule_sees_a_module_level_cache():
    tree = ast.parse("_SEEN: dict[str, int] = {}\n_ALSO = collections.OrderedDict()\nTABLE = {'a': 1}\n"
                     "def f():\n    local = {}\n")
    assert [(line, name) for line, name, _ in _module_state(tree)] == [(1, "_SEEN"), (2, "_ALSO")]


def test_modules_and_classes_are_small():
    big = []
    for _, path in MODULES:
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not big, f"modules over {MAX_MODULE_LINES} lines or classes over {MAX_CLASS_LINES}: {big}"
