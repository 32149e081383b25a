"""FP8 block and FP4 formats: dequantization and quantization bit for bit against transformers' own code
on bytes made by torch, plus the properties of our quantizers (edge blocks, FP4 rounding)."""

import subprocess
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from dsjax.quant import (E2M1_VALUES, dequantize_fp4, dequantize_fp8, divide_rn, float_to_ue8m0, long_division,
                         pack_kv,
                         quantize_fp4, quantize_fp8, ue8m0_to_float)
from tests.conftest import reference_python

SCRIPT = Path(__file__).parent / "reference" / "run_quant_reference.py"


@pytest.fixture(scope="module")
def torch_ref(tmp_path_factory):
    py = reference_python()
    if not Path(py).exists():
        pytest.fail(f"the reference environment is missing: {py} (run `bash .ci/setup`)")
    out = tmp_path_factory.mktemp("quant") / "ref.npz"
    proc = subprocess.run([py, str(SCRIPT), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def _fp8(b):
    return b.view(ml_dtypes.float8_e4m3fn)


def _same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("case", ["fp8_whole", "fp8_u8", "fp8_experts", "fp8_edges"])
def test_fp8_dequantization_matches_torch_bit_for_bit(torch_ref, case):
    q, s = _fp8(torch_ref[f"{case}.q"]), torch_ref[f"{case}.s"]
    _same_bits(dequantize_fp8(q, s), torch_ref[f"{case}.out"])
    _same_bits(jax.jit(dequantize_fp8)(q, s), torch_ref[f"{case}.out"])  # and traced


def test_fp8_with_e8m0_scale_dtype_matches_torch(torch_ref):
    q, s = _fp8(torch_ref["fp8_e8m0.q"]), torch_ref["fp8_e8m0.s"]
    _same_bits(dequantize_fp8(q, s), torch_ref["fp8_e8m0.out"])  # the bytes as uint8
    _same_bits(dequantize_fp8(q, s.view(ml_dtypes.float8_e8m0fnu)), torch_ref["fp8_e8m0.out"])


@pytest.mark.parametrize("case", ["fp4", "fp4_experts"])
def test_fp4_dequantization_matches_torch_bit_for_bit(torch_ref, case):
    _same_bits(dequantize_fp4(torch_ref[f"{case}.q"], torch_ref[f"{case}.s"]), torch_ref[f"{case}.out"])


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_fp8_quantizer_gives_the_references_bytes(torch_ref, fmt):
    q, s = quantize_fp8(torch_ref[f"quant_{fmt}.w"], scale_fmt=fmt)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), torch_ref[f"quant_{fmt}.q"])
    np.testing.assert_array_equal(np.asarray(s), torch_ref[f"quant_{fmt}.s"])


def test_fp8_round_trip_with_partial_edge_blocks():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 300, 200)).astype(np.float32) * np.logspace(-2, 1, 200, dtype=np.float32)
    for fmt in ("float", "ue8m0"):
        q, s = quantize_fp8(w, scale_fmt=fmt)
        assert q.shape == w.shape and s.shape == (2, 3, 2)
        back = np.asarray(dequantize_fp8(q, s))
        blocks = np.abs(w).reshape(2, 300, 200)
        # e4m3 has 3 mantissa bits: relative error ≤ 2^-4 of the block's max, per element
        for i in range(3):
            for j in range(2):
                sl = (slice(None), slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
                bmax = blocks[sl].max(axis=(1, 2))[:, None, None]
                assert (np.abs(back[sl] - w[sl]) <= bmax * 2.0 ** -4 + 1e-30).all()
        assert np.abs(q.astype(np.float32)).max() <= 448


def test_fp4_quantizer_rounds_to_the_nearest_code_and_packs_low_nibble_first():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 8, 64)).astype(np.float32)
    packed, s = quantize_fp4(w)
    assert packed.shape == (4, 8, 32) and packed.dtype == np.int8 and s.shape == (4, 8, 2)
    back = np.asarray(dequantize_fp4(packed, s))
    scale = np.repeat(np.asarray(ue8m0_to_float(s)), 32, axis=-1)
    grid = E2M1_VALUES[None, :] * scale.reshape(-1, 1)
    nearest = np.abs(w.reshape(-1, 1) - grid).min(axis=1)
    np.testing.assert_allclose(np.abs(back - w).reshape(-1), nearest, atol=1e-7)  # no closer code exists
    assert (np.abs(w) <= 6 * scale).all()  # the scale fits the group's max
    # byte 0x21 holds (0.5, 1.0) and 0x9F holds (-6.0, -0.5): low nibble is the even column
    one = np.asarray([[0x21, 0x9F]], np.uint8).view(np.int8)
    np.testing.assert_array_equal(np.asarray(dequantize_fp4(np.concatenate([one] * 8, 1), np.full((1, 1), 127,
                                                                                                  np.uint8)))[0, :4],
                                  [0.5, 1.0, -6.0, -0.5])


def test_ue8m0_helpers_and_shape_errors():
    np.testing.assert_array_equal(float_to_ue8m0([1.0, 0.3, 2.0 ** -10]), [127, 126, 117])
    np.testing.assert_array_equal(np.asarray(ue8m0_to_float(np.asarray([127, 128, 120], np.uint8))),
                                  [1.0, 2.0, 2.0 ** -7])
    with pytest.raises(ValueError, match="needs block scales"):
        dequantize_fp8(np.zeros((300, 200), ml_dtypes.float8_e4m3fn), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_fp4(np.zeros((4, 16), np.int8), np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_fp4(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_fp8(np.zeros((4, 4)), scale_fmt="e5m2")


def test_every_ue8m0_byte_is_an_exact_power_of_two():
    b = np.arange(255, dtype=np.uint8)
    expected = np.ldexp(np.float32(1), b.astype(np.int32) - 127).astype(np.float32)
    _same_bits(ue8m0_to_float(b), expected)
    _same_bits(ue8m0_to_float(b.view(ml_dtypes.float8_e8m0fnu)), expected)
    assert np.isnan(np.asarray(ue8m0_to_float(np.asarray([255], np.uint8))))[0]


@pytest.mark.parametrize("divide", [divide_rn, long_division])
def test_division_is_ieee_over_the_whole_exponent_range(divide):
    """`long_division` is what `divide_rn` runs off the CPU, where XLA's division is approximate; either sign
    (NVFP4 divides signed values by their scale: a negative one once fell back to the approximate division),
    and exact ties of short (bf16) mantissas."""
    rng = np.random.default_rng(4)
    a = (rng.normal(size=1 << 16) * np.exp(rng.normal(size=1 << 16) * 8)).astype(np.float32)
    b = (rng.normal(size=1 << 16) * np.exp(rng.normal(size=1 << 16) * 8)).astype(np.float32)
    short = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        for x, y in ((a, b), (np.full_like(b, -448), b), (a, np.full_like(a, 6)), (short, np.full_like(a, -0.75))):
            _same_bits(jax.jit(divide)(x, y), x / y)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator")
def test_quantizers_give_the_cpus_bytes_on_the_accelerator():
    """XLA:GPU divides fp32 approximately; the quantizers must not inherit that."""
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(512, 384)) * np.exp(rng.normal(size=(512, 1)) * 4)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    for fn in (quantize_fp8, lambda x: quantize_fp8(x, scale_fmt="ue8m0"), quantize_fp4,
               lambda x: pack_kv(x, "fp8", 64), lambda x: pack_kv(x, "fp4", 64)):
        on_device = jax.tree.leaves(jax.jit(fn)(w))
        with jax.default_device(cpu):
            on_cpu = jax.tree.leaves(jax.jit(fn)(w))
        for d, c in zip(on_device, on_cpu):
            np.testing.assert_array_equal(np.asarray(d).view(np.uint8), np.asarray(c).view(np.uint8))
