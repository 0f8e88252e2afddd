"""The package layout's two rules (docs/design/layout.md): the flag parser is light, and no slime module
imports itself back through others, counting type-only and function-local imports.  CPU only, no Ray."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY_PACKAGES = ("ray", "torch", "transformers", "PIL", "pyarrow", "datasets", "math_verify", "sympy", "sglang",
                  "megatron")
"""Third-party packages that importing the parser (or the command line, before the flags are parsed) must not load."""
PIPELINE_MODULES = ("slime.rollout.manager", "slime.rollout.rm_hub.scorer", "slime.rollout.rm_hub.math_reward",
                    "slime.data.dataset", "slime.data.sources", "slime.data.processor", "slime.data.image",
                    "slime.rollout.scheduler", "slime.ray.engine_group", "slime.ray.trainer_group", "slime.driver")
"""slime modules that do the work the flags configure: the rollout manager, the reward scorer, the data pipeline,
the processor, the worker groups and the run."""


def _loaded_after_import(module: str) -> list[str]:
    code = f"import sys, {module}\nprint('\\n'.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", ["slime.arguments", "slime.train"])
def test_the_parser_and_the_command_line_import_no_pipeline_module(module):
    """``import slime.arguments`` (and ``slime.train``, whose ``--help`` and usage errors end in the parser) loads
    only flag groups and registries: no Ray, torch or model / data library, none of the modules the flags configure."""
    loaded = _loaded_after_import(module)
    heavy = [name for name in loaded if name.split(".")[0] in HEAVY_PACKAGES]
    pipeline = [name for name in PIPELINE_MODULES if name in loaded]
    assert not heavy and not pipeline, f"import {module} loads {heavy + pipeline}"
    assert module in loaded  # the probe did import it


# ---------------------------------------------------------------------------- import graph


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a folder under ``root``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, from every import statement anywhere in its file
    (module level, under ``if TYPE_CHECKING:``, inside functions).

    ``import a.b`` and ``from a.b import c`` import ``a.b``; the latter also imports ``a.b.c`` when that is a
    module.  Relative imports are resolved against the importing module's package.  Imports of modules outside
    ``package`` are left out.
    """
    modules = _module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                targets.add(source)
                targets.update(f"{source}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component of more than one module (Tarjan's algorithm,
    iterative), each shown as a shortest path around it from its first module in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_shortest_cycle(graph, component) for component in components]


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    previous = {start: None}
    frontier = [start]
    while frontier:  # breadth-first within the component, back to start
        next_frontier = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    next_frontier.append(child)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_no_import_cycle_among_slime_modules():
    graph = import_graph(ROOT, "slime")
    assert len(graph) > 50 and "slime.arguments" in graph["slime.train"]  # the scan saw the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (type-only and function-local imports count):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_finder_counts_type_only_function_local_relative_and_submodule_imports(tmp_path):
    """A made-up package whose every edge is one of the counted kinds, with the cycles known by construction."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "def f():\n    from . import c\n",  # function-local, relative, c a submodule
        "pkg/c.py": "import pkg.a\n",  # a -> b -> c -> a
        "pkg/sub/__init__.py": "from .d import x\n",  # relative from a package's __init__
        "pkg/sub/d.py": "from pkg import sub\nimport os\n",  # sub -> d -> sub; os is outside
        "pkg/e.py": "from pkg.a import A\n",  # into the cycle, not part of it
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg", "pkg.c"} and graph["pkg.sub.d"] == {"pkg", "pkg.sub"}
    assert sorted(find_cycles(graph)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.sub", "pkg.sub.d", "pkg.sub"]]
    _write(tmp_path, {"pkg/c.py": "", "pkg/sub/d.py": "x = 1\n"})
    assert find_cycles(import_graph(tmp_path, "pkg")) == []
