"""Every notebook runs top to bottom on CPU with the small-size switch (HSD_NOTEBOOK_SMALL=1)."""
import importlib.util
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")))
def test_notebook_runs_top_to_bottom(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HSD_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # the kernel's scratch folders (tempfile.mkdtemp) go with the test's
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs must be stripped in git"
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    # with no TPU here, the TPU cell compiles the notebook's programs for a v5e instead (libtpu: test extra)
    if importlib.util.find_spec("libtpu") and any('"--tpu", "v5e:2x2"' in c.source for c in nb.cells):
        printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert "every program compiled for TPU v5e" in printed, printed[-3000:]
