"""The package's shape: no import cycles between modules (function-level imports included),
one registry of methods that every entry point reads, and the lint configuration passes."""
import ast
import os
import subprocess
import sys

from hsd_jax import methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_imports():
    graph = {}
    for pkg in ("hsd_jax", "pallas_kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                deps = set()
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                        deps.add(node.module)
                        deps.update(f"{node.module}.{a.name}" for a in node.names)
                    elif isinstance(node, ast.Import):
                        deps.update(a.name for a in node.names)
                graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _module_imports()
    assert "hsd_jax.api" in graph and "hsd_jax.methods.hsd" in graph
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if m in ("hsd_jax", "pallas_kernels"):  # the top-level facades re-export; Python runs them first
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_every_method_is_registered_once_and_complete():
    from hsd_jax.bench import METHOD_NAMES
    from hsd_jax.cli import build_parser

    assert methods.METHODS == ("ar",) + tuple(methods.REGISTRY)
    for name, m in methods.REGISTRY.items():
        assert m.name == name and callable(m.init) and callable(m.draft) and callable(m.update)
        assert m.drafts in ("tree", "chain")
    assert set(methods.METHODS) <= set(METHOD_NAMES)
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    method_arg = next(a for a in gen._actions if a.dest == "method")
    assert tuple(method_arg.choices) == methods.METHODS


def test_ruff_passes_on_the_whole_tree():
    """pyproject.toml's [tool.ruff] rules (syntax errors, pyflakes, import order) hold everywhere."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
