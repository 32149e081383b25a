"""Which kernel `sparse_attention.op.sparse_decode` lowers for cuda: the Mosaic GPU kernel where it
applies (fp8/fp4 rows unpacked by XLA first), the Triton kernel elsewhere; and the interpreted Mosaic
kernel through the op."""

import jax
import jax.numpy as jnp
import pytest

from dsjax.export import abstract_device, disabled_checks
from dsjax.kernels.sparse_attention.op import mosaic_splits, sparse_decode
from dsjax.kernels.sparse_attention.reference import sparse_decode_reference
from dsjax.quant import pack_kv
from tests.helpers import mesh_cuda_module
from tests.kernels.test_sparse_attention_mosaic_gpu import inputs


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
