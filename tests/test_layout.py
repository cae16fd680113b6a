"""The package's shape: no import cycles between modules (function-level imports included),
one registry of methods that every entry point reads, no machine's absolute path in the package's
files, benchmarks/ scripts all named on BENCHMARKS.md, and the lint configuration passes."""
import ast
import os
import re
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


ROOTS = (b"root", b"work", b"tmp", b"home", b"Users", b"mnt")
ABSOLUTE_PATH = re.compile(rb"(?<![\w.~-])/(?:" + b"|".join(ROOTS) + rb")/")


def _package_files():
    """The files under hsd_jax/ that git tracks or would commit (not ignored), e.g. a drafter just shipped;
    every file there but caches where git is absent."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard", "hsd_jax"], cwd=ROOT,
                             capture_output=True, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "hsd_jax"))
                 if "__pycache__" not in d for f in fs]
    return files


def test_no_absolute_path_in_the_package():
    """Shipped files (sources, drafters' Orbax checkpoints, model cards, data) name no directory of the
    machine that wrote them: Orbax's commit marker did (`save_drafter` and `ship` now leave it out)."""
    files = _package_files()
    assert any(f.endswith("drafter.json") for f in files)
    hits = []
    for f in files:
        path = os.path.join(ROOT, f)
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                data = fh.read()
            m = any(b"/" + r + b"/" in data for r in ROOTS) and ABSOLUTE_PATH.search(data)  # substring test first: fast
            if m:
                hits.append(f"{f}: {m.group().decode()}")
    assert not hits, hits
    assert ABSOLUTE_PATH.search(b"Checkpoint commit was successful to /work/main/runs/x/params")


def test_every_benchmark_script_is_named_on_the_page():
    """benchmarks/ keeps at most 12 scripts, each reproducing a table that BENCHMARKS.md names it by."""
    bench = os.path.join(ROOT, "benchmarks")
    scripts = sorted(f for f in os.listdir(bench) if f.endswith((".py", ".sh")))
    page = open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
    assert 0 < len(scripts) <= 12, scripts
    assert [s for s in scripts if f"benchmarks/{s}" not in page] == []
