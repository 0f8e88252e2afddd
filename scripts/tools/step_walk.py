#!/usr/bin/env python
"""A static walk of one rollout step: the calls a reader follows from ``slime/driver.py:loop``, file by file.

  python scripts/tools/step_walk.py [--backend fsdp|megatron] [--tree]

The walk reads source with ``ast`` and imports nothing.  From ``loop`` it reads every function a call reaches, depth
first in source order, each function once (a second call to it is not followed again).  A call is followed when it
reaches slime code: a module's function or class (its ``__init__`` / ``__post_init__`` / ``__call__``), a method of
an object whose type the code states (parameter, attribute and return annotations, constructor assignments, ``for``
over a typed list), a Ray actor's method through ``.remote``, ``super()``, and a slime function handed to another as
a value (a callback).  :data:`BINDINGS` stands in for the one run it walks: the CPU default (the object-store weight
transport) with the given backend.  Three kinds of call are left out: what runs only every ``--eval-interval`` /
``--save-interval`` or in the first two steps (:data:`PERIODIC`), code of :data:`LEAVES` (the engines, the model,
the reward functions, generic helpers) and error paths (calls inside ``raise`` statements).

It prints the files in the order first entered, each with its level (0: the driver; ``k``: called into from a file of
level ``k - 1``, none of a lower one), how many times it was entered, and the totals: files entered, and *returns*
(entries into a file that had been entered before; ``per_function``: counted once per reading function).
``--tree`` prints the walk's functions, indented by call depth.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BACKENDS = {"fsdp": "slime.backends.fsdp.backend.FSDPBackend",
            "megatron": "slime.backends.megatron.backend.MegatronBackend"}
"""``--backend`` -> the class that a trainer rank's backend is."""

BINDINGS = {
    "slime.weight_sync.base.WeightTransport": "slime.weight_sync.object_store.ObjectStoreTransport",
}
"""Interface -> the implementation the CPU default runs (the backend's is added from :data:`BACKENDS`)."""

BACKEND_INTERFACES = ("slime.backends.step.StepBackend",)
"""The names a trainer rank's backend goes by in annotations (the protocol of the linear step)."""

PERIODIC = ("slime.rollout.manager.RolloutManager.evaluate", "slime.driver.save",
            "slime.checkpoints.layout.mark_latest", "slime.rollout.parity.EngineParityCheck.generate",
            "slime.rollout.parity.EngineParityCheck.compare")
"""What the loop runs only every ``--eval-interval`` / ``--save-interval`` steps, or in its first two steps (the
engine parity check)."""

LEAVES = ("slime.rollout.engines.", "slime.models.", "slime.rollout.rm_hub.math_reward.", "slime.rollout.rm_hub.geo3k.",
          "slime.rollout.rm_hub.deepscaler.", "slime.rollout.rm_hub.answer.", "slime.utils.")
"""Code the walk does not enter: the rollout engines (servers in their own actors), the model (``slime/models/``, as
transformers' model is for the FSDP backend), the reward functions (``--rm-type`` plug-ins, run in the scorer's worker
processes) and the generic helpers of ``slime/utils/`` (timers, metric logging, the registry)."""


@dataclasses.dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    names: dict[str, str]  # local name -> qualified name of a module, class or function (imports and definitions)


@dataclasses.dataclass
class Class:
    qualname: str
    module: Module
    node: ast.ClassDef
    bases: list[str]
    methods: dict[str, ast.FunctionDef]
    attrs: dict[str, tuple[ast.expr, bool]]  # attribute -> (its annotation, True) or (the value it is assigned, False)
    assigned_in: dict[str, ast.FunctionDef] = dataclasses.field(default_factory=dict)  # attribute -> the method


@dataclasses.dataclass
class Function:
    qualname: str
    module: Module
    node: ast.FunctionDef
    owner: Class | None = None  # the class it is read for (a method), for ``self``


class Index:
    """Every module of ``package`` under ``root``: its names, classes and functions."""

    def __init__(self, root: Path, package: str = "slime"):
        self.root = root
        self.modules: dict[str, Module] = {}
        self.classes: dict[str, Class] = {}
        self.functions: dict[str, Function] = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            self.modules[name] = Module(name, path, ast.parse(path.read_text(), filename=str(path)), {})
        for module in self.modules.values():
            self._read(module)

    def _read(self, module: Module) -> None:
        is_package = module.path.name == "__init__.py"
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.names[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.name.split(".") if is_package else module.name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    module.names[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                qualname = f"{module.name}.{node.name}"
                module.names[node.name] = qualname
                methods = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                assigned: dict[str, ast.FunctionDef] = {}
                attrs = {n.target.id: (n.annotation, True) for n in node.body
                         if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                for method in methods.values():
                    for n in ast.walk(method):
                        target, value = None, None
                        if isinstance(n, ast.AnnAssign):
                            target, value = n.target, (n.annotation, True)
                        elif isinstance(n, ast.Assign) and len(n.targets) == 1:
                            target, value = n.targets[0], (n.value, False)
                        pairs = [(target, value)]
                        if isinstance(target, ast.Tuple) and isinstance(n.value, ast.Tuple):
                            pairs = [(t, (v, False)) for t, v in zip(target.elts, n.value.elts)]
                        for target, value in pairs:
                            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                    and target.value.id == "self" and target.attr not in attrs):
                                attrs[target.attr] = value
                                assigned[target.attr] = method
                    if any(_decorator_name(d) == "property" for d in method.decorator_list):
                        attrs.setdefault(method.name, (method.returns, True))
                self.classes[qualname] = Class(qualname, module, node, [], methods, attrs, assigned)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{module.name}.{node.name}"
                module.names[node.name] = qualname
                self.functions[qualname] = Function(qualname, module, node)
        for cls in [c for c in self.classes.values() if c.module is module]:
            cls.bases = [q for b in cls.node.bases if (q := self.qualify(module, b)) in self.classes]

    def qualify(self, module: Module, expr: ast.expr) -> str | None:
        """The qualified name an expression names in ``module`` (a name or a dotted attribute of one)."""
        if isinstance(expr, ast.Name):
            return module.names.get(expr.id, f"{module.name}.{expr.id}")
        if isinstance(expr, ast.Attribute):
            base = self.qualify(module, expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    def method(self, cls: Class, name: str) -> tuple[Class, ast.FunctionDef] | None:
        """``name`` looked up along ``cls``'s slime base classes (depth first, as Python's MRO for single bases)."""
        return self._lookup(cls, name, "methods")

    def attribute(self, cls: Class, name: str) -> tuple[Class, tuple[ast.expr, bool]] | None:
        """The attribute ``name`` of ``cls`` (or of a slime base class), as :attr:`Class.attrs` holds it."""
        return self._lookup(cls, name, "attrs")

    def _lookup(self, cls: Class, name: str, table: str):
        if name in getattr(cls, table):
            return cls, getattr(cls, table)[name]
        for base in cls.bases:
            found = self._lookup(self.classes[base], name, table)
            if found:
                return found
        return None


def _decorator_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


@dataclasses.dataclass(frozen=True)
class Type:
    """A slime class, or a container (``list``, ``Iterator``, ``dict`` values ...) of one."""

    cls: str
    container: bool = False


_CONTAINERS = {"list", "List", "Sequence", "Iterator", "Iterable", "tuple", "set", "frozenset", "Generator"}


class Walk:
    """The walk itself (module docstring)."""

    def __init__(self, index: Index, bindings: dict[str, str], skip: tuple[str, ...] = PERIODIC + LEAVES):
        self.index, self.bindings, self.skip = index, bindings, skip
        self.seen: set[tuple[str, str | None]] = set()
        self.entries: list[tuple[str, int]] = []  # (file, level of the file it was entered from + 1)
        self.tree: list[tuple[int, str]] = []
        self.edges: list[tuple[str, str]] = []
        self.file_edges: set[tuple[str, str]] = set()  # (caller's file, callee's file)
        self.per_function = False

    # ---------------------------------------------------------------- types

    def bind(self, qualname: str | None) -> str | None:
        while qualname in self.bindings:
            qualname = self.bindings[qualname]
        return qualname

    def annotation(self, module: Module, expr: ast.expr | None) -> Type | None:
        """The type an annotation names (``X | None`` and ``Optional[X]`` as ``X``; containers of ``X``)."""
        if expr is None:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self.annotation(module, expr.left) or self.annotation(module, expr.right)
        if isinstance(expr, ast.Subscript):
            outer = self.index.qualify(module, expr.value) or ""
            args = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            last = outer.rsplit(".", 1)[-1]
            if last == "Optional":
                return self.annotation(module, args[0])
            if last in _CONTAINERS or last in ("dict", "Mapping"):
                inner = self.annotation(module, args[-1] if last in ("dict", "Mapping") else args[0])
                return None if inner is None else Type(inner.cls, True)
            return None
        name = self.bind(self.index.qualify(module, expr))
        return Type(name) if name in self.index.classes else None

    def expr_type(self, fn: Function, env: dict[str, Type], expr: ast.expr) -> Type | None:
        """What the walk knows of an expression's type inside ``fn``."""
        if isinstance(expr, ast.Name):
            if expr.id in ("self", "cls") and fn.owner is not None:
                return Type(fn.owner.qualname)
            return env.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.expr_type(fn, env, expr.value)
            if owner is None or owner.container or owner.cls not in self.index.classes:
                return None
            found = self.index.attribute(self.index.classes[owner.cls], expr.attr)
            if found is None:
                return None
            cls, (value, is_annotation) = found
            if is_annotation:
                return self.annotation(cls.module, value)
            method = cls.assigned_in.get(expr.attr)  # self.x = Cls(...), or = a typed parameter
            params = {} if method is None else {
                a.arg: t for a in [*method.args.args, *method.args.kwonlyargs]
                if (t := self.annotation(cls.module, a.annotation)) is not None}
            return self.expr_type(Function("", cls.module, method or fn.node, cls), params, value)
        if isinstance(expr, ast.Subscript):
            outer = self.expr_type(fn, env, expr.value)
            return Type(outer.cls) if outer is not None and outer.container else None
        if isinstance(expr, ast.Call):
            return self.call_type(fn, env, expr)
        if isinstance(expr, ast.ListComp):  # [Actor.options(...).remote(...) for ...]
            inner = self.expr_type(fn, env, expr.elt)
            return None if inner is None else Type(inner.cls, True)
        return None

    def call_type(self, fn: Function, env: dict[str, Type], call: ast.Call) -> Type | None:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in ("remote", "options"):  # a Ray actor's handle
            base = func.value
            while isinstance(base, ast.Call) or isinstance(base, ast.Attribute) and base.attr == "options":
                base = base.func if isinstance(base, ast.Call) else base.value
            name = self.bind(self.index.qualify(fn.module, base))
            if name in self.index.classes:
                return Type(name)
        for target in self.targets(fn, env, call):
            if target.node.name in ("__init__", "__post_init__") and target.owner is not None:
                return Type(target.owner.qualname)
            result = self.annotation(target.module, target.node.returns)
            if result is not None:
                return result
        name = self.bind(self.index.qualify(fn.module, call.func))
        return Type(name) if name in self.index.classes else None

    # ---------------------------------------------------------------- calls

    def targets(self, fn: Function, env: dict[str, Type], call: ast.Call) -> list[Function]:
        """The slime functions a call runs (empty when it reaches none, or none the walk can name)."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "remote":  # a Ray actor's method, or a remote function
            func = func.value
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and \
                isinstance(func.value.func, ast.Name) and func.value.func.id == "super" and fn.owner is not None:
            defining = next((c for c in self._mro(fn.owner) if fn.node in c.methods.values()), fn.owner)
            for base in defining.bases:
                found = self.index.method(self.index.classes[base], func.attr)
                if found:
                    return [Function(f"{found[0].qualname}.{func.attr}", found[0].module, found[1], fn.owner)]
            return []
        if isinstance(func, ast.Attribute):
            owner = self.expr_type(fn, env, func.value)
            if owner is not None and not owner.container and owner.cls in self.index.classes:
                found = self._method(self.index.classes[owner.cls], func.attr)
                if found:
                    return found
        called = self.expr_type(fn, env, func) if isinstance(func, (ast.Name, ast.Attribute)) else None
        if called is not None and not called.container and called.cls in self.index.classes:  # an instance's call
            return self._method(self.index.classes[called.cls], "__call__")
        return self.named(fn.module, func)

    def named(self, module: Module, expr: ast.expr) -> list[Function]:
        """The function or class (its constructor) an expression names."""
        qualname = self.bind(self.index.qualify(module, expr))
        if qualname in self.index.functions:
            return [self.index.functions[qualname]]
        if qualname in self.index.classes:
            cls = self.index.classes[qualname]
            return next((self._method(cls, name) for name in ("__init__", "__post_init__")
                         if self.index.method(cls, name)), [])
        if qualname is not None and "." in qualname:  # Class.method
            owner, _, attr = qualname.rpartition(".")
            if owner in self.index.classes:
                return self._method(self.index.classes[owner], attr)
        return []

    def _mro(self, cls: Class) -> list[Class]:
        out = [cls]
        for base in cls.bases:
            out += self._mro(self.index.classes[base])
        return out

    def _method(self, cls: Class, name: str) -> list[Function]:
        found = self.index.method(cls, name)
        if found is None:
            return []
        where, node = found
        return [Function(f"{where.qualname}.{name}", where.module, node, cls)]

    def calls(self, fn: Function) -> list[Function]:
        """The functions ``fn``'s body reaches, in source order, with the types of its locals tracked."""
        env: dict[str, Type] = {}
        args = fn.node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            t = self.annotation(fn.module, arg.annotation)
            if t is not None:
                env[arg.arg] = t
        found: list[Function] = []
        self._visit_body(fn, env, fn.node.body, found)
        return found

    def _visit_body(self, fn, env, body, found) -> None:
        for stmt in body:
            self._visit(fn, env, stmt, found)

    def _visit(self, fn, env, node, found) -> None:
        if isinstance(node, ast.Raise):
            return  # error paths
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not fn.node:
            inner = node.body if isinstance(node.body, list) else [node.body]
            self._visit_body(fn, dict(env), inner, found)  # a nested function is read where it is written
            return
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            children = [*node.generators, *children[: -len(node.generators)]]  # the loops bind before the element
        for child in children:
            self._visit(fn, env, child, found)
        if isinstance(node, ast.Call):
            targets = self.targets(fn, env, node)
            found += targets
            for arg in [*node.args, *(k.value for k in node.keywords)]:  # callbacks handed on
                if isinstance(arg, (ast.Name, ast.Attribute)) and not isinstance(arg.ctx, ast.Store):
                    callbacks = self._callbacks(fn, env, arg)
                    found += [f for f in callbacks if f.node.name not in ("__init__", "__post_init__", "__call__")]
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = [(node.targets[0], node.value)]
            if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts))
            for target, value in pairs:
                t = self.expr_type(fn, env, value) if isinstance(target, ast.Name) else None
                if t is not None:
                    env[target.id] = t
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            t = self.annotation(fn.module, node.annotation)
            if t is not None:
                env[node.target.id] = t
        elif isinstance(node, (ast.For, ast.comprehension)):
            for target, t in self._loop_targets(fn, env, node.target, node.iter):
                env[target] = t
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            t = self.expr_type(fn, env, node.context_expr)
            if t is not None:
                env[node.optional_vars.id] = Type(t.cls)

    def _callbacks(self, fn, env, arg) -> list[Function]:
        """The function a name or bound method handed to a call names (a local variable or attribute is none)."""
        if isinstance(arg, ast.Name):
            return [] if arg.id in env else self.named(fn.module, arg)
        owner = self.expr_type(fn, env, arg.value)
        if owner is not None and not owner.container and owner.cls in self.index.classes:
            found = self.index.method(self.index.classes[owner.cls], arg.attr)
            if found is None or any(_decorator_name(d) == "property" for d in found[1].decorator_list):
                return []  # an attribute, or a property read
            return self._method(self.index.classes[owner.cls], arg.attr)
        return self.named(fn.module, arg)

    def _loop_targets(self, fn, env, target, iterable) -> list[tuple[str, Type]]:
        """The names a ``for`` binds and their types: over a typed list, ``zip(...)`` and ``enumerate(...)``."""
        if isinstance(target, ast.Name):
            t = self.expr_type(fn, env, iterable)
            return [(target.id, Type(t.cls))] if t is not None and t.container else []
        if not (isinstance(target, ast.Tuple) and isinstance(iterable, ast.Call)
                and isinstance(iterable.func, ast.Name)):
            return []
        if iterable.func.id == "zip":
            pairs = zip(target.elts, iterable.args)
        elif iterable.func.id == "enumerate" and len(target.elts) == 2 and iterable.args:
            pairs = [(target.elts[1], iterable.args[0])]
        else:
            return []
        return [found for t, it in pairs for found in self._loop_targets(fn, env, t, it)]

    # ---------------------------------------------------------------- the walk

    def run(self, start: str) -> None:
        fn = self.index.functions[start]
        self.entries.append((str(fn.module.path.relative_to(self.index.root)), 0))
        self._read(fn, depth=0, level=0)

    def _read(self, fn: Function, depth: int, level: int) -> None:
        key = (fn.qualname, None if fn.owner is None else fn.owner.qualname)
        if key in self.seen:
            return
        self.seen.add(key)
        self.tree.append((depth, fn.qualname))
        here = str(fn.module.path.relative_to(self.index.root))
        opened: set[str] = set()  # the files this function's reading has entered: each is opened once for it
        for callee in self.calls(fn):
            if callee.qualname.startswith(self.skip):
                continue
            there = str(callee.module.path.relative_to(self.index.root))
            callee_key = (callee.qualname, None if callee.owner is None else callee.owner.qualname)
            if callee_key in self.seen:
                continue
            if there != here:
                self.file_edges.add((here, there))
                if there not in opened or not self.per_function:
                    self.entries.append((there, level + 1))
                    self.edges.append((fn.qualname, callee.qualname))
                    opened.add(there)
                self._read(callee, depth + 1, level + 1)
            else:
                self._read(callee, depth + 1, level)

    def summary(self) -> tuple[list[tuple[str, int, int]], int]:
        """``([(file, level, times entered)] in first-entry order, returns)``; a file's level is its distance from the
        driver in the graph of which file calls into which (0: the driver; 1: a file the driver calls into; ...)."""
        count: dict[str, int] = {}
        for path, _ in self.entries:
            count[path] = count.get(path, 0) + 1
        levels = {self.entries[0][0]: 0}
        frontier = [self.entries[0][0]]
        while frontier:  # breadth first from the driver
            frontier = [b for a, b in sorted(self.file_edges) if a in frontier and b not in levels]
            for path in frontier:
                levels.setdefault(path, min(levels[a] for a, b in self.file_edges if b == path and a in levels) + 1)
        files = [(path, levels[path], count[path]) for path in count]
        return files, len(self.entries) - len(files)


def walk_step(backend: str, root: Path = ROOT) -> Walk:
    """The walk of one rollout step with ``backend`` (a key of :data:`BACKENDS`)."""
    bindings = dict(BINDINGS)
    for name in BACKEND_INTERFACES:
        bindings[name] = BACKENDS[backend]
    walk = Walk(Index(root), bindings)
    walk.run("slime.driver.loop")
    return walk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="fsdp")
    parser.add_argument("--tree", action="store_true", help="print the functions read, indented by call depth")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository to walk (default: this one)")
    args = parser.parse_args(argv)
    walk = walk_step(args.backend, args.root)
    if args.tree:
        for depth, name in walk.tree:
            print("  " * depth + name)
    files, returns = walk.summary()
    for path, level, times in files:
        print(f"{level:3d} {times:3d}x  {path}")
    print(f"{args.backend}: {len(files)} files entered, {returns} returns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
