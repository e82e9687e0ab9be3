"""Shape metrics of the core packages (issue 13): largest file, longest function, upward calls.

    .venv/bin/python scripts/code_metrics.py [PKG ...]     (default: hicache api)

- largest file: lines of a ``.py`` file;
- longest function: ``end_lineno - lineno + 1`` of a def (decorators excluded);
- upward calls: (a) hook parameters a constructor accepts (``on_*`` with a
  callable default of ``None``: ``on_insert``, ``on_device_evict``,
  ``on_share``), (b) call sites of such a hook (``x.on_insert(...)``), and
  (c) completion closures: a nested ``def`` handed to a call as ``on_done=``
  (or any ``on_*=`` keyword).
"""
from __future__ import annotations

import ast
import pathlib
import sys


def scan(paths: list[pathlib.Path]) -> dict:
    files, funcs, hooks, hook_calls, closures = [], [], [], [], []
    for path in paths:
        src = path.read_text()
        files.append((src.count("\n"), str(path)))
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
                nested = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n is not node}
                for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                    for kw in call.keywords:
                        if (kw.arg or "").startswith("on_") and isinstance(kw.value, ast.Name) \
                                and kw.value.id in nested:
                            closures.append(f"{path}:{call.lineno} {kw.arg}={kw.value.id}")
                if node.name == "__init__":
                    args = node.args.args + node.args.kwonlyargs
                    for a in args:
                        if a.arg.startswith("on_") and not (isinstance(a.annotation, ast.Name)
                                                            and a.annotation.id == "bool"):
                            hooks.append(f"{path}:{node.lineno} {a.arg}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr.startswith("on_") and node.func.attr != "on_done":
                hook_calls.append(f"{path}:{node.lineno} .{node.func.attr}()")
    closures = sorted(set(closures))
    return {"largest_file": max(files), "longest_function": max(funcs),
            "hook_params": hooks, "hook_calls": hook_calls, "closures": closures,
            "upward_calls": len(hook_calls) + len(closures)}


def main(argv: list[str]) -> None:
    pkgs = argv or ["hicache", "api"]
    paths = sorted(p for pkg in pkgs for p in pathlib.Path(pkg).rglob("*.py"))
    m = scan(paths)
    print(f"largest file:     {m['largest_file'][0]} lines  {m['largest_file'][1]}")
    print(f"longest function: {m['longest_function'][0]} lines  {m['longest_function'][1]}")
    print(f"hook parameters:  {len(m['hook_params'])}  {m['hook_params']}")
    print(f"hook call sites:  {len(m['hook_calls'])}  {m['hook_calls']}")
    print(f"closures:         {len(m['closures'])}  {m['closures']}")
    print(f"upward calls (hook call sites + completion closures): {m['upward_calls']}")


if __name__ == "__main__":
    main(sys.argv[1:])
