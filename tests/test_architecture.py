"""The package's structure, read from its source: layers that only point down, no import cycle
(imports inside functions counted), imports at the top of modules except the optional ones that
extras.LAZY names, product modules of a readable size, and the tools out of the product."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpinfer.extras import LAZY

from .conftest import ROOT

PACKAGE = ROOT / "mpinfer"
# Each group may import itself and the groups listed (docs/architecture.md draws it). A module
# belongs to the most specific entry that names it or a package above it: the folders are the
# layers (model/ holds three: its kernels, the model, and the layout beside it).
GROUPS = {
    "base": {"mpinfer", "mpinfer.config", "mpinfer.dist", "mpinfer.extras"},
    "kernels": {"mpinfer.model.kernels"},
    "model": {"mpinfer.model"},
    "layout": {"mpinfer.model.sharding", "mpinfer.model.memory", "mpinfer.model.offloadplan"},
    "loading": {"mpinfer.checkpoint"},
    "engine": {"mpinfer.engine"},
    "runtime": {"mpinfer.startup"},
    "faces": {"mpinfer.server", "mpinfer.repl", "mpinfer.cli"},
    "tools": {"mpinfer.tools"},
}
MAY_IMPORT = {
    "base": set(),
    "kernels": {"base"},
    "model": {"base", "kernels"},
    "layout": {"base", "kernels", "model"},
    "loading": {"base", "kernels", "model", "layout"},  # not the engine
    "engine": {"base", "kernels", "model", "layout"},  # not loading
    "runtime": {"base", "kernels", "model", "layout", "loading", "engine"},
    "faces": {"base", "kernels", "model", "layout", "loading", "engine", "runtime"},
    "tools": set(GROUPS),
}
MAX_LINES = 420  # "about 400" for a product module


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def group_of(name: str) -> str:
    found = [(len(m), group) for group, members in GROUPS.items() for m in members
             if name == m or (m != "mpinfer" and name.startswith(m + "."))]  # fmt: skip
    assert found, f"{name} belongs to no group: add it to GROUPS"
    return max(found)[1]


def test_the_folders_are_the_layers():
    """Only the base modules and the two entry points (cli, repl) sit at the top of the
    package; every other module lives in its layer's folder."""
    top = {name for name, path in modules().items() if path.parent == PACKAGE}
    assert top == {"mpinfer", "mpinfer.config", "mpinfer.dist", "mpinfer.extras",
                   "mpinfer.cli", "mpinfer.repl"}, top  # fmt: skip
    for name in modules():
        folder = name.split(".")[1] if name.count(".") >= 2 else ""
        expected = {"model": {"kernels", "model", "layout"}, "checkpoint": {"loading"},
                    "engine": {"engine"}, "startup": {"runtime"}, "server": {"faces"},
                    "tools": {"tools"}}.get(folder)  # fmt: skip
        assert expected is None or group_of(name) in expected, (name, group_of(name))


def imports(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import statement of a module."""
    known = modules()
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in child.names:  # `from pkg import submodule` imports the submodule
                    target = f"{base}.{a.name}"
                    out.append((target if target in known else base, in_function, child.lineno))
            visit(child, nested)

    visit(tree, False)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m, _, _ in imports(name, path) if m in known and m != name}
            for name, path in known.items()}  # fmt: skip


def test_no_import_cycles_counting_imports_inside_functions():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def walk(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    assert not cycles, cycles


def test_every_import_points_down_the_layers_and_nothing_imports_the_tools():
    wrong = []
    for name, deps in graph().items():
        here = group_of(name)
        for dep in deps:
            there = group_of(dep)
            if there != here and there not in MAY_IMPORT[here]:
                wrong.append(f"{name} ({here}) imports {dep} ({there})")
    assert not wrong, wrong


def test_imports_are_at_the_top_except_the_optional_ones():
    """Inside a function only what extras.LAZY names (GPU-only kernels, optional extras)."""
    wrong = []
    for name, path in modules().items():
        for target, in_function, line in imports(name, path):
            top = target.split(".")[0]
            if in_function and target not in LAZY and top not in LAZY:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, wrong


def test_optional_dependencies_are_never_imported_at_the_top_of_the_product():
    """`pip install mpinfer` serves without them: only the tools may import them at the top,
    and the GPU kernels may import Triton (they are imported on a GPU only)."""
    wrong = []
    for name, path in modules().items():
        if group_of(name) == "tools":
            continue
        for target, in_function, line in imports(name, path):
            optional = target in LAZY or target.split(".")[0] in LAZY
            gpu_only = name in LAZY  # a kernel module: imported lazily itself
            if optional and not in_function and not gpu_only:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(n for n in modules() if group_of(n) != "tools"))
def test_product_modules_are_readable_in_one_sitting(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"


def test_every_module_opens_with_a_docstring():
    missing = [n for n, p in modules().items() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


def test_the_model_and_the_kernels_know_no_http_files_or_process_groups():
    """model/layers/quant: no HTTP, no files, no requests; kernels: no process groups."""
    banned = {"model": {"fastapi", "uvicorn", "safetensors", "mpinfer.engine.engine", "httpx"},
              "kernels": {"torch.distributed", "mpinfer.dist", "mpinfer.model.layers"}}  # fmt: skip
    wrong = []
    for name, path in modules().items():
        for target, _, line in imports(name, path):
            if any(target == b or target.startswith(b + ".")
                   for b in banned.get(group_of(name), ())):  # fmt: skip
                wrong.append(f"{name}:{line} imports {target}")
    assert not wrong, wrong
