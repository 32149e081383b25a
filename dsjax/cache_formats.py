"""DeepSeek-V4.1's KV and index cache formats (spec §3.3): quantize-dequantize, and packed byte records.

| format  | values | scale per block                     | used for (spec §2.4)             | NeMo quantize_cache |
|---------|--------|-------------------------------------|----------------------------------|---------------------|
| "mxfp8" | e4m3   | 32 channels, power of two (UE8M0)   | sliding-window KV, MXFP8 main KV | "fp8", block 32     |
| "nvfp4" | e2m1   | 16 channels, e4m3 (no global scale) | main compressed KV (default)     | "nvfp4", block 16   |
| "mxfp4" | e2m1   | 32 channels, power of two (UE8M0)   | index keys and index queries     | "mxfp4", block 32   |

Per block of the last axis, in fp32, with amax = max |x|:
- mxfp8: s = 2^⌈log2(max(amax, 1e-4)·fp32(1/448))⌉, read off the IEEE bits (exponent, +1 if the mantissa
  is nonzero); q = e4m3(clip(x/s, ±448)), round to nearest even.
- nvfp4: s = e4m3(max(amax, 6·2^-9) / 6); q = e2m1(clip(x/s, ±6)).
- mxfp4: s = 2^⌈log2(max(amax, 6·2^-126)·fp32(1/6))⌉; q = e2m1(clip(x/s, ±6)).
e2m1 rounds to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code (0.25→0, 0.75→1, 1.25→1,
1.75→2, 2.5→2, 3.5→4, 5→4); the sign is kept, so −0.0 and small negatives give −0. The result q·s is cast
to the input dtype (exact for bf16). A partial last block is zero-padded, as NeMo does. Like NeMo, the
power-of-two scales multiply by fp32(1/448) and fp32(1/6) (checked over whole binades: the same powers as
dividing). nvfp4 divides by 6, correctly rounded, as torch on CPU; torch on CUDA multiplies by fp32(1/6)
instead, which changes the e4m3 scale for one fp32 amax per binade (one ulp below 7.125·2^k).

**The e4m3 cast of the nvfp4 scale** beyond 448 (amax > 2688) follows torch's `.to(torch.float8_e4m3fn)`,
which changed: torch ≤ 2.11 on CPU (and CUDA builds before 13.2) round to nearest even and give NaN above
464 and for ±inf (c10 `fp8e4m3fn_from_fp32_value`, as ml_dtypes and XLA); torch ≥ 2.12 saturates finite
overflow to 448 (pytorch#178817; 2.13.0 on CPU also maps inf to 448; CUDA ≥ 13.2 builds use
`__NV_SATFINITE`), and DeepInfer's reference clamps to 448 before casting. `saturate=True` (default) is the
new behaviour, `saturate=False` the old. Below, nothing is lost: the floor makes the scale at least 2^-9,
e4m3's smallest subnormal.

Non-finite inputs go through the same operations as NeMo's (a group with inf comes out NaN in mxfp8 and
nvfp4), but only finite inputs are part of the contract, and packed records cannot hold them.

**Records** (`pack`/`unpack`, uint8 `[..., record_bytes(fmt, dim)]`), token-interleaved `[data | scales]`:
- mxfp8: dim e4m3 bytes, then ⌈dim/32⌉ UE8M0 bytes (byte b = 2^(b−127)): 528 B for dim 512;
- nvfp4: ⌈dim/2⌉ bytes of e2m1 codes, two per byte, the even channel in the low nibble, then ⌈dim/16⌉ e4m3
  scale bytes: 288 B for dim 512;
- mxfp4: ⌈dim/2⌉ bytes of e2m1 pairs, then ⌈dim/32⌉ UE8M0 bytes: 68 B for dim 128.
The nibble order of the FP4 caches is not confirmed by the spec (§3.3, §9); low-first is what DeepSeek's
FP4 weights use (as `quant.unpack_fp4`), and only the dequantized values matter to a port. DeepInfer stores
index keys page-wise (all the page's code bytes, then all its scale bytes); here every format is per-token.
An odd dim pads its last byte with a zero nibble.

XLA on CPU flushes subnormal fp32 operands and results to zero; torch does not. Only mxfp4 reaches that
range (its scale can be 2^-126), and it is computed around it, so results match torch there too.
`Records` holds cache rows stored so (the V4.1 cache's `kv_dtype` "fp8" / "fp4"); `dsjax.cache` reads and
writes it like V4's `quant.PackedKV`.
Pure functions, jitted with `fmt`, `saturate`, `dtype` and `dim` static; they trace inside `jit` and `vmap`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.quant import E2M1_VALUES, FP4_MAX, FP8_MAX, divide_rn, float_to_ue8m0, round_to_e4m3, \
    ue8m0_to_float, unpack_fp4

FORMATS = ("mxfp8", "nvfp4", "mxfp4")
BLOCK = {"mxfp8": 32, "nvfp4": 16, "mxfp4": 32}
# NeMo AutoModel's `quantize_cache(values, format=..., block_size=...)` arguments for each format.
NEMO_ARGS = {"mxfp8": ("fp8", 32), "nvfp4": ("nvfp4", 16), "mxfp4": ("mxfp4", 32)}

_AMAX_FLOOR = {"mxfp8": 1e-4, "nvfp4": 6 * 2.0 ** -9, "mxfp4": 6 * 2.0 ** -126}
_E2M1_MIDPOINTS = np.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_LEVELS = E2M1_VALUES[:8]  # code c (0-7) has magnitude _E2M1_LEVELS[c]; bit 3 is the sign
_MIN_NORMAL = np.float32(2.0 ** -126)


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"cache format must be one of {FORMATS}, got {fmt!r}")


def record_bytes(fmt: str, dim: int) -> int:
    """Bytes of one packed record of `dim` channels: 528 ("mxfp8", 512), 288 ("nvfp4", 512), 68 ("mxfp4", 128)."""
    _check(fmt)
    data = dim if fmt == "mxfp8" else -(-dim // 2)
    return data + -(-dim // BLOCK[fmt])


def _groups(x: jax.Array, block: int) -> jax.Array:
    """`[..., dim]` → fp32 `[..., ⌈dim/block⌉, block]`, the last group zero-padded."""
    x = x.astype(jnp.float32)
    pad = -x.shape[-1] % block
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (-1, block))


def _pow2_scale(v: jax.Array):
    """NeMo's power-of-two ceiling of v > 0 → (scale, exact 1/scale, UE8M0 byte), all `v`'s shape.

    For finite v the byte is `float_to_ue8m0`'s (exponent, +1 if the mantissa is nonzero; 1-253 here, so
    1/scale = 2^(127−b) is a normal fp32). NeMo writes (exponent + 1) << 23 into an int32: an inf v gives
    an inf scale and NaN a −0.0 one; those are kept so non-finite groups fail as NeMo's do."""
    byte = float_to_ue8m0(v)
    scale = ue8m0_to_float(byte)
    inverse = ue8m0_to_float((254 - byte.astype(jnp.int32)).astype(jnp.uint8))
    odd = jnp.where(jnp.isnan(v), jnp.float32(-0.0), jnp.float32(jnp.inf))
    finite = jnp.isfinite(v)
    scale = jnp.where(finite, scale, odd)
    inverse = jnp.where(finite, inverse, 1 / odd)  # 1/±0 and 1/inf are exact on every backend
    return scale, inverse, byte


def _divide(a: jax.Array, b) -> jax.Array:
    """a / b correctly rounded, with b broadcast to a's shape: XLA rewrites a / broadcast(b) (a constant
    too) as a · broadcast(1/b), which rounds twice and moves ties (seen on CPU); the barrier hides the
    broadcast. `quant.divide_rn` then keeps GPUs exact."""
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape))
    return divide_rn(a, b)


def _e4m3_scale(v: jax.Array, saturate: bool) -> jax.Array:
    """fp32 v > 0 (or NaN) rounded to e4m3 as torch's `.to(float8_e4m3fn)`, still fp32 (see the module doc)."""
    if saturate:
        return jnp.where(jnp.isnan(v), v, round_to_e4m3(jnp.minimum(v, FP8_MAX)))
    nan = (v > 464.0) | jnp.isnan(v)  # 464, the midpoint to the NaN code 480, still rounds down to 448
    return jnp.where(nan, jnp.float32(jnp.nan), round_to_e4m3(jnp.where(nan, 0.0, v)))


def _scaled_subnormals(g: jax.Array, inverse: jax.Array, byte: jax.Array) -> jax.Array:
    """g · inverse where g is an fp32 subnormal (XLA:CPU would read it as 0), for mxfp4's power-of-two scales.

    g = m·2^-149, 1/scale = 2^(127−b): g/scale = (m·2^-23)·2^(1−b), computed from normal operands; a result
    below 2^-126 rounds to a zero code whether or not it is flushed."""
    bits = jax.lax.bitcast_convert_type(g, jnp.uint32)
    mantissa = (bits & 0x7FFFFF).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0 ** -23)
    step = ue8m0_to_float(jnp.clip(128 - byte.astype(jnp.int32), 1, 254).astype(jnp.uint8))  # 2^(1−b)
    value = jnp.where(byte <= 127, mantissa * step, 0.0)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
    return jnp.where(subnormal, jnp.copysign(value, g), g * inverse)


def _round_e2m1(normalized: jax.Array):
    """|normalized| ≤ 6 → (value, code 0-15), nearest e2m1 with ties to the even code.

    Counts the midpoints not ≥ |x| (torch.bucketize's lower bound, which sends NaN to the top code 6.0)
    and steps up off a tie whose lower neighbour has an odd code. Comparisons only: exact everywhere."""
    mag = jnp.abs(normalized)[..., None]
    mids = jnp.asarray(_E2M1_MIDPOINTS)
    lower = jnp.sum(~(mids >= mag), axis=-1)
    tie = jnp.any(mag == mids, axis=-1)
    index = lower + (tie & (lower % 2 == 1)).astype(lower.dtype)
    value = jnp.copysign(jnp.asarray(_E2M1_LEVELS)[index], normalized)
    code = index.astype(jnp.uint8) | (jnp.signbit(normalized).astype(jnp.uint8) << 3)
    return value, code


def _encode(x: jax.Array, fmt: str, saturate: bool):
    """`x [..., dim]` → (values q fp32 `[..., G, B]`, scale fp32 `[..., G, 1]`, codes uint8 `[..., G, B]`,
    scale bytes uint8 `[..., G]`)."""
    _check(fmt)
    g = _groups(jnp.asarray(x), BLOCK[fmt])
    # max propagates NaN (as torch's amax and clamp_min): NaN-containing groups fail as NeMo's do.
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True), np.float32(_AMAX_FLOOR[fmt]))
    if fmt == "nvfp4":
        scale = _e4m3_scale(_divide(amax, FP4_MAX), saturate)
        scale_bytes = jax.lax.bitcast_convert_type(scale.astype(jnp.float8_e4m3fn), jnp.uint8)[..., 0]
        values, codes = _round_e2m1(jnp.clip(_divide(g, scale), -FP4_MAX, FP4_MAX))
        return values, scale, codes, scale_bytes
    limit = FP8_MAX if fmt == "mxfp8" else FP4_MAX
    scale, inverse, scale_bytes = _pow2_scale(amax * np.float32(1 / limit))
    if fmt == "mxfp8":
        values = round_to_e4m3(jnp.clip(g * inverse, -FP8_MAX, FP8_MAX))
        codes = jax.lax.bitcast_convert_type(values.astype(jnp.float8_e4m3fn), jnp.uint8)
        return values, scale, codes, scale_bytes[..., 0]
    values, codes = _round_e2m1(jnp.clip(_scaled_subnormals(g, inverse, scale_bytes), -FP4_MAX, FP4_MAX))
    return values, scale, codes, scale_bytes[..., 0]


def _decode(values: jax.Array, scale: jax.Array, fmt: str, dim: int, dtype) -> jax.Array:
    """q · scale (exact) `[..., G, B]` → `[..., dim]` in `dtype`."""
    out = values * scale
    if fmt == "mxfp4":  # 0.5 · 2^-126 is the one subnormal product; XLA:CPU would flush it to 0
        tiny = jax.lax.bitcast_convert_type(jnp.uint32(0x00400000), jnp.float32)
        out = jnp.where((scale == _MIN_NORMAL) & (jnp.abs(values) == 0.5), jnp.copysign(tiny, values), out)
    out = out.reshape(out.shape[:-2] + (-1,))[..., :dim]
    return out.astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "saturate"))
def quantize_dequantize(x, fmt: str, *, saturate: bool = True) -> jax.Array:
    """`x [..., dim]` through the cache format `fmt` and back, in x's dtype: NeMo's `quantize_cache` bit for
    bit (`NEMO_ARGS[fmt]`), with its straight-through gradient (the rounding passes the gradient unchanged, so
    what feeds a rounded cache still trains). `saturate`: how an nvfp4 scale over 448 is cast (module doc)."""
    return _straight_through(jnp.asarray(x), fmt, saturate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _straight_through(x: jax.Array, fmt: str, saturate: bool) -> jax.Array:
    values, scale, _, _ = _encode(x, fmt, saturate)
    return _decode(values, scale, fmt, x.shape[-1], x.dtype)


def _straight_through_fwd(x, fmt, saturate):
    return _straight_through(x, fmt, saturate), None


def _straight_through_bwd(fmt, saturate, _, grad):
    return (grad,)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


@functools.partial(jax.jit, static_argnames=("fmt", "saturate"))
def pack(x, fmt: str, *, saturate: bool = True) -> jax.Array:
    """`x [..., dim]` → uint8 records `[..., record_bytes(fmt, dim)]`, `[data | scales]` (module doc).
    Finite inputs only."""
    x = jnp.asarray(x)
    dim = x.shape[-1]
    _, _, codes, scale_bytes = _encode(x, fmt, saturate)
    codes = codes.reshape(codes.shape[:-2] + (-1,))[..., :dim]
    if fmt != "mxfp8":  # two e2m1 codes a byte, the even channel in the low nibble
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, dim % 2)])
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return jnp.concatenate([codes, scale_bytes], axis=-1)


def _record_dim(fmt: str, size: int) -> int:
    """The largest dim whose records take `size` bytes (a record's size alone can't tell 2k−1 from 2k)."""
    for dim in range(2 * size, 0, -1):
        if record_bytes(fmt, dim) == size:
            return dim
    raise ValueError(f"no {fmt} record takes {size} bytes")


@functools.partial(jax.jit, static_argnames=("fmt", "dtype", "dim"))
def unpack(records, fmt: str, dtype=jnp.bfloat16, *, dim: int | None = None) -> jax.Array:
    """uint8 records `[..., record_bytes(fmt, dim)]` → values `[..., dim]` in `dtype`;
    `unpack(pack(x, f), f, x.dtype)` equals `quantize_dequantize(x, f)` bit for bit. `dim` defaults to the
    largest that fits the record size (pass it for an odd dim of an FP4 format)."""
    _check(fmt)
    records = jnp.asarray(records)
    if records.dtype != jnp.uint8:
        raise ValueError(f"cache records are uint8, got {records.dtype}")
    size = records.shape[-1]
    dim = _record_dim(fmt, size) if dim is None else dim
    if record_bytes(fmt, dim) != size:
        raise ValueError(f"{fmt} records of {dim} channels take {record_bytes(fmt, dim)} bytes, got {size}")
    block, n_data = BLOCK[fmt], size - -(-dim // BLOCK[fmt])
    data, scale_bytes = records[..., :n_data], records[..., n_data:]
    if fmt == "mxfp8":
        values = jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn).astype(jnp.float32)
        scale = ue8m0_to_float(scale_bytes)
    else:
        values = unpack_fp4(data)[..., :dim]
        scale = ue8m0_to_float(scale_bytes) if fmt == "mxfp4" else \
            jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)
    groups = scale_bytes.shape[-1]
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, groups * block - dim)])
    values = values.reshape(values.shape[:-1] + (groups, block))
    return _decode(values, scale[..., None], fmt, dim, dtype)


# The V4.1 cache's storage per `kv_dtype`: (window, compressed entries, index keys).
V41_STORAGE = {"fp8": ("mxfp8", "mxfp8", "mxfp4"), "fp4": ("mxfp8", "nvfp4", "mxfp4")}


def v41_row_bytes(kv_dtype: str, head_dim: int, index_head_dim: int) -> tuple[int, int, int]:
    """Bytes of one (window row, compressed entry, index key) of a V4.1 cache in packed `kv_dtype`."""
    if kv_dtype not in V41_STORAGE:
        raise ValueError(f"kv_dtype must be one of {sorted(V41_STORAGE)} (the release's packed formats), "
                         f"got {kv_dtype!r}")
    window, entry, key = V41_STORAGE[kv_dtype]
    return record_bytes(window, head_dim), record_bytes(entry, head_dim), record_bytes(key, index_head_dim)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=["fmt", "dim"])
@dataclasses.dataclass
class Records:
    """Cache rows `[..., dim]` stored as packed records `data` uint8 `[..., record_bytes(fmt, dim)]`."""

    data: jax.Array
    fmt: str
    dim: int

    @classmethod
    def zeros(cls, shape: tuple[int, ...], fmt: str) -> "Records":
        """Empty rows of `shape` (`[..., dim]`); all-zero records read as zeros."""
        return cls(jnp.zeros(shape[:-1] + (record_bytes(fmt, shape[-1]),), jnp.uint8), fmt, shape[-1])

    @classmethod
    def of(cls, x: jax.Array, fmt: str) -> "Records":
        """Rows `x [..., dim]` packed (finite values only)."""
        return cls(pack(x, fmt), fmt, x.shape[-1])

    def values(self, dtype) -> jax.Array:
        """The rows as `dtype` values: `quantize_dequantize` of what was packed."""
        return unpack(self.data, self.fmt, dtype, dim=self.dim)
