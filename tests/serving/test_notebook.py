"""examples/cpu-demo.ipynb runs from top to bottom (it launches and stops its own demo fleet)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _execute(name: str, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run examples/`name` top to bottom; the text of all its outputs."""
    monkeypatch.setenv("FINESLAB_MODEL_CACHE", str(model_cache))
    notebook = nbformat.read(REPO / "examples" / name, as_version=4)
    client = NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "examples")}})
    client.execute()
    return "".join(o.get("text", "") for cell in notebook.cells
                   for o in cell.get("outputs", []))


def test_cpu_demo_notebook_executes(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = _execute("cpu-demo.ipynb", model_cache, monkeypatch)
    assert "chat(stream)=" in outputs, "the openai client got answers from every model"
    assert "TTFT measured for" in outputs and "shared memory left: []" in outputs, outputs[-2000:]


def test_cpu_elastic_notebook_serves_five_models_in_room_for_three(
        model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #16's fleet test and notebook in one: five tiny models, weight room for three awake,
    served round-robin by the `openai` client; every request answered, wakes evict LRU models,
    idle models fall asleep, `ctl limit` round-trips, and nothing is left after the stop."""
    outputs = _execute("cpu-elastic.ipynb", model_cache, monkeypatch)
    assert outputs.count("weight slab(s) back to the arena") == 2, \
        f"two of the five start asleep: {outputs[:3000]}"
    assert "answered 15 of 15 requests" in outputs, outputs[-4000:]
    evictions = int(outputs.split("evictions in all: ")[1].split()[0])
    assert evictions >= 2, f"round-robin over 5 models in room for 3 must evict: {outputs[-2000:]}"
    assert "all asleep:" in outputs and "KV limit 4.00 MiB per runtime" in outputs, outputs[-4000:]
    assert "shared memory left: [] host copies left: []" in outputs, outputs[-2000:]
