"""The experiment plumbing: one sweep point per system, reports with tables and plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from fineslab.sim.config import SYSTEMS, SimConfig
from fineslab.sim.experiments.common import (
    MixEntry,
    PointSpec,
    Traces,
    fleet_models,
    gpus_for,
    run_point,
)
from fineslab.sim.experiments.fig10 import FIG10_MIX
from fineslab.sim.experiments.report import ATTAINMENT, TOKENS, sweep_section
from fineslab.sim.simulator import place
from fineslab.workload import AZURE_CONV, SHAREGPT_STATS

TRACES = Traces(SHAREGPT_STATS, AZURE_CONV)
MIX = (MixEntry("llama-3.1-8b", "fp16", 1.0), MixEntry("llama-3.1-8b", "fp8", 1.0))


def test_a_point_runs_every_system_on_the_same_requests() -> None:
    spec = PointSpec(MIX, 1, 20.0, 2.0, "poisson", 8.0, seed=0)
    systems = [SYSTEMS["fineslab"], SYSTEMS["prism"], SYSTEMS["static"]]
    points = run_point(spec, systems, TRACES, SimConfig())
    assert [p.system for p in points] == ["fineslab", "prism", "static"]
    assert len({p.num_requests for p in points}) == 1, "one workload for every system"
    for point in points:
        assert 0.0 <= point.attainment <= 1.0 and point.tokens_per_s > 0
        assert set(point.by_model) == {"llama-3.1-8b-fp16", "llama-3.1-8b-fp8"}


def test_replay_point_uses_the_azure_trace() -> None:
    spec = PointSpec(MIX, 1, 20.0, 2.0, "replay", 8.0, seed=0)
    (point,) = run_point(spec, [SYSTEMS["fineslab"]], TRACES, SimConfig())
    assert point.num_requests > 0 and point.attainment > 0


def test_sweep_section_writes_a_table_and_a_plot(tmp_path: Path) -> None:
    specs = [PointSpec(MIX, 1, 20.0, r, "poisson", 5.0) for r in (1.0, 2.0)]
    points = [p for s in specs for p in run_point(s, [SYSTEMS["fineslab"]], TRACES,
                                                  SimConfig())]
    text = sweep_section("demo", points, "rate_scale", [ATTAINMENT, TOKENS], tmp_path, "demo")
    assert "| rate_scale | fineslab SLO attainment | fineslab tokens/s |" in text
    assert text.count("\n| 1.0 |") + text.count("\n| 2.0 |") == 2, "one row per rate"
    assert (tmp_path / "demo.png").stat().st_size > 1000, "a real PNG"


def test_the_placer_is_told_the_simulated_interference() -> None:
    # Issue 7's fig10 gap: told nothing, MME stacked three replicas on GPU 1 (70B FP8 TP2
    # shard, 8B FP8, 8B AWQ), whose steps the simulator then slowed by 1.4x-1.6x.
    spec = PointSpec(FIG10_MIX, 4, 20.0, 8.0, "poisson", 60.0)
    models = fleet_models(spec, TRACES)

    def most_per_gpu(placer: str, interference: float) -> int:
        config = SimConfig(interference_per_neighbor=interference)
        plan = place(models, gpus_for(spec, config), placer, config)
        return max(len(plan.replicas_on(g.gpu_id)) for g in plan.gpus)

    assert most_per_gpu("mme", 0.0) == 3, "factor 0: the paper's memory-only placement"
    for placer in ("mme", "static"):
        assert most_per_gpu(placer, 0.2) == 2, f"{placer} spreads once told the factor"


def test_the_elastic_experiment_reports_every_system_workload_and_seed(tmp_path: Path) -> None:
    from fineslab.sim.experiments.elastic import (
        SYSTEM_NAMES,
        WORKLOADS,
        ElasticExpConfig,
        run_elastic,
    )

    cfg = ElasticExpConfig(tmp_path, TRACES, quick=True, duration_s=20.0, seeds=(0,),
                           num_models=4, max_gpus=1, rate_per_s=1.0)
    acceptance, text = run_elastic(cfg, SimConfig())
    assert set(acceptance) == {f"{s}_{w}_s0_gpus_for_99" for s in SYSTEM_NAMES
                               for w in WORKLOADS}
    assert "### bursty, seed 0" in text and "### steady, seed 0" in text
    assert "| 1 |" in (tmp_path / "elastic.md").read_text()


def test_the_help_of_the_simulator_and_each_of_its_commands_prints(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Issue #39: `python -m fineslab.sim --help` crashed on the "99%" of a command's help.
    from fineslab.sim.__main__ import COMMANDS, build_parser

    for argv in (["--help"], *([name, "--help"] for name in COMMANDS)):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(argv)
        assert done.value.code == 0, argv
        assert "usage: python -m fineslab.sim" in capsys.readouterr().out, argv
