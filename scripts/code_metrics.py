"""Shape metrics of the core packages (issues 13, 26 and 33).

    .venv/bin/python scripts/code_metrics.py [PKG ...]     (default: hicache api kernels)

- library modules: the ``.py`` files of the packages, ``__init__`` not counted;
  top-level modules: those directly in ``hicache/`` (``__init__`` not counted);
- modules, layers: the modules of the packages (``__init__`` counted) and the depth of their import
  graph (module-level imports; a module's layer is one more than the highest
  layer it imports; an import cycle counts as one node);
- import cycles: groups of modules that import each other, counting every
  import: module-level, inside functions, under ``if TYPE_CHECKING:`` (an
  annotation is a dependency too), and the package ``__init__`` that importing
  a submodule runs;
- upward imports: an import inside a function or under ``TYPE_CHECKING`` of a
  module at a lower layer than the module it imports (a deferred import that
  climbs the layering). An entry point (``ENTRY_POINTS``: the CLI) sits on top
  by its role; it defers its imports only to start fast, so they count as
  module-level ones;
- folder upward imports: an import (of any kind, as for cycles) from one folder
  (plane) into a folder declared above it in ``PLANES``; a plane may import only
  the planes listed before it. A folder missing from ``PLANES`` is reported too;
- module docstrings: those over ``MAX_DOCSTRING_LINES`` lines, and those that carry
  history or bench figures (``HISTORY`` / ``FIGURE`` patterns; figures go to bench/RESULTS.md);
- largest file: lines of a ``.py`` file;
- longest function: ``end_lineno - lineno + 1`` of a def (decorators excluded);
  functions over ``MAX_FUNCTION_LINES`` are listed, except those in
  ``LONG_FUNCTION_EXCEPTIONS`` (the Triton kernel, whose length is its clarity);
- upward calls: (a) hook parameters a constructor accepts (``on_*`` that is
  not a ``bool``: ``on_insert``, ``on_l3_stored``; or a listener:
  ``listener``, ``*_listener``, ``*_hook``), (b) call sites of such a hook
  (``x.on_insert(...)``, ``self.listener.pages_stored(...)``), and
  (c) completion closures: a nested ``def`` handed to a call as ``on_done=``
  (or any ``on_*=`` keyword). Events are pulled instead (``take_events()``).

``kernels/`` and ``api/`` import as ``hicache.kernels`` / ``hicache.api`` (the
``__path__`` remap in ``hicache/__init__.py``), and are named so here.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys

MAX_FUNCTION_LINES = 60
MAX_DOCSTRING_LINES = 15
# History and bench figures in a module docstring (they belong in git log and bench/RESULTS.md).
HISTORY = re.compile(r"\b(issues? \d+|round \d+|(?:turn|session) \d+|used to|previously|was \d)", re.I)
FIGURE = re.compile(r"\d[\d.,]*\s?(?:ms|us|µs|ns|GB/s|MB/s|GiB/s|TB/s)(?![\w/])")
# "file:function" allowed over MAX_FUNCTION_LINES (the issue allows the Triton kernel).
LONG_FUNCTION_EXCEPTIONS = {"kernels/_triton_copy.py:_page_copy_kernel"}
_REMAP = {"kernels": "hicache.kernels", "api": "hicache.api"}
# The CLI and what only the CLI runs: the pre-start checks (they import what serve
# and replay would, to refuse the same settings) and the storage admin commands.
ENTRY_POINTS = {"hicache.cli", "hicache.runtime_check", "hicache.storage.admin_cli", "hicache.storage.admin"}
_ROOT = "hicache"  # its __init__ imports nothing of its own at module level: not an edge
# The planes, bottom first (docs/architecture.md): each may import only those before it.
# ``hicache`` itself stands for the modules directly in hicache/ (the CLI and its checks).
PLANES = ("hicache.core", "hicache.memory", "hicache.kernels", "hicache.transfer", "hicache.index",
          "hicache.client", "hicache.storage", "hicache.tiers", "hicache.cache", "hicache.connector",
          "hicache.node",
          "hicache.integrations", "hicache.reference", "hicache.api", "hicache")


def is_hook_name(name: str) -> bool:
    """A constructor parameter or attribute that names a callback into the caller."""
    return name.startswith("on_") or name == "listener" or name.endswith(("_listener", "_hook")) or name == "hook"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] in _REMAP:
        parts[0] = _REMAP[parts[0]]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, mod: str, is_pkg: bool, known: set[str]) -> list[tuple[str, bool, int]]:
    """``(imported module, deferred, line)`` for each import of a known module;
    deferred: inside a function or under ``if TYPE_CHECKING:``."""
    out: list[tuple[str, bool, int]] = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and _is_type_checking(child))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for t in targets:
                r = resolve(t)
                while r is not None and r != mod:  # the module and the packages it runs on the way
                    if r != _ROOT and not mod.startswith(r + "."):
                        out.append((r, in_func, child.lineno))
                    r = r.rpartition(".")[0] or None
            visit(child, inner)

    visit(tree, False)
    return out


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Layer of each module: 0 for a module importing nothing known, else 1 + the
    highest layer it imports (modules of one cycle share a layer)."""
    comp_of = {m: i for i, c in enumerate(_sccs(graph)) for m in c}
    comps: dict[int, set[str]] = {}
    for m, i in comp_of.items():
        comps.setdefault(i, set()).add(m)
    memo: dict[int, int] = {}

    def layer(i: int) -> int:
        if i not in memo:
            deps = {comp_of[t] for m in comps[i] for t in graph[m]} - {i}
            memo[i] = 1 + max((layer(d) for d in deps), default=-1)
        return memo[i]

    sys.setrecursionlimit(10000)
    return {m: layer(comp_of[m]) for m in graph}


def import_graph(paths: list[pathlib.Path], root: pathlib.Path | None = None) -> dict:
    """``root``: the repository root the paths are under (module names are relative to it)."""
    mods = {module_name(p if root is None else p.relative_to(root)): p for p in paths}
    known = set(mods)
    top: dict[str, set[str]] = {m: set() for m in known}
    every: dict[str, set[str]] = {m: set() for m in known}
    lazy: list[tuple[str, str, int]] = []
    for m, p in mods.items():
        for t, in_func, line in _imports(ast.parse(p.read_text()), m, p.name == "__init__.py", known):
            every[m].add(t)
            if in_func and m not in ENTRY_POINTS:
                lazy.append((m, t, line))
            else:
                top[m].add(t)
    layers = _layers(top)
    top_mods = sorted(m for m, p in mods.items()
                      if p.name != "__init__.py" and m.count(".") == 1 and m.startswith(_ROOT + "."))
    cycles = [c for c in _sccs(every) if len(c) > 1]
    upward = sorted({f"{mods[m]}:{line} {m} (layer {layers[m]}) -> {t} (layer {layers[t]})"
                     for m, t, line in lazy if layers[t] > layers[m]})
    return {"modules": len(known), "layers": 1 + max(layers.values(), default=-1),
            "cycles": cycles, "upward_imports": upward, "layer_of": layers,
            "boundary_imports": boundary_violations(every), "folder_upward": folder_upward(every, top_mods),
            "library_modules": sum(p.name != "__init__.py" for p in mods.values()), "top_modules": top_mods}


def folder_upward(every: dict[str, set[str]], top: list[str]) -> list[str]:
    """Edges of the folder graph that climb: ``plane -> plane above (importer, ...)``, one
    line per pair of planes; an import from or into a folder not in ``PLANES`` counts too.
    ``top``: the modules directly in hicache/ (they are the plane ``hicache``)."""
    def plane(mod: str) -> str:
        return _ROOT if mod == _ROOT or mod in top else ".".join(mod.split(".")[:2])

    rank = {p: i for i, p in enumerate(PLANES)}
    edges: dict[tuple[str, str], set[str]] = {}
    for m, ts in every.items():
        for t in ts:
            a, b = plane(m), plane(t)
            if a != b and rank.get(b, len(PLANES)) >= rank.get(a, -1):
                edges.setdefault((a, b), set()).add(m)
    return [f"{a} -> {b} ({', '.join(sorted(ms))})" for (a, b), ms in sorted(edges.items())]


# Folder boundaries (docs/architecture.md): the reference engine is never imported by
# the library (only by the CLI that runs it), and the core never imports the REST surface.
BOUNDARIES = (("hicache.reference", "the reference engine package"), ("hicache.api", "the REST surface"))


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def boundary_violations(every: dict[str, set[str]]) -> list[str]:
    """Imports that cross a folder boundary: ``importer -> imported (what it is)``."""
    return sorted(f"{m} -> {t} ({what})" for m, ts in every.items() for t in ts for pkg, what in BOUNDARIES
                  if _inside(t, pkg) and not _inside(m, pkg) and m not in ENTRY_POINTS)


def scan(paths: list[pathlib.Path], root: pathlib.Path | None = None) -> dict:
    files, funcs, hooks, hook_calls, closures = [], [], [], [], []
    long_docs, doc_history = [], []
    for full in paths:
        src = full.read_text()
        path = full if root is None else full.relative_to(root)  # as named in reports and exceptions
        files.append((src.count("\n"), str(path)))
        tree = ast.parse(src)
        doc = ast.get_docstring(tree, clean=False) or ""
        if doc.strip().count("\n") + 1 > MAX_DOCSTRING_LINES:
            long_docs.append(f"{path} ({doc.strip().count(chr(10)) + 1} lines)")
        found = [m.group(0) for pat in (HISTORY, FIGURE) for m in pat.finditer(doc)]
        if found:
            doc_history.append(f"{path}: {', '.join(found[:3])}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}",
                               f"{path}:{node.name}"))
                nested = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n is not node}
                for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                    for kw in call.keywords:
                        if (kw.arg or "").startswith("on_") and isinstance(kw.value, ast.Name) \
                                and kw.value.id in nested:
                            closures.append(f"{path}:{call.lineno} {kw.arg}={kw.value.id}")
                if node.name == "__init__":
                    args = node.args.args + node.args.kwonlyargs
                    for a in args:
                        if is_hook_name(a.arg) and not (isinstance(a.annotation, ast.Name)
                                                        and a.annotation.id == "bool"):
                            hooks.append(f"{path}:{node.lineno} {a.arg}")
            if isinstance(node, ast.Call):
                hook = _hook_call(node)
                if hook is not None:
                    hook_calls.append(f"{path}:{node.lineno} {hook}")
    closures = sorted(set(closures))
    long_funcs = sorted(((n, where) for n, where, key in funcs
                         if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTION_EXCEPTIONS), reverse=True)
    return {"largest_file": max(files), "longest_function": max(f[:2] for f in funcs),
            "long_functions": long_funcs, "long_docstrings": sorted(long_docs), "docstring_history": doc_history,
            "hook_params": hooks, "hook_calls": hook_calls, "closures": closures,
            "upward_calls": len(hook_calls) + len(closures), **import_graph(paths, root)}


def _hook_call(call: ast.Call) -> str | None:
    """``.on_x()`` or ``.listener.y()`` (a call through a hook attribute), else None.
    ``super().on_x()`` is an override chaining to its base class (a framework's callback
    method), not a hook."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return None
    chains = isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) and f.value.func.id == "super"
    if f.attr.startswith("on_") and f.attr != "on_done" and not chains:
        return f".{f.attr}()"
    if isinstance(f.value, ast.Attribute) and is_hook_name(f.value.attr):
        return f".{f.value.attr}.{f.attr}()"
    return None


def source_paths(pkgs: list[str], root: pathlib.Path | None = None) -> list[pathlib.Path]:
    return sorted(p for pkg in pkgs for p in (pathlib.Path(pkg) if root is None else root / pkg).rglob("*.py"))


def main(argv: list[str]) -> None:
    pkgs = argv or ["hicache", "api", "kernels"]
    m = scan(source_paths(pkgs))
    print(f"library modules:  {m['library_modules']} (__init__ not counted)")
    print(f"top-level:        {len(m['top_modules'])} directly in hicache/  {m['top_modules']}")
    print(f"modules:          {m['modules']} in {m['layers']} layers")
    print(f"import cycles:    {len(m['cycles'])}")
    for c in m["cycles"]:
        print(f"    {' <-> '.join(c)}")
    print(f"upward imports:   {len(m['upward_imports'])}")
    for u in m["upward_imports"]:
        print(f"    {u}")
    print(f"folder upward:    {len(m['folder_upward'])} (folder-graph edges into a plane above, PLANES order)")
    for u in m["folder_upward"]:
        print(f"    {u}")
    print(f"boundary imports: {len(m['boundary_imports'])}")
    for b in m["boundary_imports"]:
        print(f"    {b}")
    print(f"largest file:     {m['largest_file'][0]} lines  {m['largest_file'][1]}")
    print(f"longest function: {m['longest_function'][0]} lines  {m['longest_function'][1]}")
    print(f"functions over {MAX_FUNCTION_LINES} lines (exceptions: {sorted(LONG_FUNCTION_EXCEPTIONS)}): "
          f"{len(m['long_functions'])}")
    for n, where in m["long_functions"]:
        print(f"    {n} lines  {where}")
    print(f"module docstrings over {MAX_DOCSTRING_LINES} lines: {len(m['long_docstrings'])}")
    for d in m["long_docstrings"]:
        print(f"    {d}")
    print(f"module docstrings with history or bench figures: {len(m['docstring_history'])}")
    for d in m["docstring_history"]:
        print(f"    {d}")
    print(f"hook parameters:  {len(m['hook_params'])}  {m['hook_params']}")
    print(f"hook call sites:  {len(m['hook_calls'])}  {m['hook_calls']}")
    print(f"closures:         {len(m['closures'])}  {m['closures']}")
    print(f"upward calls (hook call sites + completion closures): {m['upward_calls']}")


if __name__ == "__main__":
    main(sys.argv[1:])
