"""Which kernel `sparse_attention.op.sparse_decode` lowers for cuda: the Mosaic GPU kernel where it
applies (fp8/fp4 rows and V4.1's records unpacked by XLA first), the Triton kernel elsewhere; and the
interpreted kernels through the op, V4.1's records included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.cache_formats import Records
from dsjax.export import abstract_device, disabled_checks
from dsjax.kernels.sparse_attention.op import mosaic_splits, sparse_decode, sparse_prefill
from dsjax.kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference
from dsjax.quant import pack_kv
from tests.helpers import mesh_cuda_module
from tests.kernels.test_sparse_attention_mosaic_gpu import inputs
from tests.kernels.test_sparse_attention_triton import inputs as triton_inputs


def cuda_module(args, kw) -> str:
    """The op lowered for an H200 (as `dsjax export` lowers: an abstract device, none needed here)."""
    fn = jax.jit(lambda q, w, n, e, s: sparse_decode(q, w, n, e, s, 512 ** -0.5, **kw))
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        return jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(*args[:5]).mlir_module()


@pytest.mark.parametrize("change,mosaic", [
    (lambda a, kw: (a, kw), True),                                                       # CSA, bf16
    (lambda a, kw: (a[:3] + (None,) + a[4:], {}), True),                                 # sliding window
    (lambda a, kw: ((a[0], pack_kv(a[1], "fp8", 64), a[2], pack_kv(a[3], "fp8", 64)) + a[4:], kw), True),  # fp8
    (lambda a, kw: ((a[0], pack_kv(a[1], "fp4", 64), a[2], pack_kv(a[3], "fp4", 64)) + a[4:], kw), True),  # fp4
    (lambda a, kw: ((a[0], pack_kv(a[1], "fp8", 64), a[2], pack_kv(a[3], "fp8", 64)) + a[4:],
                    {"entries_len_b": jnp.ones((2,), jnp.int32)}), False),               # fp8 HCA prefix
    (lambda a, kw: (a, {"entries_len_b": jnp.ones((2,), jnp.int32)}), False),            # HCA prefix
    (lambda a, kw: ((a[0].astype(jnp.float32),) + a[1:], kw), False),                    # fp32 queries
])
def test_cuda_lowering_takes_the_mosaic_kernel_where_it_applies(change, mosaic):
    text = cuda_module(*change(*inputs(0, 2, 48, 300, 100)))
    assert ("dsjax_sparse_decode_mosaic" in text) == mosaic
    assert ('name = "dsjax_sparse_decode"' in text) != mosaic  # else the Triton kernel


def test_interpreted_op_runs_the_mosaic_kernel():
    args, kw = inputs(1, 2, 48, 300, 100)
    want = sparse_decode_reference(*args, **kw)
    got = sparse_decode(*args, **kw, kernels="interpret")
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))) / jnp.max(jnp.abs(want)))
    assert err < 1e-2, err  # both rounded to bf16


def test_mosaic_splits_cover_the_chip():
    assert mosaic_splits(64, 640) == 2
    assert mosaic_splits(1, 640) == 10
    assert mosaic_splits(256, 640) == 1


def test_under_a_mesh_the_op_runs_on_each_devices_slots():
    """Under a mesh of 8 devices the op runs in a shard_map over the slot axes, so that a kernel can run:
    lowered for cuda the Mosaic kernel is there; interpreted on the CPU devices (the Triton kernel, for
    fp32 queries: Mosaic GPU's interpreter does not run under a shard_map of several devices), the
    reference's result."""
    from dsjax.parallel.mesh import make_mesh

    args, kw = inputs(2, 8, 48, 300, 100)  # 8 slots: one per device
    text = mesh_cuda_module(lambda q, w, n, e, s: sparse_decode(q, w, n, e, s, 512 ** -0.5, **kw), *args[:5])
    assert "dsjax_sparse_decode_mosaic" in text
    q32 = args[0].astype(jnp.float32)
    with jax.set_mesh(make_mesh("dp=2,ep=4")):
        got = jax.jit(lambda q, w, n, e, s: sparse_decode(q, w, n, e, s, 512 ** -0.5, **kw, kernels="interpret"))(
            q32, *args[1:5])
    want = sparse_decode_reference(q32, *args[1:], **kw)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-5, err


def v41_stored(args):
    """The inputs with V4.1's release storage: an MXFP8 window ring, NVFP4 entries."""
    q, window, n, entries, *rest = args
    return (q, Records.of(window, "mxfp8"), n, Records.of(entries, "nvfp4"), *rest)


def test_v41_records_reach_the_gpu_kernels_not_the_reference():
    """At 64 heads of 512 the Mosaic kernel (on the window and picks unpacked by XLA), narrower the
    Triton one (likewise); no TPU kernel reads records, so lowered for tpu the reference runs."""
    args, kw = inputs(0, 2, 48, 300, 100)
    text = cuda_module(v41_stored(args), kw)
    assert "dsjax_sparse_decode_mosaic" in text
    narrow, narrow_kw = triton_inputs(1, "bfloat16", b=2, h=16, d=128)
    fn = jax.jit(lambda q, w, n, e, s: sparse_decode(q, w, n, e, s, 128 ** -0.5, **narrow_kw))
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            *v41_stored(narrow)[:5]).mlir_module()
    assert 'name = "dsjax_sparse_decode"' in text and "dsjax_sparse_decode_mosaic" not in text
    tpu = jax.export.export(fn, platforms=["tpu"])(*v41_stored(narrow)[:5]).mlir_module()
    assert "tpu_custom_call" not in tpu


def test_interpreted_op_on_v41_records_matches_the_reference():
    """Decode through the op over V4.1's records where the Triton kernel runs (the Mosaic one's unpacking of
    records: `test_packed_rows_are_unpacked_for_the_kernel`)."""
    args, kw = triton_inputs(3, "bfloat16", b=3, h=16, d=128)
    args = v41_stored(args)
    want = sparse_decode_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode(*args, **kw, kernels="interpret").astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-2, err  # the kernel's output rounded to bf16


def test_interpreted_prefill_on_v41_records_matches_the_reference():
    """A prefill chunk through the op over V4.1's records: the Triton prefill kernel on the window and
    the slot's entries unpacked (every entry: a chunk's queries pick among all of them)."""
    b, c, h, d, wn, t, k = 2, 5, 16, 128, 40, 90, 24
    rng = np.random.default_rng(12)
    q = jnp.asarray(rng.normal(size=(b, c, h, d)) * 2, jnp.bfloat16)
    window = Records.of(jnp.asarray(rng.normal(size=(b, wn, d)), jnp.bfloat16), "mxfp8")
    entries = Records.of(jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16), "nvfp4")
    start = rng.integers(0, wn, size=(b, c))
    end = np.minimum(start + rng.integers(0, 20, size=(b, c)), wn)
    idx = rng.integers(0, t, size=(b, c, k))
    idx[rng.random((b, c, k)) < 0.3] = -1
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32)
    args = (q, window, jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32), entries, sinks, d ** -0.5)
    kw = {"idx_bck": jnp.asarray(idx, jnp.int32)}
    want = sparse_prefill_reference(*args, **kw, out_dtype=jnp.float32)
    got = jax.jit(lambda *a: sparse_prefill(*a, d ** -0.5, **kw, kernels="interpret"))(*args[:6])
    assert "dsjax_sparse_prefill" in str(jax.make_jaxpr(
        lambda *a: sparse_prefill(*a, d ** -0.5, **kw, kernels="interpret"))(*args[:6]))
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-2, err
