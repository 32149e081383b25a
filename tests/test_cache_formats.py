"""V4.1's cache formats (dsjax/cache_formats.py) bit for bit against a numpy + ml_dtypes reference written
here from the spec's formulas (§3.3, and NeMo's `quantize_cache`), plus hand-worked cases, the record
layouts and sizes, pack/unpack round trips, and jit/vmap."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax.cache_formats import BLOCK, FORMATS, pack, quantize_dequantize, record_bytes, unpack

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
LIMIT = {"mxfp8": 448.0, "nvfp4": 6.0, "mxfp4": 6.0}
FLOOR = {"mxfp8": 1e-4, "nvfp4": 6 * 2.0 ** -9, "mxfp4": 6 * 2.0 ** -126}
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def reference(x: np.ndarray, fmt: str, saturate: bool = True) -> np.ndarray:
    """The spec's formulas in numpy fp32 (no flushing of subnormals) with ml_dtypes' round-to-nearest-even
    casts; the last block zero-padded. Finite inputs."""
    block, limit = BLOCK[fmt], np.float32(LIMIT[fmt])
    x32 = np.asarray(x, np.float32)
    dim, n = x32.shape[-1], -(-x32.shape[-1] // block)
    g = np.zeros(x32.shape[:-1] + (n * block,), np.float32)
    g[..., :dim] = x32
    g = g.reshape(x32.shape[:-1] + (n, block))
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(FLOOR[fmt]))
    with np.errstate(invalid="ignore"):
        if fmt == "nvfp4":
            s = amax / np.float32(6)
            if saturate:  # torch ≥ 2.12 saturates; ml_dtypes (like older torch) gives NaN above 464
                s = np.minimum(s, np.float32(448))
            s = s.astype(E4M3).astype(np.float32)
        else:  # the smallest power of two ≥ amax · fp32(1/limit)
            mant, exp = np.frexp(amax * np.float32(1 / float(limit)))  # v = mant · 2^exp, mant in [0.5, 1)
            s = np.ldexp(np.float32(1), np.where(mant == 0.5, exp - 1, exp)).astype(np.float32)
        q = np.clip(g / s, -limit, limit)
        q = q.astype(E4M3 if fmt == "mxfp8" else ml_dtypes.float4_e2m1fn).astype(np.float32)
        out = (q * s).reshape(x32.shape[:-1] + (n * block,))[..., :dim]
    return out.astype(np.asarray(x).dtype)


def assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    bits = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(nan_g, nan_w)
    bad = (got.view(bits) != want.view(bits)) & ~nan_w
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        pytest.fail(f"{bad.sum()} values differ; first at {i}: got {got[i]!r}, want {want[i]!r}")


def random_rows(seed: int = 0) -> np.ndarray:
    """[96, 512]: plain normals, per-block magnitudes 1e-40…1e36, and per-element magnitudes 2^-149…2^120."""
    rng = np.random.default_rng(seed)
    plain = rng.standard_normal((32, 512)) * 3
    blocks = rng.standard_normal((32, 512)) * np.repeat(10.0 ** rng.uniform(-40, 36, (32, 32)), 16, axis=-1)
    elements = rng.standard_normal((32, 512)) * 2.0 ** rng.uniform(-149, 120, (32, 512))
    return np.concatenate([plain, blocks, elements]).astype(np.float32)


def edge_rows() -> np.ndarray:
    """[R, 64] rows of crafted blocks (16-wide and 32-wide blocks both line up with them)."""
    mids = np.asarray(MIDPOINTS)
    rows = []

    def row(values):
        r = np.zeros(64)
        r[:len(values)] = values
        return r

    # e2m1 ties: amax 6 makes the scale 1 (mxfp4: 6·fp32(1/6) rounds to 1; nvfp4: e4m3(1) = 1), at many
    # powers of two; and a scale of 1.125 (nvfp4 only makes it: other formats see ordinary values)
    tie = np.concatenate([[6.0], mids, -mids, [0.5, -0.0, 0.0]])
    for k in range(-120, 121, 8):
        rows += [row(np.tile(tie, 2) * 2.0 ** k), row(np.tile(tie, 2) * 1.125 * 2.0 ** k)]
    # e4m3 ties for mxfp8 (amax 448 makes the scale 1): between normals and between subnormals
    e4 = [448, 1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, -5 * 2 ** -10, 13 * 2 ** -10, 2.0 ** -11, -0.0]
    rows += [row(np.asarray(e4) * 2.0 ** k) for k in range(-100, 101, 10)]
    # amax just below, at and above the values where a scale changes or saturates
    rng = np.random.default_rng(1)
    for base in (448.0, 6.0, 2688.0, 2784.0, 2790.0, 1e4, 1e30, 6 * 2.0 ** -9, 1e-4, 6 * 2.0 ** -126):
        b32 = np.float32(base)
        for amax in (np.nextafter(b32, np.float32(0)), b32, np.nextafter(b32, np.float32(np.inf))):
            for k in (-8, 0, 5):
                a = float(amax) * 2.0 ** k
                if a < 3e38:
                    rows.append(row(np.concatenate([[a], rng.uniform(-a, a, 63)])))
    # zeros: all-zero blocks, −0.0, tiny negatives that round to −0
    rows += [row([]), row([-0.0] * 64), row([1.0, -0.0, -1e-9, -0.1, 0.0] * 12)]
    # fp32 subnormals (XLA:CPU would flush them): scale at its floor 2^-126, and at 2^-125
    sub = 2.0 ** -126
    rows += [row(rng.uniform(-1, 1, 64) * sub), row([sub * 0.5, -sub * 0.5, sub * 0.3, sub * 0.75, sub * 1.1]),
             row([12 * sub, 0.75 * sub, -0.6 * sub, 0.3 * sub, 0.2 * sub, 2.0 ** -149])]
    return np.stack(rows).astype(np.float32)


CASES = {"random": random_rows, "edges": edge_rows}


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference_bit_for_bit(fmt, case, dtype):
    x = CASES[case]().astype(dtype)
    got = quantize_dequantize(x, fmt)
    assert got.dtype == x.dtype
    assert_same_bits(got, reference(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [1, 7, 33, 50, 130])
def test_partial_last_block_is_zero_padded(fmt, dim):
    x = np.random.default_rng(dim).standard_normal((9, dim)).astype(np.float32) * 5
    x[0, -1] = 1e3  # a large value alone in the partial block
    assert_same_bits(quantize_dequantize(x, fmt), reference(x, fmt))
    assert_same_bits(quantize_dequantize(x.astype(BF16), fmt), reference(x.astype(BF16), fmt))


def test_e2m1_ties_go_to_the_even_code():
    # block amax 6: scale 1; each midpoint goes to its neighbour with the even code (0,1,2,3,4,5,6,7 ↔
    # 0, .5, 1, 1.5, 2, 3, 4, 6)
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [6.0] + MIDPOINTS
    x[0, 8:15] = [-m for m in MIDPOINTS]
    want = np.asarray([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    for fmt in ("nvfp4", "mxfp4"):
        out = np.asarray(quantize_dequantize(x, fmt))
        np.testing.assert_array_equal(out[0, 1:8], want)
        np.testing.assert_array_equal(out[0, 8:15], -want)
        assert np.signbit(out[0, 8])  # −0.25 → −0


def test_e4m3_ties_and_scale_boundaries():
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -11)]
    out = np.asarray(quantize_dequantize(x, "mxfp8"))
    np.testing.assert_array_equal(out[0, :6], [448.0, 1.0, 1.25, 0.0, 2.0 ** -8, -0.0])
    assert np.signbit(out[0, 5])
    # amax 448·2^k: fp32(1/448)·amax rounds to exactly 2^k, the scale; one ulp above, the next power of two
    for amax, scale in ((np.float32(448 * 4), 4.0), (np.nextafter(np.float32(448 * 4), np.float32(np.inf)), 8.0)):
        rec = np.asarray(pack(np.full((1, 32), amax), "mxfp8"))
        assert rec[0, 32] == 127 + np.log2(scale)
        out = np.asarray(quantize_dequantize(np.full((1, 32), amax), "mxfp8"))
        assert out[0, 0] == 448 * 4  # at scale 8: 224.0001 → 224


def test_negative_zero_and_all_zero_blocks():
    x = np.zeros((2, 64), np.float32)
    x[1] = -0.0
    for fmt in FORMATS:
        for dtype in (np.float32, BF16):
            out = np.asarray(quantize_dequantize(x.astype(dtype), fmt)).astype(np.float32)
            np.testing.assert_array_equal(np.signbit(out), np.signbit(x))
            assert not out.any()


def test_nvfp4_scale_overflow_is_torch_cast():
    """amax/6 beyond e4m3: torch ≥ 2.12 (saturate=True) gives scale 448; torch ≤ 2.11 NaN above 464."""
    x = np.zeros((4, 16), np.float32)
    x[:, 1] = 300.0
    x[:, 0] = [6 * 464, 6 * 470, 1e30, np.inf]
    sat, nan = np.asarray(quantize_dequantize(x, "nvfp4")), np.asarray(quantize_dequantize(x, "nvfp4", saturate=False))
    # scale 448 (torch 2.13 casts inf to 448 too): amax/448 clips to 6, 300/448 = 0.67 → 0.5
    np.testing.assert_array_equal(sat[:, :2], [[2688, 224]] * 4)
    np.testing.assert_array_equal(nan[0, :2], [2688, 224])  # 464 rounds down to 448 (ties to even)
    assert np.isnan(nan[1:]).all()
    # mxfp8 never casts out of range; an inf makes the block's scale inf and the whole block NaN, as NeMo
    y = np.zeros((1, 32), np.float32)
    y[0, :2] = [np.inf, 1.0]
    assert np.isnan(np.asarray(quantize_dequantize(y, "mxfp8"))).all()


@pytest.mark.parametrize("fmt,dim,size", [("mxfp8", 512, 528), ("nvfp4", 512, 288), ("mxfp4", 128, 68),
                                          ("mxfp8", 50, 52), ("nvfp4", 7, 5), ("mxfp4", 33, 19)])
def test_record_sizes(fmt, dim, size):
    assert record_bytes(fmt, dim) == size
    rec = pack(np.ones((3, dim), np.float32), fmt)
    assert rec.dtype == jnp.uint8 and rec.shape == (3, size)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_pack_unpack_round_trip(fmt, dtype):
    x = random_rows(2).astype(dtype)
    edges = edge_rows().astype(dtype)
    for arr in (x, edges, x[:5, :37], x[:5, :128]):
        dim = arr.shape[-1]
        back = unpack(pack(arr, fmt), fmt, dtype, dim=dim)
        assert_same_bits(back, quantize_dequantize(arr, fmt))
    assert_same_bits(unpack(pack(x, fmt), fmt, dtype), quantize_dequantize(x, fmt))  # dim read off the record size


def test_record_layouts():
    x = np.zeros((512,), np.float32)
    x[:3] = [448.0, -2.0, 0.0078125]
    rec = np.asarray(pack(x, "mxfp8"))
    want = np.asarray([448.0, -2.0, 0.0078125], np.float32).astype(E4M3).view(np.uint8)
    np.testing.assert_array_equal(rec[:3], want)
    assert rec[512] == 127 and (rec[513:] == 105).all()  # scale 2^0; empty blocks: 2^-22 ≥ 1e-4/448

    x[:3] = [0.5, -3.0, 6.0]
    rec = np.asarray(pack(x, "nvfp4"))
    assert rec.shape == (288,)
    assert rec[0] == 0x1 | 0xD << 4  # channel 0 (0.5, code 1) in the low nibble, channel 1 (−3, code 8|5)
    assert rec[1] == 0x7  # 6.0 then 0
    assert rec[256] == 0x38  # e4m3 1.0
    assert (rec[257:] == 0x01).all()  # empty blocks: 6·2^-9 / 6 = 2^-9, e4m3's smallest subnormal

    rec = np.asarray(pack(x[:128], "mxfp4"))
    assert rec.shape == (68,) and rec[0] == 0xD1 and rec[1] == 0x7
    assert rec[64] == 127 and (rec[65:] == 1).all()  # 2^0, then the floor 2^-126


def test_mxfp8_scales_are_powers_of_two_within_range():
    x = np.concatenate([random_rows(3), edge_rows()[:, :32].repeat(16, axis=-1)])
    rec = np.asarray(pack(x, "mxfp8"))
    codes, scale_bytes = rec[:, :512], rec[:, 512:]
    assert ((codes & 0x7F) != 0x7F).all()  # no NaN codes
    values = codes.view(E4M3).astype(np.float32)
    assert np.abs(values).max() == 448.0 and (np.abs(values) <= 448).all()
    assert ((scale_bytes >= 1) & (scale_bytes <= 254)).all()
    scale = np.ldexp(np.float32(1), scale_bytes.astype(np.int32) - 127)
    _, exp = np.frexp(scale)
    np.testing.assert_array_equal(scale, np.ldexp(np.float32(0.5), exp))  # exactly powers of two
    # the smallest power of two ≥ max(amax, 1e-4) · fp32(1/448)
    v = np.maximum(np.abs(x.reshape(-1, 16, 32)).max(-1), np.float32(1e-4)) * np.float32(1 / 448)
    assert (scale >= v).all() and (scale / 2 < v).all()
    out = np.asarray(quantize_dequantize(x, "mxfp8"))
    np.testing.assert_array_equal(out, values * np.repeat(scale, 32, axis=-1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_jit_and_vmap(fmt):
    x = random_rows(4)[:8].reshape(2, 4, 512).astype(BF16)
    want = quantize_dequantize(x, fmt)
    assert_same_bits(jax.vmap(lambda r: quantize_dequantize(r, fmt))(x), want)
    assert_same_bits(jax.jit(jax.vmap(jax.vmap(functools.partial(quantize_dequantize, fmt=fmt))))(x), want)
    rec = jax.vmap(lambda r: pack(r, fmt))(x)
    np.testing.assert_array_equal(rec, pack(x, fmt))
    assert_same_bits(jax.jit(jax.vmap(lambda r: unpack(r, fmt, jnp.bfloat16)))(rec), want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cache format"):
        quantize_dequantize(np.ones(32, np.float32), "fp8")
    with pytest.raises(ValueError, match="take 288 bytes"):
        unpack(np.zeros((2, 287), np.uint8), "nvfp4", dim=512)
    with pytest.raises(ValueError, match="uint8"):
        unpack(np.zeros((2, 288), np.int8), "nvfp4")


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_rounding_passes_the_gradient_straight_through(fmt):
    """As NeMo's `quantize_cache`: the forward rounds, the backward is the identity, so what feeds a rounded cache
    (keys, index queries) still trains."""
    x = jnp.asarray(np.random.default_rng(0).normal(0, 2, (3, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(0, 1, (3, 64)), jnp.float32)
    value, grad = jax.value_and_grad(lambda v: jnp.sum(quantize_dequantize(v, fmt) * w))(x)
    assert float(value) == pytest.approx(float(jnp.sum(quantize_dequantize(x, fmt) * w)), rel=1e-6)
    assert not np.array_equal(np.asarray(quantize_dequantize(x, fmt)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w))
