"""The load generator: requests sent at their arrival times to an OpenAI-compatible endpoint,
each measured (TTFT, TPOT, ITL, E2E, SLO met or not).

`run.run_benchmark` sends a workload and returns one outcome per request; `client` streams one
request; `metrics` summarises outcomes (quantiles, throughput, attainment, goodput); `prompts`
builds a prompt of a given token length; `plots` draws TTFT CDF and timeline. The command line
is `python -m fineslab.bench.serve`; the profiler and the simulator's fidelity check use it
too, which is why it sits below both (docs/structure.md).
"""
