"""The cache layout, its read and write functions, and chunked prefill through it against one-shot
prefill and the no-cache forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.cache import (CompressorState, cache_bytes_per_token, extend_window, gather_windows, init_cache, kv_rows,
                         num_entries, read_entries, read_rows, ring_positions, store_windows, write_entries,
                         write_window)
from dsjax.config import CSA, HCA, SLIDING, ModelConfig
from dsjax.engine.engine import Engine
from dsjax.engine.scoring import _score_step, teacher_forced_logprobs
from dsjax.model import DeepseekV4
from dsjax.quant import PackedKV, pack_kv, ue8m0_to_float
from dsjax.run_config import RunConfig
from tests.helpers import assert_close


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["mixed", "legacy"])
def test_chunked_prefill_equals_one_shot_and_no_cache(load_case, case):
    model = load_case(case)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(3)
    lengths = np.asarray([45, 13])
    ids = rng.integers(0, model.cfg.vocab_size, (2, 48)).astype(np.int32)

    @jax.jit
    def run_chunk(params, cache, tokens, start, n_valid):
        m = nnx.merge(graphdef, params)
        hidden, cache = m.extend(tokens, cache, start, n_valid)
        return m.logits(hidden), cache

    def prefill(chunk):
        cache, outs = init_cache(model, 2, 64), []
        for k in range(0, 48, chunk):
            n_valid = np.clip(lengths - k, 0, chunk)
            logits, cache = run_chunk(params, cache, jnp.asarray(ids[:, k:k + chunk]),
                                      jnp.asarray(np.minimum(k, lengths)), jnp.asarray(n_valid))
            outs.append(np.asarray(logits))
        return np.concatenate(outs, axis=1), cache

    chunked, cache_c = prefill(12)
    one_shot, cache_o = prefill(48)
    for b, n in enumerate(lengths):
        full = np.asarray(model(jnp.asarray(ids[b:b + 1, :n])))[0]
        assert_close(chunked[b, :n], full, rtol=1e-5, what=f"row {b} chunked")
        assert_close(one_shot[b, :n], full, rtol=1e-5, what=f"row {b} one-shot")
    np.testing.assert_array_equal(np.asarray(cache_c.lengths), lengths)
    # Both caches must continue identically (their unused buffer slots may differ).
    nxt = jnp.asarray([[5], [7]], jnp.int32)
    one = jnp.ones(2, jnp.int32)
    after_c, _ = run_chunk(params, cache_c, nxt, jnp.asarray(lengths), one)
    after_o, _ = run_chunk(params, cache_o, nxt, jnp.asarray(lengths), one)
    assert_close(after_c, after_o, rtol=1e-5, what="decode after chunked vs one-shot prefill")


def test_cache_shapes_follow_max_len():
    cfg = ModelConfig.preset("tiny")
    from dsjax.model import DeepseekV4
    model = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: init_cache(model, 3, 64, jnp.bfloat16))
    by_type = {}
    for meta, group in zip(model.groups_meta, cache.groups):
        for (attn, _), layer in zip(meta.pattern, group):
            by_type[attn] = layer
    assert by_type[SLIDING].window.shape == (1, 3, cfg.sliding_window, cfg.head_dim)
    assert by_type[SLIDING].compressor is None
    assert by_type[HCA].compressor.entries.shape == (1, 3, 64 // cfg.compress_rate_hca, cfg.head_dim)
    assert by_type[HCA].compressor.overlap_kv is None
    assert by_type[CSA].indexer.entries.shape == (1, 3, 64 // cfg.compress_rate_csa, cfg.index_head_dim)
    assert by_type[CSA].compressor.overlap_kv.shape == (1, 3, cfg.compress_rate_csa, cfg.head_dim)
    per_token = cache_bytes_per_token(cfg, 64)
    assert per_token[CSA] > per_token[HCA] > 0 and per_token[SLIDING] > 0


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_quantized_cache_stores_exactly_the_packed_rows(kv_dtype):
    """Layer 0's rows do not depend on the cache format, so after the same prefill its quantized window,
    compressed entries and indexer keys are the float cache's rows packed (up to XLA fusing the float
    arithmetic differently inside the two programs: a last-bit change may move a scale by an ulp)."""
    cfg = ModelConfig.preset("tiny").replace(layer_types=(CSA, HCA, SLIDING, CSA))
    model = DeepseekV4(cfg, rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 30)), jnp.int32)

    @jax.jit
    def prefill(params, cache):
        return nnx.merge(graphdef, params).extend(ids, cache, jnp.zeros(2, jnp.int32), jnp.full(2, 30, jnp.int32))[1]

    ref = prefill(params, init_cache(model, 2, 32)).groups[0][0]
    got = prefill(params, init_cache(model, 2, 32, kv_dtype=kv_dtype)).groups[0][0]
    rd = cfg.rope_compress.rope_dim(cfg.head_dim)
    written = lambda x: jax.tree.map(lambda a: a[:, :, :30 // 4], x)  # noqa: E731 (entries of complete windows)
    pairs = [(got.window, pack_kv(ref.window, kv_dtype, rd)),
             (written(got.compressor.entries), pack_kv(written(ref.compressor.entries), kv_dtype, rd)),
             (written(got.indexer.entries), pack_kv(written(ref.indexer.entries), "fp8", 0, cfg.index_head_dim))]
    for stored, want in pairs:
        assert isinstance(stored, PackedKV) and stored.group == want.group
        for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(want)):
            assert a.dtype == b.dtype and a.shape == b.shape
        assert (np.asarray(stored.codes).view(np.uint8) == np.asarray(want.codes).view(np.uint8)).mean() > 0.99
        np.testing.assert_allclose(np.asarray(ue8m0_to_float(stored.scales)),
                                   np.asarray(ue8m0_to_float(want.scales)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(stored.rope, np.float32), np.asarray(want.rope, np.float32), rtol=1e-2)
    assert got.indexer.entries.fmt == "fp8" and got.window.fmt == kv_dtype
    np.testing.assert_array_equal(np.asarray(got.compressor.buffer_kv), np.asarray(ref.compressor.buffer_kv))


@pytest.mark.heavy
def test_quantized_cache_is_close_to_the_float_cache_and_stays_compiled(load_case):
    """Teacher-forced through prefill + decode steps: fp8 rows move the next-token distribution a little,
    fp4 rows more, bf16 rows least; none of them recompiles per step."""
    model = load_case("mixed")
    rows = np.random.default_rng(2).integers(0, model.cfg.vocab_size, (2, 40))
    base = teacher_forced_logprobs(model, rows, 24, chunk_size=8, full=True)
    kl = {}
    for kv in ("bfloat16", "fp8", "fp4"):
        got = teacher_forced_logprobs(model, rows, 24, chunk_size=8, kv_dtype=kv, full=True)
        kl[kv] = float(np.mean(np.sum(np.exp(base) * (base - got), axis=-1)))
    assert 0 < kl["bfloat16"] < kl["fp8"] < kl["fp4"] < 0.05, kl
    before = _score_step._cache_size()  # a chunk program and a decode program per format, nothing per step
    teacher_forced_logprobs(model, rows[::-1], 24, chunk_size=8, kv_dtype="fp4", full=True)
    assert _score_step._cache_size() == before


def test_bad_kv_dtype_is_named(load_case):
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        init_cache(load_case("mixed"), 2, 16, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        Engine(load_case("mixed"), RunConfig(slots=2, max_len=16, kv_dtype="int8"))


def _positions_as_rows(positions_bc, width=4):
    """Rows whose every channel is their position (exact in any float storage), `[B, C, width]`."""
    return jnp.broadcast_to(jnp.asarray(positions_bc, jnp.float32)[..., None], (*np.shape(positions_bc), width))


def _ring_after(lengths, window=4, width=4):
    """A ring holding, per slot, the positions 0 … length−1 written one decode step at a time."""
    ring = jnp.full((len(lengths), window, width), -1.0)
    for p in range(max(lengths)):
        n_valid = jnp.asarray([int(p < n) for n in lengths])
        ring = write_window(ring, _positions_as_rows([[p]] * len(lengths), width), jnp.full(len(lengths), p),
                            n_valid)
    return ring


def test_ring_positions_and_window_writes_wrap():
    np.testing.assert_array_equal(np.asarray(ring_positions(jnp.asarray([5, 2, -1]), 4)),
                                  [[4, 5, 2, 3], [0, 1, 2, -1], [-4, -3, -2, -1]])
    ring = _ring_after([7, 2])
    np.testing.assert_array_equal(np.asarray(ring[..., 0]), [[4, 5, 6, 3], [0, 1, -1, -1]])
    # A chunk of 6 after 7 tokens (5 real) wraps past the ring's end more than once; a row with n_valid 0
    # keeps its ring. Each slot ends with the newest real position ≡ slot (mod 4).
    start, n_valid = jnp.asarray([7, 2]), jnp.asarray([5, 0])
    chunk = _positions_as_rows(np.asarray(start)[:, None] + np.arange(6))
    got = write_window(ring, chunk, start, n_valid)
    np.testing.assert_array_equal(np.asarray(got[..., 0]), [[8, 9, 10, 11], [0, 1, -1, -1]])
    assert got.dtype == ring.dtype


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_extend_window_shows_each_query_its_window(chunk):
    """Query q sees exactly the real positions q − W < k ≤ q, and the returned ring is `write_window`'s."""
    w, lengths, n_valid = 4, [0, 2, 9], np.asarray([chunk, min(chunk, 1), 0])
    ring = _ring_after(lengths, w)
    start = jnp.asarray(lengths)
    chunk_rows = _positions_as_rows(np.asarray(lengths)[:, None] + np.arange(chunk))
    keys, new_ring = extend_window(ring, chunk_rows, start, jnp.asarray(n_valid))
    np.testing.assert_array_equal(np.asarray(new_ring), np.asarray(write_window(ring, chunk_rows, start,
                                                                                 jnp.asarray(n_valid))))
    rows = np.asarray(keys.rows[..., 0])
    for b, (first, n) in enumerate(zip(lengths, n_valid)):
        for c in range(n):
            q = first + c
            seen = rows[b, int(keys.start_bc[b, c]):int(keys.end_bc[b, c])]
            assert sorted(seen.tolist()) == list(range(max(0, q - w + 1), q + 1)), (b, c)


def test_buffer_append_gives_the_completed_windows():
    """m = 4, CSA overlap: a slot holding 6 tokens takes 5 more (positions 6 … 10): the span is windows 1
    and 2 (positions 4 … 11), window 1 completes and is written, window 2 stays in the buffer."""
    m, c = 4, 2
    buffered = jnp.asarray([[4.0, 5, 0, 0]] * 2)[..., None] * jnp.ones(2 * c)  # positions 4, 5 at slots 0, 1
    state = CompressorState(buffer_kv=buffered, buffer_gate=-buffered, entries=jnp.zeros((2, 4, c)),
                            overlap_kv=jnp.full((2, m, c), -1.0), overlap_gate=jnp.full((2, m, c), -2.0))
    start, n_valid = jnp.asarray([6, 6]), jnp.asarray([5, 0])
    kv = _positions_as_rows(6 + np.arange(5)[None].repeat(2, 0), 2 * c)
    windows = gather_windows(state, kv, -kv, start)
    assert windows.kv_bkmn.shape == (2, 2, m, 2 * c)
    np.testing.assert_array_equal(np.asarray(windows.first_b), [1, 1])
    np.testing.assert_array_equal(np.asarray(windows.kv_bkmn[0, :, :, 0]).ravel()[:7], np.arange(4, 11))
    np.testing.assert_array_equal(np.asarray(windows.gate_bkmn[0, 0, :, 0]), [-4, -5, -6, -7])
    np.testing.assert_array_equal(np.asarray(windows.has_prev_b), [True, True])
    assert windows.prev_kv_bmc is state.overlap_kv

    pooled = jnp.asarray([[10.0, 20.0]] * 2)[..., None] * jnp.ones(c)  # window 1 → 10, window 2 → 20
    new = store_windows(state, windows, pooled, start + n_valid)
    np.testing.assert_array_equal(np.asarray(new.entries[..., 0]), [[0, 10, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(new.buffer_kv[0, :3, 0]), [8, 9, 10])
    np.testing.assert_array_equal(np.asarray(new.buffer_kv[1, :2]), np.asarray(state.buffer_kv[1, :2]))
    # The overlap becomes window 1's Ca half (its first c channels) where it completed.
    np.testing.assert_array_equal(np.asarray(new.overlap_kv[0, :, 0]), [4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(new.overlap_gate[0, :, 0]), [-4, -5, -6, -7])
    np.testing.assert_array_equal(np.asarray(new.overlap_kv[1]), np.asarray(state.overlap_kv[1]))
    assert num_entries(11, m) == 2 and num_entries(6, m) == 1


@pytest.mark.parametrize("kv_dtype", [None, "fp8", "fp4"])
def test_write_entries_lands_rows_in_the_stores_storage(kv_dtype):
    """Rows k < count go to entry first + k, packed as the store packs; rows past the store are dropped."""
    width, rd = 96, 32
    entries = kv_rows((2, 6, width), jnp.float32, kv_dtype, rd)
    rows_bkc = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, width)), jnp.float32)
    got = write_entries(entries, rows_bkc, jnp.asarray([1, 4]), jnp.asarray([2, 3]))
    assert type(got) is type(entries)
    packed = None if kv_dtype is None else pack_kv(rows_bkc, kv_dtype, rd)
    stored = np.asarray(rows_bkc if packed is None else read_rows(packed, jnp.float32))
    want = np.zeros((2, 6, width), np.float32)
    want[0, 1:3], want[1, 4:6] = stored[0, :2], stored[1, :2]
    np.testing.assert_array_equal(np.asarray(read_entries(got, jnp.float32)), want)
    if packed is not None:
        np.testing.assert_array_equal(np.asarray(got.codes[1, 4:6]).view(np.uint8),
                                      np.asarray(packed.codes[1, :2]).view(np.uint8))


@pytest.mark.parametrize("kv_dtype", ["fp4", "fp8"])
def test_v41_packed_cache_holds_the_releases_bytes(kv_dtype):
    """A V4.1 cache of `kv_dtype` "fp4" / "fp8" takes the bytes `dsjax info` prints for the release: 890 / 1490 B
    per token of global cache, 40 window rings of 128 MXFP8 rows per sequence; its rows are packed records."""
    from dsjax.cache import v41_layer_cache
    from dsjax.cache_formats import Records
    from dsjax.config_v41 import V41Config
    from dsjax.info import v41_cache_bytes

    cfg = V41Config.preset("v4.1-flash")
    max_len = 4096
    global_bytes = window_bytes = 0
    for role in cfg.layer_roles():
        one = jax.eval_shape(lambda role=role: v41_layer_cache(cfg, role, 1, max_len, jnp.bfloat16, kv_dtype))
        assert isinstance(one.window, Records) and one.window.fmt == "mxfp8"
        window_bytes += one.window.data.size
        if role.mode == "full":
            assert one.compressor.entries.fmt == ("nvfp4" if kv_dtype == "fp4" else "mxfp8")
            assert one.keys.fmt == "mxfp4"
            global_bytes += one.compressor.entries.data.size + one.keys.data.size
        else:
            assert one.compressor is None and one.keys is None
    want = v41_cache_bytes(cfg, kv_dtype)
    assert global_bytes / max_len == want["global_per_token"] == {"fp4": 890, "fp8": 1490}[kv_dtype]
    assert window_bytes == want["windows_per_sequence"]
    with pytest.raises(ValueError, match="kv_dtype"):
        v41_cache_bytes(cfg, "mxfp8")
