"""QoQ W4A8 (QServe, arXiv 2405.04532): progressive group quantization of linear weights,
per-token INT8 activations, and a reference W4A8 linear in plain torch.

Glossary
    W        a linear layer's weight [N, K] (out, in), as HF stores it; bf16, fp16 or fp32
    G        group size along K (QServe's 128): K % G == 0, G even
    P        the protective range, 119: level-1 codes lie in [-P, P] (why: below)
    s1       level-1 scale, one per output channel, float [N]:  s1[n] = max_k |W[n, k]| / P
    v        level-1 code, an integer in [-P, P]:              v = round(W / s1)
    s2, z    level-2 scale and zero point of one group of G codes v, small integers
    q        level-2 code, 4-bit unsigned 0..15:               q = r(v / s2) + z
    r(a/b)   floor(a / b + 1/2), computed exactly on integers (round half up)
    x        activations [T, K]; s_x[t] = max_k |x[t, k]| / 127, x_q = round(x / s_x) in int8

Layout of a `QoQWeight`
    packed [N, K / 2] uint8   byte j of row n: low nibble q[n, 2j], high nibble q[n, 2j + 1]
                              (the order of the KV4 cache, `fineslab.quant.kv4`)
    s2     [N, K / G] uint8   1..16
    z      [N, K / G] int8    |z * s2| <= 127
    s1     [N] float16 (QServe's choice, `QoQConfig.s1_dtype`) or float32

Invariants (every group of every row; `QoQWeight.check_integrity` checks the stored part)
    s2 = max(1, ceil((max v - min v) / 15)),   z = -r(min v / s2)
    0 <= q <= 15                     r is monotone and r(a + 15) = r(a) + 15, so no clamp
    v_hat = (q - z) * s2 = r(v / s2) * s2,     |v_hat - v| <= s2 / 2 <= 8
    -127 <= v_hat <= 127,  -127 <= z * s2 <= 127,  q * s2 <= 240    (INT8 / UINT8, exactly)
    W_hat[n, k] = v_hat[n, k] * s1[n]
    y[t, n] = s_x[t] * s1[n] * sum_k x_q[t, k] * v_hat[n, k]   (the sum in INT32: exact while
                                                                 K * 127 * 127 < 2**31)

Why P = 119 (QServe's "protective range"). Level 2 rounds each code to the nearest multiple
of s2, so v_hat may overshoot the group's extreme codes by up to s2 / 2. A group spans at most
2P codes, so s2 <= ceil(2P / 15), and P + ceil(2P / 15) / 2 <= 127 keeps every v_hat inside
INT8: P = 119 gives s2 <= 16 and 119 + 8 = 127 (the test checks all 28,680 spans and every
code in them; the largest |v_hat| is 126). One more code breaks it: P = 120 and the span
[-120, 120] give s2 = 16 and 120 -> 128; plain symmetric INT8 (P = 127) and the span
[-127, 24] give s2 = 11 and -127 -> -132. So 119 is the largest safe range. It costs
127 / 119, about 0.1 bit of level-1 resolution, and buys a level-2 dequantization that is pure
INT8 arithmetic on the GPU: q * s2 fits UINT8 and the pre-multiplied zero z * s2 fits INT8
("subtraction after multiplication" in the paper), so the INT8 tensor cores take v_hat with no
float in between.

Cost: weight bytes / bf16 bytes = 1/4 + 1/G + bytes(s1) / (2K); [4096, 4096] with G = 128 and
an fp16 s1: 0.2581. `w4a8_linear` is a CPU reference for tests and checkpoint checks, not a
serving kernel: it dequantizes the whole weight to INT8 on every call.

`torch._int_mm` (int8 x int8 -> int32) runs on CPU with any shapes and gives exactly the int32
matmul's result; whether it is faster depends on the processor (median of 3, one thread,
[16, 4096] x [4096, 4096], casts included):
    AMD EPYC, AVX2 (torch 2.13+cpu, the CI-like machine)      1330 ms  vs int32 matmul 62 ms
    Xeon with AVX512-VNNI and AMX-INT8 (torch 2.11, H100 host)  1.9 ms  vs int32 matmul 73 ms
On CUDA (H100) it needs more than 16 rows and K, N multiples of 8, and torch has no int32
matmul there ("addmm_cuda" not implemented for 'Int'), so the fallback multiplies in float64,
exact because every partial sum is an integer below 2**31 < 2**53. `use_int_mm_by_default`
holds that choice; `use_int_mm=` forces a path, and a test checks that the paths agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fineslab.errors import ConfigError, IntegrityError

PROTECTIVE_RANGE = 119
MAX_Q = 15
MAX_S2 = 16
INT8_MAX = 127
#: K * 127 * 127 must stay below 2**31 for the INT32 accumulation to be exact.
MAX_IN_FEATURES = (2**31 - 1) // (INT8_MAX * INT8_MAX)
S1_DTYPES = (torch.float16, torch.float32)


@dataclass(frozen=True)
class QoQConfig:
    """How to quantize: group size along K and the dtype of the per-channel scale s1.

    float16 s1 is QServe's and halves the scale bytes; its smallest normal value, 6.1e-5, is
    the floor of s1, so a row whose largest |w| is below 119 * 6.1e-5 = 7.3e-3 uses fewer than
    the 239 level-1 codes (float32 has no such floor)."""

    group_size: int = 128
    s1_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.group_size % 2:
            raise ConfigError(f"QoQ group_size {self.group_size}: must be a positive even "
                              "number (two 4-bit codes a byte)")
        if self.s1_dtype not in S1_DTYPES:
            raise ConfigError(f"QoQ s1_dtype {self.s1_dtype}: must be torch.float16 or "
                              "torch.float32")


@dataclass(frozen=True)
class QoQWeight:
    """One linear layer in QoQ W4A8 form (layout and invariants in the module docstring)."""

    packed: torch.Tensor
    s2: torch.Tensor
    z: torch.Tensor
    s1: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        rows, half = self.packed.shape
        if self.group_size <= 0 or (2 * half) % self.group_size or self.s1.dtype not in S1_DTYPES:
            raise ConfigError(f"QoQWeight: group size {self.group_size} must divide K = "
                              f"{2 * half}; s1 must be float16 or float32, got {self.s1.dtype}")
        groups = 2 * half // self.group_size
        expected = {"packed": (rows, half), "s2": (rows, groups), "z": (rows, groups),
                    "s1": (rows,)}
        dtypes = {"packed": torch.uint8, "s2": torch.uint8, "z": torch.int8, "s1": self.s1.dtype}
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != shape or tensor.dtype != dtypes[name]:
                raise ConfigError(f"QoQWeight.{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"want {shape} {dtypes[name]} (packed {(rows, half)}, group "
                                  f"size {self.group_size})")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held: N K / 2 + 2 N K / G + N * bytes(s1)."""
        tensors = (self.packed, self.s2, self.z, self.s1)
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless 1 <= s2 <= 16, |z * s2| <= 127 and every (q - z) * s2
        lies in [-127, 127] in every group, and every s1 is finite and positive."""
        s2 = self.s2.to(torch.int32)
        scaled_zero = self.z.to(torch.int32) * s2
        if not bool(((s2 >= 1) & (s2 <= MAX_S2)).all()):
            raise IntegrityError(f"QoQWeight: s2 outside 1..{MAX_S2}")
        if not bool((scaled_zero.abs() <= INT8_MAX).all()):
            raise IntegrityError("QoQWeight: a scaled zero z * s2 outside [-127, 127]")
        if not bool((torch.isfinite(self.s1) & (self.s1 > 0)).all()):
            raise IntegrityError("QoQWeight: s1 not finite and positive in every row")
        dequantize_qoq_to_int8(self)


def pack_uint4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2 C] codes 0..15 (any integer dtype) -> [..., C] uint8, low nibble = even index."""
    if codes.shape[-1] % 2:
        raise ConfigError(f"pack_uint4 needs an even last dimension, got {tuple(codes.shape)}")
    if codes.numel() and not bool(((codes >= 0) & (codes <= MAX_Q)).all()):
        raise ConfigError("pack_uint4: codes must lie in 0..15")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_uint4`: [..., C] uint8 -> [..., 2 C] uint8 codes 0..15."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _round_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """r(a / b) = floor(a / b + 1/2) for integer tensors and b > 0, exactly."""
    return torch.div(2 * a + b, 2 * b, rounding_mode="floor")


def level2_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s2, z) of groups whose codes span [lo, hi] (int32): the smallest integer step that
    covers the span in 15 steps, and the zero that maps lo to code 0."""
    s2 = torch.div(hi - lo + (MAX_Q - 1), MAX_Q, rounding_mode="floor").clamp(min=1)
    return s2, -_round_div(lo, s2)


def level2_codes(v: torch.Tensor, s2: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """q = r(v / s2) + z (int32, broadcasting); 0..15 for v within the group's span."""
    return _round_div(v, s2) + z


def _check_weight(weight: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2:
        raise ConfigError(f"QoQ quantizes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ConfigError(f"QoQ needs a floating-point weight, got {weight.dtype}")
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ConfigError(f"QoQ: group size {group_size} does not divide in_features "
                          f"{in_features} of a [{out_features}, {in_features}] weight")
    if in_features > MAX_IN_FEATURES:
        raise ConfigError(f"QoQ: in_features {in_features} > {MAX_IN_FEATURES} would overflow "
                          "the INT32 accumulator")
    bad_rows = (~torch.isfinite(weight)).any(dim=1).nonzero().flatten()
    if bad_rows.numel():
        raise ConfigError(f"QoQ: weight has non-finite values (inf or nan) in "
                          f"{bad_rows.numel()} rows, the first is row {int(bad_rows[0])}")


def _level1(weight: torch.Tensor, s1_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric codes v in [-P, P] (int32 [N, K]) and s1 [N] in `s1_dtype`."""
    w = weight.to(torch.float32)
    s1_exact = w.abs().amax(dim=1) / PROTECTIVE_RANGE
    # Round s1 to its stored dtype first so that the codes are chosen for the stored scale.
    s1 = s1_exact.clamp(min=torch.finfo(s1_dtype).tiny).to(s1_dtype)
    if not bool(torch.isfinite(s1).all()):
        largest = float(s1_exact.max()) * PROTECTIVE_RANGE
        raise ConfigError(f"QoQ: a row's largest |w| ({largest:.3g}) overflows s1 in "
                          f"{s1_dtype}; use s1_dtype=torch.float32")
    v = torch.round(w / s1.to(torch.float32)[:, None])
    return v.clamp(-PROTECTIVE_RANGE, PROTECTIVE_RANGE).to(torch.int32), s1


def _level2(v: torch.Tensor, group_size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q [N, K] uint8, s2 and z [N, K / G] int32, for level-1 codes v [N, K]."""
    rows, cols = v.shape
    grouped = v.reshape(rows, cols // group_size, group_size)
    s2, z = level2_params(grouped.amin(dim=2), grouped.amax(dim=2))
    q = level2_codes(grouped, s2[..., None], z[..., None])
    return q.reshape(rows, cols).to(torch.uint8), s2, z


def quantize_qoq(weight: torch.Tensor, config: QoQConfig | None = None) -> QoQWeight:
    """Progressive group quantization of a [N, K] weight (bf16/fp16/fp32, any device).

    Raises ConfigError for a weight that is not 2-D and floating point, a group size that does
    not divide K, or non-finite values (naming the first bad row)."""
    cfg = config or QoQConfig()
    _check_weight(weight, cfg.group_size)
    v, s1 = _level1(weight, cfg.s1_dtype)
    q, s2, z = _level2(v, cfg.group_size)
    return QoQWeight(packed=pack_uint4(q), s2=s2.to(torch.uint8), z=z.to(torch.int8), s1=s1,
                     group_size=cfg.group_size)


def dequantize_qoq_to_int8(w: QoQWeight) -> torch.Tensor:
    """Level-2 dequantization, v_hat = (q - z) * s2: int8 [N, K], exact. Raises IntegrityError
    if a hand-made weight would leave INT8."""
    rows, cols = w.shape
    q = unpack_uint4(w.packed).to(torch.int16).reshape(rows, cols // w.group_size, w.group_size)
    v_hat = (q - w.z.to(torch.int16)[..., None]) * w.s2.to(torch.int16)[..., None]
    if bool((v_hat.abs() > INT8_MAX).any()):
        # Only a weight not written by quantize_qoq gets here; int8 would wrap it silently.
        raise IntegrityError("QoQWeight: (q - z) * s2 leaves [-127, 127]: codes and zero points "
                             "do not belong together")
    return v_hat.reshape(rows, cols).to(torch.int8)


def dequantize_qoq(w: QoQWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Both levels: W_hat = v_hat * s1, [N, K] in `dtype` (computed in float32)."""
    v_hat = dequantize_qoq_to_int8(w).to(torch.float32)
    return (v_hat * w.s1.to(torch.float32)[:, None]).to(dtype)


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT8: [..., K] float -> (x_q int8 [..., K] in [-127, 127],
    s_x float32 [...]). An all-zero token gets codes 0 and the smallest float32 scale.

    Raises ConfigError if a token holds inf or nan (found through its scale: no extra pass), on
    CPU only: on CUDA the check would synchronize the stream, which CUDA-graph capture (SGLang's
    default on GPU) refuses; there a non-finite token gives a non-finite output row."""
    if not x.is_floating_point():
        raise ConfigError(f"INT8 activation quantization needs a float tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    if scale.device.type == "cpu" and not bool(torch.isfinite(scale).all()):
        raise ConfigError("INT8 activation quantization: a token holds inf or nan")
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    x_q = torch.round(xf / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x_q, scale


def use_int_mm_by_default(device: torch.device, rows: int, in_features: int,
                          out_features: int) -> bool:
    """Whether `int8_matmul` picks `torch._int_mm`: on CUDA where its shape rules hold, and on
    CPUs that torch runs with AVX512 (there oneDNN's VNNI/AMX kernels make it 38x faster than
    an int32 matmul; on AVX2 it is 20x slower, see the module docstring)."""
    if device.type == "cuda":
        return rows > 16 and in_features % 8 == 0 and out_features % 8 == 0
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512"


def int8_matmul(x_q: torch.Tensor, w_int8: torch.Tensor, *,
                use_int_mm: bool | None = None) -> torch.Tensor:
    """x_q [T, K] int8 times w_int8 [N, K] int8 transposed -> int32 [T, N], exact.

    use_int_mm: None follows `use_int_mm_by_default`; True forces `torch._int_mm` (on CUDA it
    raises outside its shape rules), False the fallback: an int32 matmul on CPU, float64 on
    other devices (both exact, see the module docstring)."""
    if x_q.dtype != torch.int8 or w_int8.dtype != torch.int8:
        raise ConfigError(f"int8_matmul takes int8 operands, got {x_q.dtype} and {w_int8.dtype}")
    if use_int_mm is None:
        use_int_mm = use_int_mm_by_default(x_q.device, x_q.shape[0], x_q.shape[1],
                                           w_int8.shape[0])
    if use_int_mm:
        return torch._int_mm(x_q, w_int8.t())
    if x_q.device.type == "cpu":
        return x_q.to(torch.int32) @ w_int8.to(torch.int32).t()
    return (x_q.to(torch.float64) @ w_int8.to(torch.float64).t()).to(torch.int32)


def w4a8_linear(x: torch.Tensor, w: QoQWeight, bias: torch.Tensor | None = None, *,
                use_int_mm: bool | None = None) -> torch.Tensor:
    """y = x W^T + bias with W4A8 numerics: [..., K] float -> [..., N] in x.dtype.

    x is quantized per token to INT8, the weight dequantized to INT8 (level 2), the product
    accumulated in INT32, then scaled by s_x[t] * s1[n] in float32 and bias added."""
    out_features, in_features = w.shape
    if x.shape[-1] != in_features:
        raise ConfigError(f"w4a8_linear: x has {x.shape[-1]} features, the weight takes "
                          f"{in_features}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ConfigError(f"w4a8_linear: bias shape {tuple(bias.shape)}, want ({out_features},)")
    x_q, s_x = quantize_activations_int8(x.reshape(-1, in_features))
    acc = int8_matmul(x_q, dequantize_qoq_to_int8(w), use_int_mm=use_int_mm)
    y = acc.to(torch.float32) * s_x[:, None] * w.s1.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)
