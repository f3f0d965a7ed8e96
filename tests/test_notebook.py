"""The Colab notebook runs top to bottom (on CPU, small settings), so it cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "ee_jax_colab.ipynb"


@pytest.mark.real_model
@pytest.mark.slow
def test_colab_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("EE_JAX_NOTEBOOK_SMALL", "1")
    # the real model's programs compile optimised in the kernel too (tests/conftest.py)
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "backend:" in outputs and "early exit" in outputs
    assert "pages in use now: 0" in outputs
