"""examples/cpu-demo.ipynb runs from top to bottom (it launches and stops its own demo fleet)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_cpu_demo_notebook_executes(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINESLAB_MODEL_CACHE", str(model_cache))
    notebook = nbformat.read(REPO / "examples" / "cpu-demo.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "examples")}})
    client.execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells
                      for o in cell.get("outputs", []))
    assert "chat(stream)=" in outputs, "the openai client got answers from every model"
    assert "TTFT measured for" in outputs and "shared memory left: []" in outputs, outputs[-2000:]
