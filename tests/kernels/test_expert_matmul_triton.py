"""The grouped matmul over FP8/FP4 experts: the Pallas kernel (interpreted) against the reference on
random inputs, its tiling of the groups, its CUDA lowering, and what it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.export import abstract_device, disabled_checks
from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.expert_matmul.fp4_codes import repack_codes
from dsjax.kernels.expert_matmul.op import expert_matmul
from dsjax.kernels.expert_matmul.reference import expert_matmul_reference
from dsjax.kernels.expert_matmul.triton import addressable, expert_matmul_gpu, group_tiles
from dsjax.quant import quantize_fp4, quantize_fp8
from dsjax.stacked import StackedSlice


def experts(storage: str, e: int, n: int, k: int, seed: int = 0, block: int = 128):
    """Random experts `[E, N, K]` quantized as the checkpoint stores them, with a wide spread of scales
    (FP8: in `block` × `block` blocks)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((e, n, k)) * np.logspace(-4, 0, k)[None, None, rng.permutation(k)]
    w = jnp.asarray(w, jnp.float32)
    return quantize_fp4(w) if storage == "fp4" else quantize_fp8(w, (block, block), "ue8m0")


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
@pytest.mark.parametrize("sizes,extra,k,n", [
    ([3, 0, 17, 1, 6], 0, 256, 256),     # an empty group, a group over two tiles
    ([0, 0, 40, 0, 0], 5, 384, 256),     # one group of three tiles; rows routed to no group after it
    ([1, 1, 1, 1, 1], 11, 512, 64),      # 64 outputs: FP4 in column blocks of 64, not 128
    ([2, 0, 3], 1, 256, 256),            # 6 rows (one token): FP4 in column blocks of 64
    ([0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1], 2, 256, 64),  # decode: fewer rows than experts
])
def test_kernel_matches_reference(storage, sizes, extra, k, n):
    """Random experts with scales spread over 2^13 (FP4 steps of 256 inputs, or 128 where K = 384)."""
    e = len(sizes)
    q, s = experts(storage, e, n, k, seed=len(sizes) + extra)
    p = sum(sizes) + extra
    x = jnp.asarray(np.random.default_rng(extra).standard_normal((p, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(expert_matmul_gpu(x, q, s, group_sizes, storage, interpret=True), np.float32)[:sum(sizes)]
    want = np.asarray(expert_matmul_reference(x, q, s, group_sizes, storage), np.float32)[:sum(sizes)]
    # Every product is exact in both; the fp32 sums run in another order, then round to bf16.
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())


def spread_fp4_scales(n: int, k: int, groups: tuple[int, int, int]):
    """One expert of FP4 codes all 0.5 (`[1, n, k/2]`), scales 2^0 but for three groups: 2^10, 2^-14 and
    2^-20; one row routed to it."""
    codes = jnp.full((1, n, k // 2), 0x11, jnp.uint8)
    exponents = np.full((1, n, k // 32), 127, np.uint8)
    for g, exponent in zip(groups, (127 + 10, 127 + 10 - 24, 127 + 10 - 30)):
        exponents[..., g] = exponent
    return codes, jnp.asarray(exponents), jnp.asarray([1], jnp.int32)


def test_fp4_scales_relative_to_the_steps_largest_are_exact_down_to_2_pow_minus_24():
    """FP4 codes are scaled in fp16 relative to the largest scale of their 256-input step: a group 2^24
    below it is still exact; one 2^30 below rounds to zero (an error under 2^-25 of the largest)."""
    n, k = 128, 256
    codes, scale, sizes = spread_fp4_scales(n, k, (0, 1, 2))
    for column, want in ((0, 0.5 * 2.0 ** 10), (32, 0.5 * 2.0 ** -14), (64, 0.0)):
        x = jnp.zeros((1, k), jnp.bfloat16).at[0, column].set(1)
        got = expert_matmul_gpu(x, codes, scale, sizes, "fp4", interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.full((1, n), want, np.float32))
    reference = expert_matmul_reference(x, codes, scale, sizes, "fp4")
    np.testing.assert_array_equal(np.asarray(reference, np.float32), np.full((1, n), 0.5 * 2.0 ** -20, np.float32))


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_scales_as_float8_e8m0fnu_read_as_their_bytes(storage):
    """Scales held as `float8_e8m0fnu` (how a checkpoint may type them) give the uint8 bytes' result."""
    q, s = experts(storage, 2, 128, 256)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 256)), jnp.bfloat16)
    sizes = jnp.asarray([4, 2], jnp.int32)
    typed = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    np.testing.assert_array_equal(
        np.asarray(expert_matmul_gpu(x, q, typed, sizes, storage, interpret=True), np.float32),
        np.asarray(expert_matmul_gpu(x, q, s, sizes, storage, interpret=True), np.float32))


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_kernel_reads_one_layer_of_stacked_experts_in_place(storage):
    """With `layer`, the kernel reads that entry of `[L, E, …]` stacks: the same result as the kernel on
    the layer cut out, and (through the op, given `StackedSlice`s) as the reference on it."""
    layers = [experts(storage, 3, 128, 256, seed=s) for s in range(3)]
    q, s = jnp.stack([w for w, _ in layers]), jnp.stack([sc for _, sc in layers])
    sizes = jnp.asarray([2, 0, 5], jnp.int32)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 256)), jnp.bfloat16)
    for layer in range(3):
        got = expert_matmul_gpu(x, q, s, sizes, storage, jnp.int32(layer), interpret=True)[:7]
        alone = expert_matmul_gpu(x, q[layer], s[layer], sizes, storage, interpret=True)[:7]
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
        index = jnp.int32(layer)
        via_op = expert_matmul(x, StackedSlice(q, index), StackedSlice(s, index), sizes, storage, kernels="interpret")
        want = expert_matmul_reference(x, q[layer], s[layer], sizes, storage)[:7]
        np.testing.assert_array_equal(np.asarray(via_op[:7], np.float32), np.asarray(got, np.float32))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7,
                                   atol=1e-3 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("sizes,k,n,stacked", [
    ([2, 0, 3], 256, 256, False),           # one token: column blocks of 64
    ([3, 0, 17, 1, 6], 384, 128, True),     # steps of 128 inputs; one layer of a stack
])
def test_repacked_codes_give_the_same_result_bit_for_bit(sizes, k, n, stacked):
    q, s = experts("fp4", len(sizes), n, k, seed=3)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((sum(sizes) + 2, k)) * 3, jnp.bfloat16)
    group_sizes, layer = jnp.asarray(sizes, jnp.int32), ()
    if stacked:
        other_q, other_s = experts("fp4", len(sizes), n, k, seed=4)
        q, s, layer = jnp.stack([other_q, q]), jnp.stack([other_s, s]), (jnp.int32(1),)
    want = expert_matmul_gpu(x, q, s, group_sizes, "fp4", *layer, interpret=True)
    got = expert_matmul_gpu(x, repack_codes(q), s, group_sizes, "fp4", *layer, code_layout="repacked",
                            interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[:sum(sizes)], np.asarray(want, np.float32)[:sum(sizes)])


@pytest.mark.parametrize("rows", [12, 200])  # the Triton kernel; the Mosaic GPU kernel (MIN_ROWS on)
def test_op_on_repacked_codes_equals_the_op_on_the_checkpoints(rows):
    """Through the op, interpreted and by the reference (which puts the codes back first): the same
    result from repacked codes as from the checkpoint's, bit for bit."""
    q, s = experts("fp4", 4, 128, 512, seed=5)
    sizes = jnp.asarray(np.random.default_rng(rows).multinomial(rows, np.ones(4) / 4), jnp.int32)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((rows, 512)), jnp.bfloat16)
    for kernels in ("interpret", "reference"):
        want = expert_matmul(x, q, s, sizes, "fp4", kernels=kernels)
        got = expert_matmul(x, repack_codes(q), s, sizes, "fp4", code_layout="repacked", kernels=kernels)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=kernels)


def test_stacked_experts_reach_the_cuda_kernel_uncopied():
    """Given a `StackedSlice`, the op lowered for cuda hands the whole stack to the kernel: no op cuts
    the layer out (XLA would copy such a slice for a Triton call)."""
    q, s = (jnp.stack([a, a]) for a in experts("fp4", 4, 128, 256))

    def fn(x, g, i):
        return expert_matmul(x, StackedSlice(q, i), StackedSlice(s, i), g, "fp4")

    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            jax.ShapeDtypeStruct((24, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32)).mlir_module()
    assert "dsjax_expert_matmul" in text
    for layer in ("4x128x128xi8", "4x128x32xi32"):  # one layer's codes, as stored or as the kernel's words
        assert f"tensor<{layer}>" not in text and f"tensor<1x{layer}>" not in text


def test_addressable_follows_the_lowerings_offset_width():
    """int32 offsets up to 2^32 bytes, int64 past them: 2^31 + 1 bytes cannot be addressed, 2^32 + 2 can."""
    assert addressable(jax.ShapeDtypeStruct((2 ** 31,), jnp.int8))
    assert not addressable(jax.ShapeDtypeStruct((2 ** 31 + 1,), jnp.int8))
    assert not addressable(jax.ShapeDtypeStruct((2 ** 32,), jnp.int8))
    assert addressable(jax.ShapeDtypeStruct((2 ** 32 + 2,), jnp.int8))
    assert addressable(jax.ShapeDtypeStruct((2 ** 31,), jnp.int16))
    assert addressable(jax.ShapeDtypeStruct((3 * 2 ** 31,), jnp.int16))
    assert addressable(jax.ShapeDtypeStruct((2 ** 31 + 1,), jnp.int32))


@pytest.mark.parametrize("sizes,n_rows,tiles", [
    ([3, 0, 17, 1, 0, 33], 60, -(-60 // 16) + 6),  # more rows than experts: ⌈P / 16⌉ + E tiles
    ([1, 0, 2, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0] * 2, 12, 12),  # decode: fewer rows than experts, P tiles
    ([1] * 12, 12, 12),  # every tile holds a row
])
def test_group_tiles_cover_every_grouped_row_once(sizes, n_rows, tiles):
    group, row0, rows = (np.asarray(a) for a in group_tiles(jnp.asarray(sizes, jnp.int32), n_rows, 16))
    assert len(group) == tiles
    covered = np.concatenate([np.arange(r, r + c) for r, c in zip(row0, rows) if c])
    np.testing.assert_array_equal(np.sort(covered), np.arange(sum(sizes)))
    owner = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    for g, r, c in zip(group, row0, rows):
        assert c == 0 or set(owner[r:r + c]) == {g}
        assert 0 <= c <= 16


def test_op_falls_back_to_the_reference_for_many_rows_per_expert():
    """Past 64 rows per expert the kernel would read every expert's codes again and again: the op
    dequantizes once instead (lowered for cuda, no kernel call)."""
    q, s = experts("fp8", 2, 128, 128)
    group_sizes = jax.ShapeDtypeStruct((2,), jnp.int32)

    def lowered(rows):
        fn = jax.jit(lambda x, g: expert_matmul(x, q, s, g, "fp8"))
        h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
        with jax.sharding.use_abstract_mesh(h200):
            return jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
                jax.ShapeDtypeStruct((rows, 128), jnp.bfloat16), group_sizes).mlir_module()

    assert "dsjax_expert_matmul" in lowered(128)
    assert "dsjax_expert_matmul" not in lowered(129)


@pytest.mark.parametrize("storage,code_layout", [("fp8", "checkpoint"), ("fp4", "checkpoint"), ("fp4", "repacked")])
def test_lowers_for_cuda(storage, code_layout):
    q, s = experts(storage, 4, 128, 256)
    fn = jax.jit(lambda x, g: expert_matmul_gpu(x, q, s, g, storage, code_layout=code_layout))
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            jax.ShapeDtypeStruct((24, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32)).mlir_module()
    assert "dsjax_expert_matmul" in text


@pytest.mark.parametrize("change,message,untileable", [
    (lambda x, q, s: (x.astype(jnp.float32), q, s, "fp8"), "activations must be bf16", True),
    (lambda x, q, s: (x, q, s.astype(jnp.float32), "fp8"), "ue8m0", True),
    (lambda x, q, s: (x[:, :128], q, s, "fp8"), "do not tile", True),
    (lambda x, q, s: (x, q, s, "int4"), "storage must be", False),
    (lambda x, q, s: (x, q[:, :, :64].view(jnp.int8), s, "fp4"), "do not make whole steps", True),
    (lambda x, q, s: (x, q, s, "fp8", 0), "stacked experts needs", False),
    (lambda x, q, s: (x, jnp.stack([q, q]), jnp.stack([s, s])[:, :1], "fp8", 0), "stacked experts needs", False),
    (lambda x, q, s: (x, q[None, :1], s[None, :1], "fp8", 0), "2 group sizes for 1 experts", False),
    (lambda x, q, s: (x, q, s, "fp8", None, "repacked"), "code_layout 'repacked' is for FP4 codes", False),
    (lambda x, q, s: (x, q, s, "fp8", None, "marlin"), "code_layout must be one of", False),
])
def test_refuses_what_it_does_not_take_with_a_clear_error(change, message, untileable):
    """What it cannot tile raises CannotTile (the op then takes the reference); bad arguments a plain
    ValueError."""
    q, s = experts("fp8", 2, 128, 256)
    x = jnp.ones((8, 256), jnp.bfloat16)
    x, q, s, storage, *layer = change(x, q, s)
    layout = dict(code_layout=layer.pop()) if len(layer) == 2 else {}
    with pytest.raises(ValueError, match=message) as err:
        expert_matmul_gpu(x, q, s, jnp.asarray([4, 4], jnp.int32), storage, *layer, interpret=True, **layout)
    assert isinstance(err.value, CannotTile) == untileable


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("storage,code_layout", [("fp8", "checkpoint"), ("fp4", "checkpoint"), ("fp4", "repacked")])
def test_native_kernel_matches_reference(storage, code_layout):
    """Compiled by Triton the kernel must still agree (the interpreter cannot show a lowering's bugs):
    V4-Flash's expert widths, a decode step's worth of rows; repacked codes give the checkpoint's result."""
    e, n, k = 16, 512, 4096
    q, s = experts(storage, e, n, k)
    rng = np.random.default_rng(1)
    sizes = jnp.asarray(rng.multinomial(96, np.ones(e) / e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((96, k)), jnp.bfloat16)
    codes = repack_codes(q) if code_layout == "repacked" else q
    got = np.asarray(expert_matmul_gpu(x, codes, s, sizes, storage, code_layout=code_layout), np.float32)
    want = np.asarray(expert_matmul_reference(x, q, s, sizes, storage), np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())
    if code_layout == "repacked":
        np.testing.assert_array_equal(got, np.asarray(expert_matmul_gpu(x, q, s, sizes, storage), np.float32))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("storage,stack", [("fp4", (3, 256, 4096, 2048)), ("fp8", (2, 256, 4096, 4096)),
                                           ("fp4", (3, 256, 4096, 1024))])
def test_native_kernel_reads_a_layer_past_4_gib_of_stacked_experts(storage, stack):
    """V4-Flash's gate_up experts stacked over layers span 6-8 GiB, past int32 offsets, and three
    layers of FP4 down_proj 3 GiB, more than 2^31 bytes: the last layer read in place must equal the
    same kernel on that layer cut out (random codes; NaN codes compare equal to NaN)."""
    key_w, key_s, key_x = jax.random.split(jax.random.key(0), 3)
    dtype = jnp.int8 if storage == "fp4" else jnp.float8_e4m3fn
    words = jax.random.bits(key_w, (*stack[:-1], stack[-1] // 4), jnp.uint32)  # no 4x-wide intermediate
    q = jax.lax.bitcast_convert_type(words, dtype).reshape(stack)
    del words
    l, e, n, width = stack
    k = width * (2 if storage == "fp4" else 1)
    scale_shape = (l, e, n, k // 32) if storage == "fp4" else (l, e, n // 128, k // 128)
    s = jax.random.randint(key_s, scale_shape, 120, 131).astype(jnp.uint8)
    x = jax.random.normal(key_x, (32, k), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(32, np.ones(e) / e), jnp.int32)
    last = l - 1
    got = np.asarray(expert_matmul_gpu(x, q, s, sizes, storage, jnp.int32(last)), np.float32)
    alone = np.asarray(expert_matmul_gpu(x, q[last], s[last], sizes, storage), np.float32)
    np.testing.assert_array_equal(got[:32], alone[:32])
