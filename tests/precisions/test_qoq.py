"""QoQ W4A8 math (fineslab.quant.qoq): packing, progressive group quantization, the W4A8 linear.

Bounds, measured on CPU (torch 2.13): w4a8_linear against the float matmul x @ W^T, W and x
standard normal, [256, 512] weight, 32 tokens, G = 128: relative Frobenius error 0.103 to 0.107
over 20 seeds; the test's bound is 0.12. Negative controls on the same data, each a valid
QoQWeight: zero points off by one give 0.35 to 0.39, swapped nibbles 1.40 to 1.42, each row
scaled by its neighbour's s1 0.18 to 0.19 (seeds 100-102). Zero points off by one in every
group push the extreme codes out of INT8 and raise IntegrityError instead.
Per element, |W - W_hat| <= s1 * (1 + s2) / 2 (half a level-1 step plus half a level-2 step).
Weight bytes / bf16 bytes = 1/4 + 1/G + bytes(s1) / (2K): 0.2581 for [4096, 4096], G = 128,
fp16 s1.
"""

from __future__ import annotations

import pytest
import torch

from fineslab.errors import ConfigError, IntegrityError
from fineslab.quant.kv4 import unpack_codes
from fineslab.quant.qoq import (
    MAX_S2,
    PROTECTIVE_RANGE,
    QoQConfig,
    QoQWeight,
    dequantize_qoq,
    dequantize_qoq_to_int8,
    int8_matmul,
    level2_codes,
    level2_params,
    pack_uint4,
    quantize_activations_int8,
    quantize_qoq,
    unpack_uint4,
    use_int_mm_by_default,
    w4a8_linear,
)

ERROR_BOUND = 0.12


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _adversarial_weight() -> torch.Tensor:
    """Rows that stress each level: outliers, zeros, constants, tiny values, two-valued rows."""
    w = _randn(7, 10, 256)
    w[0, 5] = 1e4                      # one huge outlier: the rest of the row rounds to ~0
    w[1] = 0.0                         # all-zero row
    w[2] = 0.37                        # constant row: one group value, z = -119
    w[3] = -2.5                        # constant negative row
    w[4] = 1e-30                       # below the fp16 floor of s1
    w[5, 0::2], w[5, 1::2] = 3.0, -3.0  # the widest group span, -119..119
    w[6, :128] = torch.linspace(-1, 1, 128)
    w[7, 128:] = 5.0                   # one group all at the positive extreme
    w[8] *= 1e3
    return w


def _level2_int32(w: QoQWeight) -> torch.Tensor:
    """(q - z) * s2 recomputed in int32, independently of dequantize_qoq_to_int8's int8 cast."""
    rows, cols = w.shape
    q = unpack_uint4(w.packed).to(torch.int32).reshape(rows, -1, w.group_size)
    v_hat = (q - w.z.to(torch.int32)[..., None]) * w.s2.to(torch.int32)[..., None]
    return v_hat.reshape(rows, cols)


# --- packing --------------------------------------------------------------------------------

def test_pack_unpack_round_trip() -> None:
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_uint4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(unpack_uint4(packed), codes.to(torch.uint8)), "unpack(pack(c)) == c"


def test_nibble_order_low_is_even_and_matches_kv4() -> None:
    packed = pack_uint4(torch.tensor([[1, 15, 0, 7]]))
    assert packed.tolist() == [[0xF1, 0x70]], "byte j: low nibble q[2j], high nibble q[2j+1]"
    codes = torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_codes(pack_uint4(codes)), codes.to(torch.uint8)), \
        "QoQ weights and the KV4 cache share one nibble order"


def test_pack_rejects_bad_codes() -> None:
    with pytest.raises(ConfigError, match="even last dimension"):
        pack_uint4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ConfigError, match=r"0\.\.15"):
        pack_uint4(torch.tensor([[3, 16]]))


# --- level 2 stays in INT8 ------------------------------------------------------------------

def test_level2_exhaustive_every_group_span_stays_in_int8() -> None:
    """Every span [lo, hi] within [-119, 119] and every code v in it: q is a 4-bit code and
    v_hat = (q - z) * s2 is within s2 / 2 of v and inside INT8; q * s2 fits UINT8."""
    p = PROTECTIVE_RANGE
    codes = torch.arange(-p, p + 1, dtype=torch.int16)  # int16: 2 v + s2 and q * s2 fit
    lo, hi = torch.meshgrid(codes, codes, indexing="ij")
    keep = lo <= hi
    lo, hi = lo[keep][:, None], hi[keep][:, None]            # [spans, 1]
    s2, z = level2_params(lo, hi)
    v = lo + torch.arange(2 * p + 1, dtype=torch.int16)[None, :]   # [spans, 239]
    inside = v <= hi
    q = level2_codes(v, s2, z)
    v_hat = (q - z) * s2
    assert bool(((s2 >= 1) & (s2 <= MAX_S2)).all()), "1 <= s2 <= 16"
    assert bool(((z * s2).abs() <= 127).all()), "the scaled zero fits INT8"
    assert bool(((q >= 0) & (q <= 15))[inside].all()), "no clamp needed: q in 0..15"
    assert bool((q * s2 <= 240)[inside].all()), "q * s2 fits UINT8"
    assert bool(((v_hat >= -127) & (v_hat <= 127))[inside].all()), "v_hat fits INT8"
    assert bool((2 * (v_hat - v).abs() <= s2)[inside].all()), "|v_hat - v| <= s2 / 2"


def test_protective_range_119_is_the_largest_safe_range() -> None:
    def largest_v_hat(lo: int, hi: int) -> int:
        s2, z = level2_params(torch.tensor([lo]), torch.tensor([hi]))
        return int(((level2_codes(torch.arange(lo, hi + 1), s2, z) - z) * s2).abs().max())

    assert largest_v_hat(-PROTECTIVE_RANGE, PROTECTIVE_RANGE) <= 127
    assert largest_v_hat(-120, 120) == 128, "control: P = 120 overflows INT8"
    assert largest_v_hat(-127, 24) == 132, "control: plain symmetric INT8 (P = 127) overflows"


@pytest.mark.parametrize("s1_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "adversarial", "bf16"])
def test_dequant_exact_int8_and_within_bound(kind: str, s1_dtype: torch.dtype) -> None:
    weight = {"random": _randn(3, 64, 384) * 0.05, "adversarial": _adversarial_weight(),
              "bf16": (_randn(4, 32, 256) * 0.02).to(torch.bfloat16)}[kind]
    w = quantize_qoq(weight, QoQConfig(group_size=128, s1_dtype=s1_dtype))
    w.check_integrity()
    assert w.s1.dtype == s1_dtype and w.shape == tuple(weight.shape)
    v_hat = _level2_int32(w)
    assert int(v_hat.abs().max()) <= 127, "level 2 dequantizes inside INT8"
    assert torch.equal(dequantize_qoq_to_int8(w).to(torch.int32), v_hat), "no int8 wrap-around"
    s1 = w.s1.float()[:, None]
    s2 = w.s2.float().repeat_interleave(w.group_size, dim=1)
    err = (dequantize_qoq(w) - weight.float()).abs()
    assert bool((err <= s1 * (1 + s2) / 2 * (1 + 1e-5)).all()), "|W - W_hat| <= s1 (1 + s2) / 2"


def test_adversarial_rows_decode_as_expected() -> None:
    weight = _adversarial_weight()
    w_hat = dequantize_qoq(quantize_qoq(weight, QoQConfig(s1_dtype=torch.float32)))
    assert torch.equal(w_hat[1], torch.zeros(256)), "an all-zero row stays zero"
    assert torch.allclose(w_hat[2], weight[2], rtol=1e-6), "a constant row is exact"
    assert torch.allclose(w_hat[3], weight[3], rtol=1e-6), "a negative constant row is exact"
    assert abs(float(w_hat[0, 5]) - 1e4) <= 1e4 * 8 / 119, \
        "the outlier keeps its value to half a level-2 step (s2 <= 16, of 119 codes)"


# --- activations and the W4A8 linear --------------------------------------------------------

def test_activation_quantization_per_token() -> None:
    x = _randn(5, 6, 64) * torch.tensor([1e-3, 1.0, 1e3, 0.0, 5.0, 2.0])[:, None]
    x_q, s_x = quantize_activations_int8(x)
    assert x_q.dtype == torch.int8 and s_x.shape == (6,) and int(x_q.abs().max()) == 127
    assert torch.equal(x_q[3], torch.zeros(64, dtype=torch.int8)), "a zero token gives codes 0"
    err = (x_q.float() * s_x[:, None] - x).abs()
    assert bool((err <= s_x[:, None] / 2 * (1 + 1e-5)).all()), "half a step per element"


def test_w4a8_linear_is_the_integer_product_of_the_quantized_operands() -> None:
    x, weight, bias = _randn(10, 2, 7, 256), _randn(11, 48, 256), _randn(12, 48)
    w = quantize_qoq(weight)
    got = w4a8_linear(x, w, bias)
    x_q, s_x = quantize_activations_int8(x.reshape(-1, 256))
    want = (x_q.double() * s_x.double()[:, None]) @ dequantize_qoq(w, torch.float64).t()
    want = (want + bias.double()).reshape(2, 7, 48)
    assert got.shape == (2, 7, 48) and got.dtype == torch.float32
    assert _rel_error(got, want) < 1e-6, "INT32 accumulation + scaling == float of the codes"
    assert w4a8_linear(x.to(torch.bfloat16), w).dtype == torch.bfloat16, "output in x's dtype"


def _broken_zero(w: QoQWeight) -> QoQWeight:
    """Zero points off by one (z + 1, or z - 1 where z + 1 would leave INT8; about 6% of the
    groups span too much for either and keep their zero): still a valid QoQWeight."""
    v_hat = dequantize_qoq_to_int8(w).to(torch.int32).reshape(*w.s2.shape, w.group_size)
    s2 = w.s2.to(torch.int32)
    shift = torch.where(v_hat.amin(dim=2) - s2 >= -127, 1,
                        torch.where(v_hat.amax(dim=2) + s2 <= 127, -1, 0))
    return QoQWeight(w.packed, w.s2, (w.z.to(torch.int32) + shift).to(torch.int8), w.s1,
                     w.group_size)


def _broken_nibbles(w: QoQWeight) -> QoQWeight:
    return QoQWeight((w.packed >> 4) | (w.packed << 4), w.s2, w.z, w.s1, w.group_size)


def _broken_s1(w: QoQWeight) -> QoQWeight:
    """Each row scaled by its neighbour's s1 (an off-by-one row index)."""
    return QoQWeight(w.packed, w.s2, w.z, w.s1.roll(1), w.group_size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_w4a8_error_under_bound_and_broken_weights_exceed_it(seed: int) -> None:
    weight, x = _randn(100 + seed, 256, 512), _randn(200 + seed, 32, 512)
    w, want = quantize_qoq(weight), x @ weight.t()
    assert _rel_error(w4a8_linear(x, w), want) < ERROR_BOUND, "measured 0.103..0.107"
    for broken in (_broken_zero(w), _broken_nibbles(w), _broken_s1(w)):
        broken.check_integrity()  # a control the integrity check cannot see: only the bound can
        assert _rel_error(w4a8_linear(x, broken), want) > ERROR_BOUND, \
            "negative control: the bound catches a broken weight"


def test_zero_points_off_by_one_everywhere_fail_loudly() -> None:
    w = quantize_qoq(_randn(100, 256, 512))
    broken = QoQWeight(w.packed, w.s2, (w.z.to(torch.int16) + 1).to(torch.int8), w.s1,
                       w.group_size)
    with pytest.raises(IntegrityError, match="leaves"):
        w4a8_linear(_randn(200, 4, 512), broken)


def test_int_mm_and_int32_paths_agree_exactly() -> None:
    gen = torch.Generator().manual_seed(3)
    x_q = torch.randint(-127, 128, (17, 1024), generator=gen, dtype=torch.int8)
    w8 = torch.randint(-127, 128, (64, 1024), generator=gen, dtype=torch.int8)
    assert torch.equal(int8_matmul(x_q, w8, use_int_mm=True),
                       int8_matmul(x_q, w8, use_int_mm=False))
    ones = torch.full((3, 4096), 127, dtype=torch.int8)
    extreme = torch.full((8, 4096), -127, dtype=torch.int8)
    for use_int_mm in (True, False):
        got = int8_matmul(ones, extreme, use_int_mm=use_int_mm)
        assert bool((got == -127 * 127 * 4096).all()), "largest sums are exact in INT32"
    w, x = quantize_qoq(_randn(13, 40, 256)), _randn(14, 20, 256)
    assert torch.equal(w4a8_linear(x, w, use_int_mm=True), w4a8_linear(x, w, use_int_mm=False))


def test_int_mm_default_follows_shape_rules_and_cpu_speed() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_int_mm_by_default(cuda, 17, 64, 64)
    for rows, k, n in ((16, 64, 64), (17, 60, 64), (17, 64, 60)):
        assert not use_int_mm_by_default(cuda, rows, k, n), "outside _int_mm's CUDA shape rules"
    fast_cpu = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert use_int_mm_by_default(cpu, 1, 3, 5) == fast_cpu, "on CPU only where it is faster"


@pytest.mark.gpu
def test_cuda_paths_agree_with_cpu() -> None:
    weight, x = _randn(17, 64, 512), _randn(18, 40, 512)
    w = quantize_qoq(weight)
    want = w4a8_linear(x, w, use_int_mm=False)
    w_cuda = quantize_qoq(weight.cuda())
    assert torch.equal(w_cuda.packed.cpu(), w.packed) and torch.equal(w_cuda.z.cpu(), w.z)
    for use_int_mm in (True, False):
        got = w4a8_linear(x.cuda(), w_cuda, use_int_mm=use_int_mm).cpu()
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), f"use_int_mm={use_int_mm}"


# --- bytes ----------------------------------------------------------------------------------

def test_weight_bytes_ratio_vs_bf16() -> None:
    n = k = 4096
    g = 128
    w = QoQWeight(packed=torch.zeros(n, k // 2, dtype=torch.uint8),
                  s2=torch.ones(n, k // g, dtype=torch.uint8),
                  z=torch.zeros(n, k // g, dtype=torch.int8),
                  s1=torch.ones(n, dtype=torch.float16), group_size=g)
    ratio = w.nbytes / (2 * n * k)
    assert ratio == pytest.approx(1 / 4 + 1 / g + 2 / (2 * k)) and 0.25 < ratio < 0.30
    small = quantize_qoq(_randn(15, 64, 512))
    assert small.nbytes == 64 * 256 + 2 * 64 * 4 + 2 * 64, "N K/2 + 2 N K/G + 2 N bytes"


# --- bad inputs -----------------------------------------------------------------------------

def _with(value: float) -> torch.Tensor:
    w = torch.zeros(4, 256)
    w[2, 9] = value
    return w


@pytest.mark.parametrize(("weight", "config", "message"), [
    (torch.zeros(4, 200), QoQConfig(group_size=128), "does not divide in_features 200"),
    (torch.zeros(2, 4, 256), QoQConfig(), "2-D"),
    (torch.zeros(256), QoQConfig(), "2-D"),
    (torch.zeros(4, 256, dtype=torch.int32), QoQConfig(), "floating-point"),
    (_with(float("nan")), QoQConfig(), "non-finite values .* first is row 2"),
    (_with(float("inf")), QoQConfig(), "non-finite"),
    (_with(1e9), QoQConfig(), "overflows s1 in torch.float16"),
])
def test_bad_weights_raise_config_error(weight: torch.Tensor, config: QoQConfig,
                                        message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        quantize_qoq(weight, config)


def test_bad_configs_and_operands_raise_config_error() -> None:
    for group in (0, -128, 63):
        with pytest.raises(ConfigError, match="positive even"):
            QoQConfig(group_size=group)
    with pytest.raises(ConfigError, match="s1_dtype"):
        QoQConfig(s1_dtype=torch.bfloat16)
    w = quantize_qoq(torch.zeros(8, 256))
    with pytest.raises(ConfigError, match="x has 128 features"):
        w4a8_linear(torch.zeros(2, 128), w)
    with pytest.raises(ConfigError, match="bias shape"):
        w4a8_linear(torch.zeros(2, 256), w, torch.zeros(9))
    with pytest.raises(ConfigError, match="inf or nan"):
        quantize_activations_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ConfigError, match=r"QoQWeight.z"):
        QoQWeight(w.packed, w.s2, w.z[:, :1], w.s1, w.group_size)


def test_check_integrity_catches_corrupt_scales() -> None:
    w = quantize_qoq(_randn(16, 8, 256))
    with pytest.raises(IntegrityError, match="s2 outside"):
        QoQWeight(w.packed, torch.full_like(w.s2, 17), w.z, w.s1, w.group_size).check_integrity()
    with pytest.raises(IntegrityError, match="scaled zero"):
        QoQWeight(w.packed, torch.full_like(w.s2, 16), torch.full_like(w.z, 8), w.s1,
                  w.group_size).check_integrity()
    codes = torch.full((8, 256), 15, dtype=torch.uint8)
    with pytest.raises(IntegrityError, match="leaves"):
        dequantize_qoq_to_int8(QoQWeight(pack_uint4(codes), torch.ones_like(w.s2),
                                         torch.full_like(w.z, -119), w.s1, w.group_size))
