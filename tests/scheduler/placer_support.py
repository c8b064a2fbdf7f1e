"""What the placer tests share: the committed profiles and H100s as the placer sees them."""

from __future__ import annotations

from pathlib import Path

from fineslab.scheduler.placement import GpuSpec
from fineslab.scheduler.profile_schema import load_profiles
from hypothesis import strategies as st

GIB = 1 << 30
PROFILES = load_profiles(Path(__file__).resolve().parents[2] / "profiles")
#: 90% of an 80 GiB H100: what the placer may fill.
H100_USABLE_BYTES = int(0.9 * 80 * GIB)


def h100s(num_gpus: int, memory_bytes: int = H100_USABLE_BYTES) -> list[GpuSpec]:
    return [GpuSpec(i, memory_bytes, "h100") for i in range(num_gpus)]


H100_PROFILES = sorted(name for name in PROFILES if name.endswith("--h100"))
#: (profile name, request rate per s, TTFT SLO s) of one model, for property tests.
demand_st = st.tuples(st.sampled_from(H100_PROFILES), st.floats(0.1, 30.0), st.floats(0.05, 8.0))
