"""The Mosaic GPU FP4 expert kernel: in Mosaic GPU's interpreter on CPU and natively on a GPU against
the reference on random inputs, its row-wide relative scales, stacked layers read in place, where the
op takes it instead of the Triton kernel, and what it refuses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.export import abstract_device, disabled_checks
from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.expert_matmul import mosaic_gpu
from dsjax.kernels.expert_matmul.fp4_codes import repack_codes
from dsjax.kernels.expert_matmul.mosaic_gpu import expert_matmul_mosaic, input_order, renumbered
from dsjax.kernels.expert_matmul.op import expert_matmul
from dsjax.kernels.expert_matmul.reference import expert_matmul_reference
from dsjax.stacked import StackedSlice
from tests.kernels.test_expert_matmul_triton import experts, spread_fp4_scales

ON_GPU = jax.default_backend() == "gpu"


def close(got, want):
    """Every product is exact in both; the fp32 sums run in another order, then round to bf16."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("storage,pairs", [("fp4", 4), ("fp8", 2)])
def test_input_order_renumbers_every_input_once_per_pair(storage, pairs):
    order = input_order(2048, storage)
    assert order.shape == (pairs, 2048 // pairs)
    np.testing.assert_array_equal(np.sort(order.reshape(-1)), np.arange(2048))
    # pair p holds codes p and p + pairs of each word: inputs w·j + p and w·j + p + pairs (w codes a word)
    for p in range(pairs):
        assert set(np.unique(order[p] % (2 * pairs))) == {p, p + pairs}
    x = jnp.arange(3 * 2048, dtype=jnp.int32).reshape(3, 2048)
    np.testing.assert_array_equal(renumbered(x, storage), np.moveaxis(np.asarray(x)[:, order], 1, 0))


_DECODE_CASES = [
    ([3, 0, 17, 1, 6], 0, 1024, 128),    # an empty group, a group over two tiles
    ([0, 0, 40, 0, 0], 5, 2048, 64),     # one group of three tiles; rows routed to no group after it
    ([1, 1, 1, 1, 1], 11, 1024, 192),    # one-row groups, three feature blocks
    ([9, 4, 20], 3, 1280, 64),           # 10 scale words a row, padded to 16 (as V4.1's down_proj's 18)
    ([0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1], 2, 1024, 64),  # decode: fewer rows than experts
]


@pytest.mark.parametrize("sizes,extra,k,n,row_source", [
    *[(*case, "copied") for case in _DECODE_CASES],
    # aligned rows (built, not yet taken): experts moved past empty ones and over two tiles, and one-row experts
    *[(*_DECODE_CASES[i], "aligned") for i in (0, 4)],
])
def test_kernel_matches_reference(sizes, extra, k, n, row_source):
    """Random experts with scales spread over 2^13 (interpreted: no GPU needed), each tile's rows copied
    out, read in place from a window, or from experts moved to multiples of 8."""
    e = len(sizes)
    q, s = experts("fp4", e, n, k, seed=len(sizes) + extra)
    p = sum(sizes) + extra
    x = jnp.asarray(np.random.default_rng(extra).standard_normal((p, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul_mosaic(x, q, s, group_sizes, row_source=row_source, interpret=True)
    assert got.shape == (p, n) and got.dtype == jnp.bfloat16
    close(got[:sum(sizes)], expert_matmul_reference(x, q, s, group_sizes, "fp4")[:sum(sizes)])


def test_decode_tiles_read_from_a_window_match_reference():
    """The window mode (24 rows from the multiple of 8 at or before each 16-row tile's first), on tiles
    that start off the multiples of 8."""
    sizes = [3, 0, 17, 1, 6]
    q, s = experts("fp4", len(sizes), 64, 1024, seed=5)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((sum(sizes) + 2, 1024)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul_mosaic(x, q, s, group_sizes, row_source="window", interpret=True)
    close(got[:sum(sizes)], expert_matmul_reference(x, q, s, group_sizes, "fp4")[:sum(sizes)])


# The prefill sweep's widths and depths, one of each: 32 to 128 rows, 128 features, 16 to 64 words, 3 stages
# (256 rows: the aligned case below).
_PREFILL_TILINGS = [(32, 64, 32, 2), (64, 128, 32, 2), (128, 64, 16, 3), (64, 64, 64, 2)]


@pytest.mark.parametrize("block_m,features,words,stages,row_source", [
    *[(*tiling, "copied") for tiling in _PREFILL_TILINGS],
    # the in-place reads: the same kernel path for both, one program shape each besides the 256-row refusal
    (32, 64, 32, 2, "window"), (256, 64, 16, 2, "window"),
    (64, 128, 32, 2, "aligned"), (256, 64, 16, 2, "aligned"),
])
def test_prefill_tiles_match_reference_and_the_decode_tiling(block_m, features, words, stages, row_source):
    """Tiles of many rows (prefill), whose results are taken out by whole rows: groups over several
    tiles, an empty one, rows routed nowhere. Same sums as the decode tiling up to their order."""
    x, q, s, group_sizes, want, decode_tiling = _prefill_case()
    sizes = np.asarray(group_sizes)
    if row_source == "window" and block_m == 256:  # 256 rows and the 8 before them are more than wgmma's N
        with pytest.raises(ValueError, match="block_m=256 is too many"):
            expert_matmul_mosaic(x, q, s, group_sizes, block_m=block_m, row_source="window", interpret=True)
        return
    got = expert_matmul_mosaic(x, q, s, group_sizes, block_m=block_m, features=features, words=words, stages=stages,
                               row_source=row_source, interpret=True)[:sum(sizes)]
    close(got, want)
    close(got, decode_tiling)


@functools.cache
def _prefill_case():
    """The prefill tilings' inputs, the reference's result and the decode tiling's: computed once."""
    sizes, extra, k, n = [70, 0, 150, 5], 9, 1024, 128
    q, s = experts("fp4", len(sizes), n, k, seed=3)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((sum(sizes) + extra, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    return (x, q, s, group_sizes, expert_matmul_reference(x, q, s, group_sizes, "fp4")[:sum(sizes)],
            expert_matmul_mosaic(x, q, s, group_sizes, interpret=True)[:sum(sizes)])


@pytest.mark.parametrize("sizes,extra,k,n,options", [
    ([3, 0, 17, 1, 6], 3, 1024, 192, dict(words=16)),        # two 128-blocks of outputs, the second partial
    ([40, 0, 9], 3, 640, 64, dict(block_m=32, row_source="window")),  # prefill tiles read in place
    ([3, 0, 17, 1, 6], 3, 512, 64, dict(row_source="aligned")),  # experts moved to multiples of 8
    ([1, 1, 1, 1, 1], 3, 384, 128, dict(features=128)),       # one-row groups, 128 features a program
])
def test_fp8_experts_match_reference(sizes, extra, k, n, options):
    """FP8 experts (e4m3, a ue8m0 scale per 128 × 128 block spread over 2^13) through the same kernel."""
    q, s = experts("fp8", len(sizes), n, k, seed=2)
    x = jnp.asarray(np.random.default_rng(extra).standard_normal((sum(sizes) + extra, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul_mosaic(x, q, s, group_sizes, storage="fp8", interpret=True, **options)
    assert got.shape == (sum(sizes) + extra, n) and got.dtype == jnp.bfloat16
    close(got[:sum(sizes)], expert_matmul_reference(x, q, s, group_sizes, "fp8")[:sum(sizes)])


@pytest.mark.parametrize("sizes,extra,k,n,options", [
    ([3, 0, 17, 1, 6], 3, 1280, 192, dict()),  # 10 scale words a row, padded to 16; six 32-row blocks
    ([40, 0, 9], 3, 640, 64, dict(block_m=32, words=16, row_source="aligned")),  # steps of half a scale word
])
def test_fp8_experts_in_32_blocks_match_reference(sizes, extra, k, n, options):
    """V4.1's FP8 storage (a ue8m0 scale per 32 × 32 block): each row given its block's scales, then
    FP4's per-row, per-32-input scale path with FP8's decode."""
    q, s = experts("fp8", len(sizes), n, k, seed=4, block=32)
    x = jnp.asarray(np.random.default_rng(extra).standard_normal((sum(sizes) + extra, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul_mosaic(x, q, s, group_sizes, storage="fp8", fp8_block=32, interpret=True, **options)
    assert got.shape == (sum(sizes) + extra, n) and got.dtype == jnp.bfloat16
    close(got[:sum(sizes)], expert_matmul_reference(x, q, s, group_sizes, "fp8", (32, 32))[:sum(sizes)])


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_experts_of_a_stacked_layer_equal_the_layer_cut_out(block):
    layers = [experts("fp8", 3, 128, 512, seed=s, block=block) for s in range(2)]
    q, s = jnp.stack([w for w, _ in layers]), jnp.stack([sc for _, sc in layers])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((12, 512)), jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 6], jnp.int32)
    got = expert_matmul_mosaic(x, q, s, sizes, jnp.int32(1), storage="fp8", fp8_block=block, interpret=True)
    alone = expert_matmul_mosaic(x, q[1], s[1], sizes, storage="fp8", fp8_block=block, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
    close(got[:11], expert_matmul_reference(x, q[1], s[1], sizes, "fp8", (block, block))[:11])


def test_fp8_block_scales_relative_to_the_rows_largest_are_exact_down_to_2_pow_minus_22():
    """Each row of 128-blocks is scaled in fp16 relative to its largest block: e4m3's smallest subnormal
    (2^-9) in a block 2^22 below the largest is still exact; 2^30 below, the block reads as zero."""
    n, k = 64, 512
    q = np.zeros((1, n, k), np.float32)
    q[:, :, [0, 128, 256, 384]] = [448.0, 2.0 ** -9, 2.0 ** -9, 1.0]
    scale = np.asarray([[[127 + 10, 127 - 12, 127 - 20, 127]]], np.uint8)  # 2^10, 2^-12 (22 below), 2^-20
    codes = jnp.asarray(q, jnp.float8_e4m3fn)
    sizes = jnp.asarray([1], jnp.int32)
    for column, want in ((0, 448.0 * 2.0 ** 10), (128, 2.0 ** -21), (256, 0.0), (384, 1.0)):
        x = jnp.zeros((1, k), jnp.bfloat16).at[0, column].set(1)
        got = expert_matmul_mosaic(x, codes, jnp.asarray(scale), sizes, storage="fp8", interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.full((1, n), want, np.float32))


@pytest.mark.parametrize("words", [32, 16])
def test_fp8_32_blocks_relative_to_the_rows_largest_are_exact_down_to_2_pow_minus_22(words):
    """In 32 × 32 blocks a step's inputs (128, or 64 with 16 words) span several blocks and a program's
    64 outputs two rows of them: each input's block is found, each row scaled relative to its own largest
    block (2^22 below it exact, 2^30 below zero), and the second step of a scale word (16 words) reads
    its second half."""
    n, k = 64, 256
    columns = [0, 32, 64, 96, 160, 224]
    values = [448.0, 2.0 ** -9, 2.0 ** -9, 1.0, 3.0, 2.0 ** -9]
    exps = np.asarray([[10, -12, -20, 0, 0, 2, 0, -30],    # outputs 0-31: largest 2^10
                       [0, 3, -19, -1, 0, -4, 0, -19]])  # outputs 32-63: largest 2^3
    q = np.zeros((1, n, k), np.float32)
    q[:, :, columns] = values
    codes, scale = jnp.asarray(q, jnp.float8_e4m3fn), jnp.asarray(exps[None] + 127, jnp.uint8)
    sizes = jnp.asarray([1], jnp.int32)
    for column, value in zip(columns, values):
        x = jnp.zeros((1, k), jnp.bfloat16).at[0, column].set(1)
        got = np.asarray(expert_matmul_mosaic(x, codes, scale, sizes, storage="fp8", fp8_block=32, words=words,
                                              interpret=True), np.float32)
        for rows, row_exps in ((slice(0, 32), exps[0]), (slice(32, 64), exps[1])):
            e = row_exps[column // 32]
            want = value * 2.0 ** e if e >= row_exps.max() - 22 else 0.0
            np.testing.assert_array_equal(got[0, rows], np.full(32, want, np.float32), err_msg=f"input {column}")


@pytest.mark.parametrize("options,message", [
    (dict(storage="fp6"), "storage must be 'fp4' or 'fp8', got 'fp6'"),
    (dict(storage="fp8", words=64), "FP8: 16 or 32, a step within one 128-block"),
    (dict(storage="fp8", code_layout="repacked"), "code_layout 'repacked' is for FP4 codes"),
    (dict(storage="fp8", fp8_block=64), r"fp8_block must be one of \(128, 32\), got 64"),
])
def test_fp8_options_it_does_not_take_are_refused(options, message):
    q, s = experts("fp8", 2, 64, 512)
    with pytest.raises(ValueError, match=message):
        expert_matmul_mosaic(jnp.ones((8, 512), jnp.bfloat16), q, s, jnp.asarray([4, 4], jnp.int32), **options,
                             interpret=True)


def test_fp8_experts_with_fp4_scales_do_not_tile():
    q, _ = experts("fp8", 2, 64, 512)
    with pytest.raises(CannotTile, match=r"FP8 experts float8_e4m3fn \(2, 64, 512\) with scales \(2, 64, 16\)"):
        expert_matmul_mosaic(jnp.ones((8, 512), jnp.bfloat16), q, jnp.zeros((2, 64, 16), jnp.uint8),
                             jnp.asarray([4, 4], jnp.int32), storage="fp8", interpret=True)


@pytest.mark.parametrize("sizes,extra,k,n,block_m,stacked", [
    ([3, 0, 17, 1, 6], 4, 1024, 128, 16, False),  # decode tiles
    ([40, 0, 9], 3, 1280, 64, 32, True),           # prefill tiles, one layer of a stack, padded scale rows
])
def test_repacked_codes_give_the_same_result_bit_for_bit(sizes, extra, k, n, block_m, stacked):
    q, s = experts("fp4", len(sizes), n, k, seed=7)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((sum(sizes) + extra, k)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    layer = ()
    if stacked:
        other_q, other_s = experts("fp4", len(sizes), n, k, seed=8)
        q, s, layer = jnp.stack([other_q, q]), jnp.stack([other_s, s]), (jnp.int32(1),)
    want = expert_matmul_mosaic(x, q, s, group_sizes, *layer, block_m=block_m, interpret=True)
    got = expert_matmul_mosaic(x, repack_codes(q), s, group_sizes, *layer, block_m=block_m, code_layout="repacked",
                               interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    close(got[:sum(sizes)], expert_matmul_reference(x, q[layer[0]] if stacked else q, s[layer[0]] if stacked else s,
                                                    group_sizes, "fp4")[:sum(sizes)])


def test_unknown_code_layouts_are_refused():
    q, s = experts("fp4", 2, 64, 1024)
    with pytest.raises(ValueError, match="expert_matmul_mosaic: code_layout must be one of .* got 'marlin'"):
        expert_matmul_mosaic(jnp.ones((8, 1024), jnp.bfloat16), q, s, jnp.asarray([4, 4], jnp.int32),
                             code_layout="marlin", interpret=True)


@pytest.mark.parametrize("block_m", [4, 12, 264])
def test_block_m_out_of_range_is_refused(block_m):
    q, s = experts("fp4", 2, 64, 1024)
    with pytest.raises(ValueError, match="block_m must be a multiple of 8"):
        expert_matmul_mosaic(jnp.ones((8, 1024), jnp.bfloat16), q, s, jnp.asarray([4, 4], jnp.int32),
                             block_m=block_m, interpret=True)


@pytest.mark.parametrize("options,message", [
    (dict(words=8), "words must be 16, 32 or 64"),
    (dict(stages=0), "stages must be at least 1"),
    (dict(block_m=256, words=32), r"need \d+ bytes of shared memory"),
])
def test_step_options_out_of_range_are_refused(options, message):
    q, s = experts("fp4", 2, 64, 1024)
    with pytest.raises(ValueError, match=message):
        expert_matmul_mosaic(jnp.ones((8, 1024), jnp.bfloat16), q, s, jnp.asarray([4, 4], jnp.int32), **options,
                             interpret=True)


def test_scales_relative_to_the_rows_largest_are_exact_down_to_2_pow_minus_24():
    """Codes are scaled in fp16 relative to the largest scale of their whole row (not of their step,
    as in the Triton kernel): a group 2^24 below it, in another step, is still exact; one 2^30 below
    rounds to zero (an error under 2^-25 of the largest)."""
    n, k = 64, 1024
    codes, scale, sizes = spread_fp4_scales(n, k, (0, 16, 31))
    for column, want in ((0, 0.5 * 2.0 ** 10), (512, 0.5 * 2.0 ** -14), (1000, 0.0), (40, 0.5)):
        x = jnp.zeros((1, k), jnp.bfloat16).at[0, column].set(1)
        got = expert_matmul_mosaic(x, codes, scale, sizes, interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.full((1, n), want, np.float32))


def test_scales_as_float8_e8m0fnu_read_as_their_bytes():
    q, s = experts("fp4", 2, 64, 1024)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 1024)), jnp.bfloat16)
    sizes = jnp.asarray([4, 2], jnp.int32)
    typed = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(expert_matmul_mosaic(x, q, typed, sizes, interpret=True), np.float32),
                                  np.asarray(expert_matmul_mosaic(x, q, s, sizes, interpret=True), np.float32))


def test_kernel_reads_one_layer_of_stacked_experts_in_place():
    """With `layer`, the kernel reads that entry of `[L, E, …]` stacks: the same result as on the layer
    cut out; and the op, given `StackedSlice`s and `MIN_ROWS` rows, runs this kernel."""
    layers = [experts("fp4", 3, 64, 1024, seed=s) for s in range(2)]
    check_stacked_layers(layers, 1024)


def test_kernel_reads_one_layer_of_stacked_experts_whose_scales_it_pads():
    """2,304 inputs (V4.1's down_proj): the layer's scale rows are padded out of the stack (the second
    layer's: the first's stand where the stack's do)."""
    check_stacked_layers([experts("fp4", 3, 64, 2304, seed=s) for s in range(2)], 2304, checked=(1,))


def check_stacked_layers(layers, k, checked=(0, 1)):
    q, s = jnp.stack([w for w, _ in layers]), jnp.stack([sc for _, sc in layers])
    rows = mosaic_gpu.MIN_ROWS
    sizes = jnp.asarray([50, 0, rows - 60], jnp.int32)  # ten rows routed to no expert
    x = jnp.asarray(np.random.default_rng(4).standard_normal((rows, k)), jnp.bfloat16)
    for layer in checked:
        index = jnp.int32(layer)
        got = expert_matmul_mosaic(x, q, s, sizes, index, interpret=True)[:rows - 10]
        alone = expert_matmul_mosaic(x, q[layer], s[layer], sizes, interpret=True)[:rows - 10]
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
        via_op = expert_matmul(x, StackedSlice(q, index), StackedSlice(s, index), sizes, "fp4", kernels="interpret")
        np.testing.assert_array_equal(np.asarray(via_op[:rows - 10], np.float32), np.asarray(got, np.float32))
        close(got, expert_matmul_reference(x, q[layer], s[layer], sizes, "fp4")[:rows - 10])


def lowered_op(storage: str, rows: int, stacked: bool = False, e: int = 4) -> str:
    """The op on `rows` rows of `e` experts, lowered for cuda, as MLIR text."""
    q, s = experts(storage, e, 128, 1024)
    if stacked:
        q, s = jnp.stack([q, q]), jnp.stack([s, s])
        def fn(x, g):
            return expert_matmul(x, StackedSlice(q, jnp.int32(1)), StackedSlice(s, jnp.int32(1)), g, storage)
    else:
        def fn(x, g):
            return expert_matmul(x, q, s, g, storage)
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            jax.ShapeDtypeStruct((rows, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32)).mlir_module()


def test_op_takes_this_kernel_for_fp4_from_min_rows_on():
    """Below `MIN_ROWS` rows, and for FP8, the Triton kernel; from it on, for FP4, this one, given the
    whole stack (no op cuts the layer out)."""
    assert "dsjax_expert_matmul_mosaic" not in lowered_op("fp4", mosaic_gpu.MIN_ROWS - 1)
    assert "dsjax_expert_matmul" in lowered_op("fp4", mosaic_gpu.MIN_ROWS - 1)
    assert "dsjax_expert_matmul_mosaic" not in lowered_op("fp8", mosaic_gpu.MIN_ROWS)
    text = lowered_op("fp4", mosaic_gpu.MIN_ROWS, stacked=True)
    assert "dsjax_expert_matmul_mosaic" in text
    for layer in ("4x128x512xi8", "4x128x128xi32"):  # one layer's codes, as stored or as the kernel's words
        assert f"tensor<{layer}>" not in text and f"tensor<1x{layer}>" not in text


@pytest.mark.parametrize("storage,options", [
    ("fp4", dict(code_layout="repacked")),
    ("fp4", dict(row_source="aligned", block_m=8)),
    ("fp4", dict(row_source="window", block_m=64)),
    ("fp8", dict()),
    ("fp8", dict(words=16, features=128)),
    ("fp8", dict(row_source="aligned", block_m=64)),
    ("fp8", dict(fp8_block=32)),
    ("fp8", dict(fp8_block=32, words=16, features=128)),
])
def test_kernel_variants_lower_for_cuda(storage, options):
    """Without a GPU, the interpreter runs the kernel's arithmetic but not Mosaic GPU's lowering, which
    refuses some of what the interpreter takes (a scalar bitcast; a TMA read of a row count that is not a
    multiple of 8): each variant lowered for cuda, as an export does, before it meets a GPU."""
    q, s = experts(storage, 4, 128, 1024, block=options.get("fp8_block", 128))
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    fn = jax.jit(lambda x, g: expert_matmul_mosaic(x, q, s, g, storage=storage, **options))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            jax.ShapeDtypeStruct((37, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32)).mlir_module()
    assert "dsjax_expert_matmul_mosaic" in text


def test_op_switches_for_fp8_experts_and_aligned_rows(monkeypatch):
    """The op's untimed choices, switched on: FP8 experts at decode take this kernel before the Triton one,
    and "aligned" tiles read a scattered buffer (`P + 7 · min(E, P) + block_m` rows) instead of copies."""
    from dsjax.kernels.expert_matmul import op

    rows, e = mosaic_gpu.MIN_ROWS, 4
    block_m = mosaic_gpu.tile_rows(rows, e)
    copies = f"tensor<4x{-(-rows // block_m) + e}x{block_m}x256xf16>"  # [pairs, tiles, block_m, K/pairs]
    assert copies in lowered_op("fp4", rows)
    monkeypatch.setattr(op, "ROW_SOURCE", "aligned")
    text = lowered_op("fp4", rows)
    assert copies not in text and f"tensor<4x{-(-(rows + 7 * e + block_m) // 8) * 8}x256xf16>" in text
    monkeypatch.setattr(op, "ROW_SOURCE", "window")  # P + block_m + 8 rows, up to a multiple of 8: 170 → 176
    assert "dsjax_expert_matmul_mosaic" in lowered_op("fp4", rows + 2)
    monkeypatch.setattr(op, "FP8_MOSAIC", True)
    assert "dsjax_expert_matmul_mosaic" in lowered_op("fp8", 32)


def test_op_tiles_by_rows_per_expert():
    """16-row tiles for decode, more rows a tile as the rows per expert grow (`TILE_ROWS`); the kernel's
    `[tiles, features, rows]` output shows which the op took."""
    e = 32
    assert mosaic_gpu.tile_rows(mosaic_gpu.MIN_ROWS, e) == mosaic_gpu.BLOCK_M
    for least, block_m in mosaic_gpu.TILE_ROWS:
        assert mosaic_gpu.tile_rows(least * e, e) == block_m
        assert mosaic_gpu.tile_rows(least * e - 1, e) != block_m
    for least, block_m in mosaic_gpu.TILE_ROWS:
        rows = least * e
        assert f"tensor<{-(-rows // block_m) + e}x128x{block_m}xf32>" in lowered_op("fp4", rows, e=e)


@pytest.mark.parametrize("change,message,untileable", [
    (lambda x, q, s: (x.astype(jnp.float32), q, s), "activations must be bf16", True),
    (lambda x, q, s: (x, q, s.astype(jnp.float32)), "ue8m0", True),
    (lambda x, q, s: (x[:, :384], q[:, :, :192], s[:, :, :12]), "do not tile", True),
    (lambda x, q, s: (x, q[:, :96], s[:, :96]), "do not tile", True),
    (lambda x, q, s: (x, q, s, 0), "stacked experts needs", False),
    (lambda x, q, s: (x, jnp.stack([q, q]), jnp.stack([s, s])[:, :1], 0), "stacked experts needs", False),
    (lambda x, q, s: (x, q[None, :1], s[None, :1], 0), "2 group sizes for 1 experts", False),
])
def test_refuses_what_it_does_not_take_with_a_clear_error(change, message, untileable):
    """What it cannot tile raises CannotTile (the op then takes the Triton kernel); bad arguments a
    plain ValueError."""
    q, s = experts("fp4", 2, 128, 1024)
    x = jnp.ones((8, 1024), jnp.bfloat16)
    x, q, s, *layer = change(x, q, s)
    with pytest.raises(ValueError, match=message) as err:
        expert_matmul_mosaic(x, q, s, jnp.asarray([4, 4], jnp.int32), *layer, interpret=True)
    assert isinstance(err.value, CannotTile) == untileable


def native_case(storage: str, k: int, seed: int):
    """V4-Flash's expert widths (gate_up 4096 inputs, down_proj 2048), 16 experts of 512 outputs, 32 tokens'
    worth of rows (192) routed at random: (x, codes, scales, group sizes)."""
    e, n = 16, 512
    q, s = experts(storage, e, n, k)
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(rng.multinomial(192, np.ones(e) / e), jnp.int32)
    return jnp.asarray(rng.standard_normal((192, k)), jnp.bfloat16), q, s, sizes


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("k", [4096, 2048])
@pytest.mark.parametrize("block_m,row_source", [(16, "copied"), (16, "window"), (64, "window"), (16, "aligned"),
                                                (8, "aligned"), (64, "aligned")])
def test_native_kernel_matches_reference(k, block_m, row_source):
    """Compiled (the register reinterpretation and register-A wgmma, which the interpreter replaces):
    decode and prefill tiles, copied out or read in place (wgmma's N of 24 and 72)."""
    x, q, s, sizes = native_case("fp4", k, seed=1)
    close(expert_matmul_mosaic(x, q, s, sizes, block_m=block_m, row_source=row_source),
          expert_matmul_reference(x, q, s, sizes, "fp4"))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("k", [4096, 2048])
@pytest.mark.parametrize("block_m", [16, 64])
def test_native_kernel_on_fp8_experts_matches_reference(k, block_m):
    """Compiled, FP8 experts at V4-Flash's expert widths: the scalar scale read and the e4m3 decode."""
    x, q, s, sizes = native_case("fp8", k, seed=3)
    close(expert_matmul_mosaic(x, q, s, sizes, storage="fp8", block_m=block_m),
          expert_matmul_reference(x, q, s, sizes, "fp8"))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("k", [4096, 2048])
@pytest.mark.parametrize("block_m", [16, 64])
def test_native_kernel_on_repacked_codes_gives_the_same_result_bit_for_bit(k, block_m):
    """Compiled, on V4-Flash's expert widths: the repacked decode's result equals the checkpoint order's."""
    x, q, s, sizes = native_case("fp4", k, seed=2)
    got = expert_matmul_mosaic(x, repack_codes(q), s, sizes, block_m=block_m, code_layout="repacked")
    want = expert_matmul_mosaic(x, q, s, sizes, block_m=block_m)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("stack", [(3, 256, 4096, 2048), (3, 256, 4096, 1024)])
def test_native_kernel_reads_a_layer_past_4_gib_of_stacked_experts(stack):
    """Three layers of V4-Flash's FP4 gate_up (6 GiB) and down_proj (3 GiB) stacked: the last layer
    read in place equals the kernel on that layer cut out (random codes)."""
    key_w, key_s, key_x = jax.random.split(jax.random.key(0), 3)
    words = jax.random.bits(key_w, (*stack[:-1], stack[-1] // 4), jnp.uint32)
    q = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(stack)
    del words
    l, e, n, width = stack
    s = jax.random.randint(key_s, (l, e, n, width // 16), 120, 131).astype(jnp.uint8)
    x = jax.random.normal(key_x, (192, 2 * width), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(192, np.ones(e) / e), jnp.int32)
    got = np.asarray(expert_matmul_mosaic(x, q, s, sizes, jnp.int32(l - 1)), np.float32)
    alone = np.asarray(expert_matmul_mosaic(x, q[l - 1], s[l - 1], sizes), np.float32)
    np.testing.assert_array_equal(got, alone)
