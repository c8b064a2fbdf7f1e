"""The profiler: writes `profiles/<model>--<precision>--<device>.json`.

`python -m fineslab.profile analytical` writes the roofline profiles of the paper's models
(pure Python, `fineslab.scheduler.roofline`); `python -m fineslab.profile measure` drives a real
SGLang runtime on this machine (`fineslab.profile.measure`, the only module of the scheduling
work that imports sglang, and only when run); `measure --via http` probes a launched one-model
fleet through its router instead (`fineslab.profile.measure_http`, written as
`<model>--<precision>--<device>-http.json`: the profile the fidelity check simulates with).
"""
