"""Device spec table for the analytical (roofline) profiles.

Dense tensor-core peaks from NVIDIA's data sheets (SXM parts, no sparsity). `None` means the
device has no tensor-core path for that compute type; the roofline then falls back to FP16
(A100 has no FP8: SGLang serves FP8 checkpoints there as weight-only, computing in FP16).
Memory is the nominal capacity in bytes; what a placer may use is the caller's choice
(`GpuSpec.memory_bytes`), typically about 90% of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineslab.errors import ConfigError

TFLOP = 1e12
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    fp16_tflops: float
    fp8_tflops: float | None
    int8_tops: float | None
    hbm_bytes_per_s: float
    memory_bytes: int

    def peak_flops(self, compute_dtype: str) -> float:
        """Peak operations per second for GEMMs computed in `compute_dtype`."""
        table = {"fp16": self.fp16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops}
        if compute_dtype not in table:
            raise ConfigError(f"unknown compute dtype {compute_dtype!r}")
        peak = table[compute_dtype]
        return (peak if peak is not None else self.fp16_tflops) * TFLOP


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 989.0, 1979.0, 1979.0, 3.35e12, 80 * GIB),
    "h200": DeviceSpec("h200", 989.0, 1979.0, 1979.0, 4.8e12, 141 * GIB),
    "a100": DeviceSpec("a100", 312.0, None, 624.0, 2.039e12, 80 * GIB),
}


def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown device {name!r}; known: {sorted(DEVICES)}") from None
