"""DeepSeek-V4's low-precision weight formats: FP8 block-scaled linears and FP4 routed experts.

- **FP8** (`float8_e4m3fn`, weight `[..., out, in]`) with one scale per 128 × 128 block,
  `scale [..., ⌈out/128⌉, ⌈in/128⌉]`, stored as fp32 or as ue8m0 (a power of two, byte b = 2^(b−127)).
  The checkpoint calls it `weight_scale_inv`, but it is the multiplier: `W[i,j] = q[i,j]·s[i//128, j//128]`.
  Edge blocks may be partial.
- **FP4** (e2m1) with two codes per byte, the low nibble holding the even column, and one ue8m0 scale per
  row per 32 consecutive input elements: `W[o,k] = e2m1(code[o,k])·s[o, k//32]`, packed `int8 [..., out, in/2]`
  and scale `[..., out, in/32]`.

Dequantization multiplies in fp32 (exact for FP4, one rounding for FP8), as the reference does, then
casts. Every function takes numpy or JAX arrays, returns JAX arrays and is traceable under `jit`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP8_BLOCK = (128, 128)
FP4_GROUP = 32
FP4_MAX = 6.0
# e2m1 codes 0-15; bit 3 is the sign.
E2M1_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                         np.float32)


def ue8m0_to_float(scale) -> jnp.ndarray:
    """A ue8m0 scale (uint8 bytes or `float8_e8m0fnu`) as fp32: 2^(b−127), built from its bits so it is
    exact on every backend (255 is NaN); other dtypes are cast to fp32."""
    scale = jnp.asarray(scale)
    if scale.dtype == jnp.float8_e8m0fnu:
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    if scale.dtype != jnp.uint8:
        return scale.astype(jnp.float32)
    return ue8m0_bytes_to_float(scale.astype(jnp.uint32))


def ue8m0_bytes_to_float(b) -> jnp.ndarray:
    """ue8m0 byte values held in 32-bit integers (uint32, or int32 in 0-255) → fp32 2^(b−127)."""
    bits = jnp.where(b == 0, jnp.asarray(0x00400000, b.dtype), b << 23)  # b = 0: the subnormal 2^-127
    bits = jnp.where(b == 255, jnp.asarray(0x7FC00000, b.dtype), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def float_to_ue8m0(x) -> jnp.ndarray:
    """The ue8m0 byte of the smallest power of two ≥ x (x > 0), as uint8; read off x's bits, so exact."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32)
    inexact = (bits & 0x7FFFFF) != 0
    return jnp.clip(exponent + inexact.astype(jnp.int32), 0, 254).astype(jnp.uint8)


def _expand_blocks(scale, rows: int, cols: int, block: tuple[int, int]):
    """`[..., R, C]` block scales → `[..., rows, cols]`, trimming partial edge blocks."""
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :rows, :cols]


def dequantize_fp8(q, scale, dtype=jnp.float32, block: tuple[int, int] = FP8_BLOCK) -> jnp.ndarray:
    """`q [..., out, in]` e4m3 with block scales `[..., ⌈out/bm⌉, ⌈in/bn⌉]` (fp32 or ue8m0) → `dtype`."""
    q = jnp.asarray(q)
    rows, cols = q.shape[-2:]
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(f"FP8 weight {tuple(q.shape)} needs block scales {want} for blocks {block}, "
                         f"got {tuple(scale.shape)}")
    s = _expand_blocks(ue8m0_to_float(scale), rows, cols, block)
    return (q.astype(jnp.float32) * s).astype(dtype)


def divide_rn(a, b) -> jnp.ndarray:
    """`a / b` in fp32, correctly rounded (ties to even) on every backend.

    XLA:GPU divides fp32 approximately (measured on an H200: 30% of quotients off by an ulp), which
    moves quantization scales, and so codes, against CPU and torch. There `long_division` computes
    it; XLA:CPU's division is IEEE already (and compiles the long division slowly).
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return jax.lax.platform_dependent(a, b, cpu=jnp.divide, default=long_division)


def long_division(a, b) -> jnp.ndarray:
    """`a / b` for fp32 arrays of one shape by long division of the mantissas in uint32, correctly
    rounded for normal operands and results of either sign; anything else falls back to `a / b`."""
    ab, bb = (jax.lax.bitcast_convert_type(v, jnp.uint32) for v in (a, b))
    sign = (ab ^ bb) & jnp.uint32(0x80000000)
    ab, bb = ab & 0x7FFFFFFF, bb & 0x7FFFFFFF
    ea, eb = (ab >> 23).astype(jnp.int32), (bb >> 23).astype(jnp.int32)
    ma, mb = (ab & 0x7FFFFF) | 0x800000, (bb & 0x7FFFFF) | 0x800000
    below = ma < mb  # scale the dividend so the quotient lies in [1, 2)
    r = jnp.where(below, ma << 1, ma)
    exponent = ea - eb + 127 - below.astype(jnp.int32)
    q = jnp.zeros_like(r)
    for _ in range(25):  # 24 significant bits and a guard bit; r < 2·mb < 2^25 throughout
        bit = r >= mb
        r = jnp.where(bit, r - mb, r) << 1
        q = (q << 1) | bit.astype(jnp.uint32)
    mant = q >> 1
    round_up = (q & 1).astype(bool) & ((r != 0) | (mant & 1).astype(bool))
    mant = mant + round_up.astype(jnp.uint32)
    carry = (mant >> 24).astype(jnp.int32)
    mant, exponent = jnp.where(carry > 0, mant >> 1, mant), exponent + carry
    bits = sign | (exponent.astype(jnp.uint32) << 23) | (mant & 0x7FFFFF)
    usable = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255) & (exponent > 0) & (exponent < 255)
    return jnp.where(usable, jax.lax.bitcast_convert_type(bits, jnp.float32), a / b)


def _inverse_power_of_two(scale_bytes) -> jnp.ndarray:
    """1 / 2^(b−127) for ue8m0 bytes b, exactly (a multiply never needs a division)."""
    return ue8m0_to_float((254 - scale_bytes.astype(jnp.int32)).astype(jnp.uint8))


def round_to_e4m3(x) -> jnp.ndarray:
    """fp32 values (|x| ≤ 448) rounded to the nearest e4m3 value, ties to even, still as fp32.

    The cast to e4m3 is then exact on every backend: XLA:GPU may convert fp32 → e4m3 through fp16,
    which rounds twice and changes a few codes against CPU and torch."""
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    lsb = (bits >> 20) & 1  # keep 3 of fp32's 23 mantissa bits
    normal = jax.lax.bitcast_convert_type((bits + 0x7FFFF + lsb) & jnp.uint32(0xFFF00000), jnp.float32)
    quantum = jnp.float32(2.0 ** -9)  # e4m3 subnormals: multiples of 2^-9 below 2^-6
    subnormal = jnp.round(x / quantum) * quantum
    return jnp.where(jnp.abs(x) < 2.0 ** -6, subnormal, normal)


def quantize_fp8(w, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "float"):
    """`w [..., out, in]` → (e4m3 `q`, block scales): each block's max |w| maps to ±448.

    `scale_fmt`: "float" (fp32 scales) or "ue8m0" (uint8 power-of-two scales, rounded up so no value
    overflows). Edge blocks may be partial; an all-zero block gets scale 1. The arithmetic is the
    reference quantizer's (fp32, multiply by 448/amax), so whole blocks give the same bytes. Traceable;
    with `block=(1, n)` it scales each row's n-element groups (the cache's format).
    """
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'float' or 'ue8m0', got {scale_fmt!r}")
    w = jnp.asarray(w, jnp.float32)
    lead, (rows, cols) = w.shape[:-2], w.shape[-2:]
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, br * block[0] - rows), (0, bc * block[1] - cols)])
    tiles = padded.reshape(lead + (br, block[0], bc, block[1]))
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    forward = jnp.where(amax > 0, divide_rn(FP8_MAX, jnp.where(amax > 0, amax, 1)), jnp.float32(1))
    stored = divide_rn(1, forward)
    if scale_fmt == "ue8m0":
        stored = float_to_ue8m0(stored)
        forward = _inverse_power_of_two(stored)
    scaled = tiles * forward[..., :, None, :, None]
    q = round_to_e4m3(jnp.clip(scaled, -FP8_MAX, FP8_MAX)).astype(FP8)
    return q.reshape(padded.shape)[..., :rows, :cols], stored


def unpack_fp4(packed) -> jnp.ndarray:
    """`int8/uint8 [..., n]`, two e2m1 codes per byte (low nibble first) → fp32 values `[..., 2n]`."""
    u8 = jnp.asarray(packed)
    u8 = u8.view(jnp.uint8) if u8.dtype == jnp.int8 else u8
    lut = jnp.asarray(E2M1_VALUES)
    low, high = lut[u8 & 0xF], lut[(u8 >> 4) & 0xF]
    return jnp.stack([low, high], axis=-1).reshape(u8.shape[:-1] + (2 * u8.shape[-1],))


def dequantize_fp4(packed, scale, dtype=jnp.float32, group: int = FP4_GROUP) -> jnp.ndarray:
    """Packed e2m1 `[..., out, in/2]` with ue8m0 scales `[..., out, in/group]` → `[..., out, in]`."""
    values = unpack_fp4(packed)
    cols = values.shape[-1]
    want = tuple(values.shape[:-1]) + (-(-cols // group),)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 weight of {cols} columns per row {tuple(values.shape[:-1])} needs scales "
                         f"{want}, got {tuple(scale.shape)}")
    s = jnp.repeat(ue8m0_to_float(scale), group, axis=-1)[..., :cols]
    return (values * s).astype(dtype)


def quantize_fp4(w, group: int = FP4_GROUP, partial: bool = False):
    """`w [..., out, in]` (in divisible by `group`) → (packed int8 `[..., out, in/2]`, ue8m0 uint8 scales
    `[..., out, in/group]`). Each group's scale is the smallest power of two that fits its max |w| in ±6;
    values round to the nearest e2m1 (ties to even). `partial` allows a shorter last group (the cache
    format; checkpoints never have one). Traceable."""
    w = jnp.asarray(w, jnp.float32)
    cols = w.shape[-1]
    if cols % 2 or (cols % group and not partial):
        raise ValueError(f"FP4 needs the input dimension ({cols}) to be a multiple of {group}")
    n_groups = -(-cols // group)
    groups = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, n_groups * group - cols)])
    groups = groups.reshape(w.shape[:-1] + (n_groups, group))
    amax = jnp.max(jnp.abs(groups), axis=-1)
    stored = float_to_ue8m0(jnp.where(amax > 0, divide_rn(amax, FP4_MAX), 1.0))
    scaled = groups * _inverse_power_of_two(stored)[..., None]
    codes = jax.lax.bitcast_convert_type(scaled.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
    codes = codes.reshape(w.shape[:-1] + (n_groups * group,))[..., :cols]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return jax.lax.bitcast_convert_type(packed, jnp.int8), stored


# ------------------------------------------------------------------------------------------ KV cache
KV_DTYPES = ("bfloat16", "fp8", "fp4")
KV_FP8_GROUP = 64  # attention K=V rows: one fp32 scale per 64 channels (448 = 7 × 64 on V4)
INDEX_FP8_GROUP = 128  # indexer keys: one fp32 scale per 128 channels, as DeepSeek-V3.2's indexer cache


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales", "rope"],
                   meta_fields=["group"])
@dataclasses.dataclass
class PackedKV:
    """Cache rows `[..., width]` held low precision: the leading `width − rd` channels as codes with
    per-group scales, the trailing rd rotary channels (V4's RoPE slice) in bf16.

    - fp8: `codes` e4m3 `[..., n]`, `scales` fp32 `[..., ⌈n/group⌉]`;
    - fp4: `codes` int8 `[..., n/2]` (two e2m1, low nibble first), `scales` ue8m0 uint8 `[..., ⌈n/32⌉]`.
    """

    codes: jax.Array
    scales: jax.Array
    rope: jax.Array
    group: int

    @property
    def fmt(self) -> str:
        return "fp8" if self.codes.dtype == FP8 else "fp4"


def pack_kv(x, fmt: str, rope_dim: int, group: int = KV_FP8_GROUP) -> PackedKV:
    """Rows `x [..., width]` → PackedKV in `fmt` ("fp8" or "fp4"; fp4 always uses groups of 32)."""
    x = jnp.asarray(x)
    n = x.shape[-1] - rope_dim
    body = x[..., :n].astype(jnp.float32)
    if fmt == "fp8":
        q, s = quantize_fp8(body[..., None, :], (1, group))
        codes, scales = q[..., 0, :], s[..., 0, :]
    elif fmt == "fp4":
        group = FP4_GROUP
        codes, scales = quantize_fp4(body, group, partial=True)
    else:
        raise ValueError(f"cache rows pack as 'fp8' or 'fp4', got {fmt!r}")
    return PackedKV(codes, scales, x[..., n:].astype(jnp.bfloat16), group)


def unpack_kv(p: PackedKV, dtype) -> jax.Array:
    """PackedKV → rows `[..., width]` in `dtype`."""
    if p.fmt == "fp8":
        body = dequantize_fp8(p.codes[..., None, :], p.scales[..., None, :], dtype, (1, p.group))[..., 0, :]
    else:
        body = dequantize_fp4(p.codes, p.scales, dtype, p.group)
    return jnp.concatenate([body, p.rope.astype(dtype)], axis=-1)


def empty_kv(shape: tuple[int, ...], fmt: str, rope_dim: int, group: int = KV_FP8_GROUP) -> PackedKV:
    """All-zero PackedKV rows of `shape` (`[..., width]`); they unpack to zeros."""
    return jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: pack_kv(jnp.zeros(shape, jnp.float32), fmt,
                                                                             rope_dim, group)))
