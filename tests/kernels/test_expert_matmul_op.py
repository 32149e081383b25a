"""`op.dense_fp8_matmul`: dense FP8 linears through the Mosaic GPU expert kernel (interpreted on CPU)
against their dequantized matmul, where it falls back, and what it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.expert_matmul import op
from dsjax.kernels.expert_matmul.op import dense_fp8_matmul
from dsjax.quant import dequantize_fp8, quantize_fp8
from tests.kernels.test_expert_matmul_mosaic_gpu import close

ON_GPU = jax.default_backend() == "gpu"


def linears(g: int, n: int, k: int, seed: int = 0, scale_fmt: str = "ue8m0", block=(128, 128)):
    """G random `[N, K]` weights as V4 stores them (e4m3, 128 × 128 blocks; V4.1: `block` (32, 32)),
    scales spread over 2^10."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((g, n, k)) * np.logspace(-3, 0, k)[None, None, rng.permutation(k)]
    return quantize_fp8(jnp.asarray(w, jnp.float32), block, scale_fmt)


def dequantized_matmul(x, q, s, block=(128, 128)):
    return np.einsum("gpk,gnk->gpn", np.asarray(x, np.float32),
                     np.asarray(dequantize_fp8(q, s, jnp.bfloat16, block), np.float32))


@pytest.mark.parametrize("g,p,n,k", [
    (1, 1, 256, 512),    # one sequence's decode step: a tile of 8 rows, 7 of them padding
    (1, 40, 192, 384),   # a partial 128-block of outputs
    (4, 12, 128, 256),   # a grouped projection (attention's output): four linears of 12 rows each
    (1, 200, 64, 128),   # more rows than a tile holds: two tiles
])
def test_kernel_equals_the_dequantized_matmul(g, p, n, k):
    q, s = linears(g, n, k, seed=p)
    x = jnp.asarray(np.random.default_rng(p).standard_normal((g, p, k)) * 3, jnp.bfloat16)
    got = dense_fp8_matmul(x, q, s, kernels="interpret", max_rows=256, min_codes=0)
    assert got.shape == (g, p, n) and got.dtype == jnp.bfloat16
    want = dequantized_matmul(x, q, s)
    close(got, want)
    close(dense_fp8_matmul(x, q, s, kernels="reference"), want)


def test_kernel_runs_where_it_tiles_and_the_reference_where_it_does_not(monkeypatch):
    """Interpreted, the kernel runs for up to `max_rows` rows with ue8m0 scales; fp32 scales (which the
    kernel's power-of-two arithmetic cannot take), more rows, and a linear under the committed
    `DENSE_MIN_CODES` take the reference."""
    tiled = []  # the kernel calls that returned (dispatch traces a kernel once to see whether it tiles)
    real = op.mosaic_gpu.expert_matmul_mosaic

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        tiled.append(kwargs)
        return out

    monkeypatch.setattr(op.mosaic_gpu, "expert_matmul_mosaic", counted)
    x = jnp.ones((1, 16, 256), jnp.bfloat16)
    q, s = linears(1, 128, 256)
    dense_fp8_matmul(x, q, s, kernels="interpret", max_rows=256, min_codes=0)
    assert tiled and all(c["storage"] == "fp8" and c["block_m"] == 16 for c in tiled)
    tiled.clear()
    q32, s32 = linears(1, 128, 256, scale_fmt="float")
    close(dense_fp8_matmul(x, q32, s32, kernels="interpret", max_rows=256, min_codes=0), dequantized_matmul(x, q32, s32))
    dense_fp8_matmul(jnp.ones((1, 264, 256), jnp.bfloat16), q, s, kernels="interpret", max_rows=256, min_codes=0)
    dense_fp8_matmul(x, q, s, kernels="interpret")  # 128 × 256 weights: XLA's fused GEMM is faster
    assert not tiled  # fp32 scales: refused with CannotTile; rows past max_rows: not tried


@pytest.mark.parametrize("g,n,k,p,takes", [
    (1, 32768, 1024, 1, True), (1, 4096, 8192, 32, True),  # V4-Flash's q_b and o_b at decode
    (1, 32768, 1280, 32, True),  # V4.1-Flash's wq_b
    (1, 32768, 1024, 33, False),  # past DENSE_MAX_ROWS
    (1, 1024, 4096, 1, False), (8, 1024, 4096, 1, False),  # q_a; o_a's groups of 4M weights each
])
def test_the_committed_thresholds_send_the_large_linears_at_decode_to_the_kernel(monkeypatch, g, n, k, p, takes):
    """What the H200's timings decided (op.DENSE_MAX_ROWS, op.DENSE_MIN_CODES), traced only."""
    tried = []
    monkeypatch.setattr(op, "dense_fp8_mosaic", lambda x, *a, **kw: tried.append(x.shape) or x[..., :1] * 0)
    block = (32, 32) if k == 1280 else (128, 128)
    w = jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((g, -(-n // block[0]), -(-k // block[1])), jnp.uint8)
    x = jax.ShapeDtypeStruct((g, p, k), jnp.bfloat16)
    jax.eval_shape(lambda x, w, s: dense_fp8_matmul(x, w, s, block, kernels="interpret"), x, w, s)
    assert bool(tried) == takes


@pytest.mark.parametrize("g,p,n,k", [
    (1, 1, 192, 1280),  # V4.1's widths in miniature: 10 scale words a row (padded to 16)
    (4, 12, 128, 256),  # a grouped projection
])
def test_kernel_on_v41_32_blocks_equals_the_dequantized_matmul(g, p, n, k):
    """V4.1's storage (32 × 32 blocks of ue8m0 scales) through the same kernel."""
    q, s = linears(g, n, k, seed=p, block=(32, 32))
    x = jnp.asarray(np.random.default_rng(p).standard_normal((g, p, k)) * 3, jnp.bfloat16)
    got = dense_fp8_matmul(x, q, s, (32, 32), kernels="interpret", max_rows=256, min_codes=0)
    assert got.shape == (g, p, n)
    close(got, dequantized_matmul(x, q, s, (32, 32)))


def test_other_blocks_take_the_dequantized_matmul(monkeypatch):
    """Blocks the kernel does not read (here 64 × 64; it reads 128 × 128 and 32 × 32): even "interpret"
    dequantizes, and `dense_fp8_mosaic` alone says why."""
    monkeypatch.setattr(op.mosaic_gpu, "expert_matmul_mosaic", lambda *a, **kw: pytest.fail("the kernel was tried"))
    q, s = linears(1, 128, 256, block=(64, 64))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 8, 256)), jnp.bfloat16)
    got = dense_fp8_matmul(x, q, s, (64, 64), kernels="interpret", max_rows=256, min_codes=0)
    close(got, dequantized_matmul(x, q, s, (64, 64)))
    with pytest.raises(CannotTile, match=r"square scale blocks of \(128, 32\), not \(64, 64\)"):
        op.dense_fp8_mosaic(x, q, s, (64, 64), interpret=True)


def test_weights_that_do_not_match_the_inputs_are_refused():
    q, s = linears(2, 128, 256)
    with pytest.raises(ValueError, match=r"weights \(2, 128, 256\) do not match inputs \(1, 4, 256\)"):
        dense_fp8_matmul(jnp.ones((1, 4, 256), jnp.bfloat16), q, s)


@pytest.mark.parametrize("g,p,block", [(1, 3, (128, 128)), (2, 40, (128, 128)), (1, 3, (32, 32))])
def test_the_kernel_lowers_for_cuda(g, p, block):
    """Lowered for cuda as an export does (Mosaic GPU's lowering refuses some of what the interpreter runs)."""
    from dsjax.export import abstract_device, disabled_checks

    q, s = linears(g, 256, 512, block=block)
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    fn = jax.jit(lambda x: op.dense_fp8_mosaic(x, q, s, block))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            jax.ShapeDtypeStruct((g, p, 512), jnp.bfloat16)).mlir_module()
    assert "dsjax_expert_matmul_mosaic" in text


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("g,n,k", [(1, 32768, 1024), (8, 1024, 4096), (1, 4096, 8192)])
@pytest.mark.parametrize("p", [1, 32, 256])
def test_native_kernel_on_v4_flash_attention_linears(g, n, k, p):
    """Compiled, at V4-Flash's q_b, grouped o_a and o_b shapes and decode batches."""
    q, s = linears(g, n, k)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((g, p, k)), jnp.bfloat16)
    close(dense_fp8_matmul(x, q, s, max_rows=256, min_codes=0), dequantized_matmul(x, q, s))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("g,n,k", [(1, 32768, 1280), (1, 1280, 5120), (1, 5120, 8192)])
@pytest.mark.parametrize("p", [1, 32, 256])
def test_native_kernel_on_v41_flash_attention_linears(g, n, k, p):
    """Compiled, at V4.1-Flash's wq_b, wq_a and wo_b shapes in its 32 × 32 blocks."""
    q, s = linears(g, n, k, block=(32, 32))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((g, p, k)), jnp.bfloat16)
    close(dense_fp8_matmul(x, q, s, (32, 32), max_rows=256, min_codes=0), dequantized_matmul(x, q, s, (32, 32)))
