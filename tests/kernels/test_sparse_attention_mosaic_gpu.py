"""The Mosaic GPU sparse decode kernel against the pure-JAX reference: in Mosaic GPU's interpreter
on CPU, natively on a GPU; its lowering for cuda (on any machine); what it leaves to Triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.cache_formats import Records
from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.sparse_attention.mosaic_gpu import sparse_decode_mosaic, sparse_decode_mosaic_packed
from dsjax.kernels.sparse_attention.reference import sparse_decode_reference
from dsjax.quant import pack_kv

ON_GPU = jax.default_backend() == "gpu"


def inputs(seed, b, w, t, k, hole=0.3, entries=True):
    """Random slots of 64 bf16 heads over 512-wide RMS-scale rows: ragged window lengths (the first
    slot sees no window row), distinct picks with -1 holes (the last slot picks nothing), sinks of
    both signs."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, 64, 512)), jnp.bfloat16)
    window = jnp.asarray(rng.normal(size=(b, w, 512)), jnp.bfloat16)
    window_len = rng.integers(1, w + 1, size=b)
    window_len[0] = 0
    sinks = jnp.asarray(rng.normal(size=(64,)) * 2, jnp.float32)
    args = [q, window, jnp.asarray(window_len, jnp.int32), None, sinks, 512 ** -0.5]
    if not entries:
        return tuple(args), {}
    args[3] = jnp.asarray(rng.normal(size=(b, t, 512)), jnp.bfloat16)
    idx = np.stack([rng.permutation(t)[:k] for _ in range(b)])
    idx[rng.random((b, k)) < hole] = -1
    idx[-1] = -1
    return tuple(args), {"idx_bk": jnp.asarray(idx, jnp.int32)}


CASES = [(2, 48, 300, 100, True, {"num_splits": 2}), (2, 40, 0, 0, False, {"num_splits": 1})]
if ON_GPU:
    CASES += [(64, 128, 32768, 512, True, {"num_splits": 2}), (3, 128, 4096, 1000, True, {"num_splits": 1}),
              (5, 128, 0, 0, False, {"num_splits": 3})]


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_kernel_matches_reference(seed, case):
    b, w, t, k, entries, tiling = case
    args, kw = inputs(seed, b, w, t, k, entries=entries)
    want = sparse_decode_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode_mosaic(*args, **kw, **tiling, out_dtype=jnp.float32, interpret=not ON_GPU)
    assert got.shape == want.shape and got.dtype == jnp.float32
    # P·V takes bf16 probabilities (wgmma's operands share one type): ~1e-3 of the output's scale.
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 2e-3, err
    if entries:  # the first slot sees no window row, the last no pick: both still attend the others
        assert float(jnp.max(jnp.abs(got[-1]))) > 0


def packed(rows, fmt):
    """Rows in V4's PackedKV ("fp8", "fp4"), V4.1's records ("mxfp8", "nvfp4", "mxfp4") or as they are (None)."""
    if fmt in ("fp8", "fp4"):
        return pack_kv(rows, fmt, 64)
    return Records.of(rows, fmt) if fmt else rows


@pytest.mark.parametrize("window_fmt,entries_fmt", [("fp8", "fp8"), (None, "fp4"), ("fp8", None), ("mxfp8", "nvfp4")])
def test_packed_rows_are_unpacked_for_the_kernel(window_fmt, entries_fmt):
    """Either table or both packed, V4's way or V4.1's (its release storage: an MXFP8 window, NVFP4 or
    MXFP8 entries, which unpack alike; bf16 rows of the other pass through); within the kernel's bound."""
    args, kw = inputs(3, 2, 48, 300, 100)
    pack = packed
    args = (args[0], pack(args[1], window_fmt), args[2], pack(args[3], entries_fmt)) + args[4:]
    want = sparse_decode_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode_mosaic_packed(*args, **kw, out_dtype=jnp.float32, interpret=not ON_GPU)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 2e-3, err


def test_packed_picks_past_the_entries_pick_nothing_as_the_kernel_reads_them():
    args, kw = inputs(4, 2, 48, 300, 100, hole=0.0)
    args = args[:3] + (pack_kv(args[3], "fp8", 64),) + args[4:]
    past, none = (kw["idx_bk"].at[0, :10].set(v) for v in (300, -1))
    got, want = (sparse_decode_mosaic_packed(*args, idx_bk=i, out_dtype=jnp.float32, interpret=True)
                 for i in (past, none))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_packed_path_leaves_bf16_rows_and_prefixes():
    args, kw = inputs(0, 2, 48, 300, 100)
    with pytest.raises(CannotTile, match="no packed rows"):
        sparse_decode_mosaic_packed(*args, **kw, interpret=True)
    packed = (args[0], args[1], args[2], pack_kv(args[3], "fp8", 64)) + args[4:]
    with pytest.raises(CannotTile, match="prefixes"):
        sparse_decode_mosaic_packed(*packed, entries_len_b=jnp.ones((2,), jnp.int32), interpret=True)


def test_a_slot_that_sees_nothing_attends_its_sink_alone():
    args, kw = inputs(0, 2, 48, 300, 100)
    args = (args[0], args[1], jnp.zeros((2,), jnp.int32), *args[3:])
    kw = {"idx_bk": jnp.full_like(kw["idx_bk"], -1)}
    got = sparse_decode_mosaic(*args, **kw, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), 0.0)  # zeros, not NaN


def test_lowers_for_cuda():
    args, kw = inputs(0, 2, 48, 300, 100)
    exported = jax.export.export(jax.jit(lambda *a: sparse_decode_mosaic(*a, 512 ** -0.5, idx_bk=kw["idx_bk"])),
                                 platforms=["cuda"])(*args[:5])
    assert "dsjax_sparse_decode_mosaic" in exported.mlir_module()


@pytest.mark.parametrize("change,message,untileable", [
    (lambda a, kw: ((a[0][:, :32],) + a[1:], kw), "64 bf16 query heads", True),
    (lambda a, kw: ((a[0].astype(jnp.float32),) + a[1:], kw), "64 bf16 query heads", True),
    (lambda a, kw: (a[:3] + (pack_kv(a[3], "fp8", 64),) + a[4:], kw), "entries must be a bf16 array", True),
    (lambda a, kw: (a, {"entries_len_b": jnp.ones((2,), jnp.int32)}), "prefixes", True),
    (lambda a, kw: (a, {}), "exactly one", False),
])
def test_leaves_what_it_does_not_cover_with_a_clear_error(change, message, untileable):
    """What it does not cover raises CannotTile (the op then takes the Triton kernel); bad arguments a
    plain ValueError."""
    args, kw = change(*inputs(0, 2, 48, 300, 100))
    with pytest.raises(ValueError, match=message) as err:
        sparse_decode_mosaic(*args, **kw, interpret=True)
    assert isinstance(err.value, CannotTile) == untileable


def test_native_gather_lowers_and_the_interpreter_refuses_it():
    """cp.async pieces land straight in the tiles natively (the default off the interpreter); the
    interpreter runs the bulk-copy gather and refuses the other by name."""
    args, kw = inputs(0, 2, 48, 300, 100)
    for gather in ("cp_async", None, "bulk"):
        text = jax.jit(lambda *a: sparse_decode_mosaic(*a, 512 ** -0.5, idx_bk=kw["idx_bk"], gather=gather)).trace(
            *args[:5]).lower(lowering_platforms=("cuda",)).as_text()
        assert ("nvvm.cp.async.shared.global" in text) == (gather != "bulk"), gather
    with pytest.raises(ValueError, match="gather must be 'cp_async'") as err:
        sparse_decode_mosaic(*args, **kw, gather="cp_async", interpret=True)
    assert not isinstance(err.value, CannotTile)
    with pytest.raises(ValueError, match="gather must be"):
        sparse_decode_mosaic(*args, **kw, gather="tma")


def test_rejects_too_many_rows_per_split():
    args, kw = inputs(0, 1, 128, 8192, 6400, hole=0.0)
    with pytest.raises(CannotTile, match="raise num_splits"):
        sparse_decode_mosaic(*args, **kw, num_splits=1)


def test_leaves_gpus_without_wgmma_to_triton(monkeypatch):
    class Ampere:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100", "8.0"
    monkeypatch.setattr(jax, "local_devices", lambda: [Ampere()])
    args, kw = inputs(0, 3, 24, 300, 100)  # shapes no other test traces: the check runs when tracing
    with pytest.raises(CannotTile, match="needs a Hopper GPU"):
        sparse_decode_mosaic(*args, **kw)
