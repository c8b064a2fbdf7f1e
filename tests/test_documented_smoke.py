"""The quick form of documented commands that no other test ran (#39), each for real: a child
`python -m ...` with the docs' arguments, its output in a temporary folder. Each costs a few
seconds (no SGLang); tests/documented_commands.toml names them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

#: A figure's acceptance keys (some of them) in its JSON line.
FIGURE_KEYS = {
    "fig10": {"fineslab_attainment", "prism_attainment", "static_attainment", "fineslab_tok_s"},
    "fig11": {"fineslab_attainment_8gpus", "fineslab_attainment_16gpus",
              "static_attainment_8gpus"},
    "fig12": {"mme-placer_req_s", "kvpr-placer_req_s"},
    "fig13": {"fineslab_attainment_rate2_slo3", "prism_attainment_rate2_slo3"},
}


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
    return done.stdout


def _json_line(stdout: str) -> dict[str, Any]:
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict), f"the last line is the JSON object: {stdout[-500:]}"
    return figures


@pytest.mark.parametrize("figure", ["fig10", "fig11", "fig12", "fig13"])
def test_a_simulator_figure_runs_in_its_quick_form(figure: str, tmp_path: Path) -> None:
    # docs/evaluation.md: python -m fineslab.sim fig10 --quick --json --out docs/results/...
    figures = _json_line(_run("fineslab.sim", figure, "--quick", "--json",
                              "--out", str(tmp_path)))
    assert FIGURE_KEYS[figure] <= set(figures), f"{figure}: {sorted(figures)}"
    assert all(0 <= v <= 1 for k, v in figures.items() if "attainment" in k), figures
    assert (tmp_path / f"{figure}.md").stat().st_size > 0, "the report is written"


def test_the_elastic_simulation_runs_in_its_quick_form(tmp_path: Path) -> None:
    # docs/evaluation.md: python -m fineslab.sim elastic --rate 1 --json --out ... (the full
    # run), here --quick with 10 s of arrivals (about 4 s)
    from fineslab.sim.experiments.elastic import SYSTEM_NAMES, WORKLOADS

    figures = _json_line(_run("fineslab.sim", "elastic", "--quick", "--rate", "1",
                              "--duration", "10", "--json", "--out", str(tmp_path)))
    assert set(figures) == {f"{s}_{w}_s0_gpus_for_99" for s in SYSTEM_NAMES for w in WORKLOADS}
    assert all(v >= 1 for v in figures.values()), "every system needs a GPU at least"
    assert (tmp_path / "elastic.md").stat().st_size > 0


def test_profile_analytical_writes_the_committed_profiles(tmp_path: Path) -> None:
    # docs/scheduling.md: python -m fineslab.profile analytical --out profiles
    _run("fineslab.profile", "analytical", "--out", str(tmp_path))
    written = sorted(tmp_path.glob("*.json"))
    assert len(written) >= 20, f"a profile per model, precision and device: {written}"
    for path in written:
        committed = REPO / "profiles" / path.name
        assert committed.is_file(), f"{path.name} is written but not committed in profiles/"
        assert json.loads(path.read_text()) == json.loads(committed.read_text()), (
            f"profiles/{path.name} is not what the documented command writes")
