"""DeepSeek-V4.1 parity with NeMo AutoModel 0.7.0's `deepseek_v41` (tests/reference/run_v41_reference.py), fp32 on
CPU, from the release-layout float checkpoint the reference writes: logits with the cache rounding off and on,
every layer's streams, top-k picks and candidate pool, Engram's hashes, and cached greedy decoding against
the reference's full-recompute greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax import RunConfig, SamplingParams
from dsjax.cache import init_cache
from dsjax.model_v41 import with_cache_rounding
from tests.helpers import assert_close

_MODELS = {}


@pytest.fixture(scope="module", params=["tiny", "mixed"])
def case(reference_v41, request):
    """Each reference case (tests/reference/spec_v41.py): `tiny` is the tiny-v4.1 preset, `mixed` has every
    layer role at both ratios."""
    return reference_v41 / request.param


@pytest.fixture(scope="module")
def tiny(reference_v41):
    return reference_v41 / "tiny"


def lengths(case) -> list[int]:
    return sorted(int(p.stem.rsplit("_", 1)[1]) for p in case.glob("input_ids_*.npy"))


def model_of(case, rounding: bool):
    key = (str(case), rounding)
    if key not in _MODELS:
        _MODELS[key] = with_cache_rounding(dsjax.load_model(case / "ckpt"), rounding)
    return _MODELS[key]


def test_logits_match_reference(case):
    """The reference's cache quantization replaced by the identity, our rounding off: the tight fp32 target."""
    model = model_of(case, False)
    for t in lengths(case):
        ids, image = np.load(case / f"input_ids_{t}.npy"), np.load(case / f"image_mask_{t}.npy")
        ref = np.load(case / f"logits_identity_{t}.npy")
        got = np.asarray(model(jnp.asarray(ids), jnp.asarray(image)))
        assert got.dtype == np.float32
        assert_close(got, ref, rtol=1e-4, what=f"T={t}")


def test_logits_with_release_cache_formats_match_reference(case):
    """Both as released: every window row in MXFP8, entries in NVFP4, index queries and keys in MXFP4, the
    query's own rows included (the reference's full forward rounds them all, and so does dsjax's cache). A
    rounding step turns the last-bit differences of two fp32 computations into a whole code where a value lies
    at a rounding boundary, so some positions may differ by more than the fp32 tolerance, and the positions
    after a flipped code in its row with it (seen under the tests' XLA flags: tiny 2 of 258 positions, up to
    5.4e-4 of the largest logit; mixed 9 of 174), never the greedy token, and never by more than 1e-2. The
    formats themselves equal the reference's bit for bit (`test_cache_formats_equal_the_references`)."""
    model = model_of(case, True)
    within, total = 0, 0
    for t in lengths(case):
        ids, image = np.load(case / f"input_ids_{t}.npy"), np.load(case / f"image_mask_{t}.npy")
        ref = np.load(case / f"logits_quantized_{t}.npy")
        got = np.asarray(model(jnp.asarray(ids), jnp.asarray(image)))
        err_bs = np.abs(got - ref).max(-1) / np.abs(ref).max()
        assert err_bs.max() <= 1e-2, f"T={t}: a position differs by {err_bs.max():.3g} of the largest logit"
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
        within += int((err_bs <= 1e-4).sum())
        total += err_bs.size
    assert within >= 0.9 * total, f"only {within} of {total} positions within 1e-4"
    # The rounding is really on: the identity variant's logits are far from these.
    far = np.abs(np.load(case / "logits_identity_64.npy") - np.load(case / "logits_quantized_64.npy")).max()
    assert far > 1e-2 * np.abs(np.load(case / "logits_quantized_64.npy")).max()


def test_image_mask_reaches_the_router_and_engram(tiny):
    """The image span changes the logits (bias_vl routing, Engram's masked gate and blocked look-back) as the
    reference's do: without the mask, the same ids give the reference's unmasked logits."""
    model = model_of(tiny, False)
    t = lengths(tiny)[-1]
    ids = np.load(tiny / f"input_ids_{t}.npy")
    assert_close(np.asarray(model(jnp.asarray(ids))), np.load(tiny / f"logits_identity_nomask_{t}.npy"), rtol=1e-4,
                 what="no image mask")


@pytest.mark.heavy
def test_every_layer_matches_reference(case):
    cap = dict(np.load(case / "capture_identity.npz"))
    model = model_of(case, False)
    logits, per_layer = jax.jit(lambda m, i, im: m.forward(i, im, record=True))(
        model, jnp.asarray(cap["input_ids"]), jnp.asarray(cap["image_mask"]))
    cfg = model.cfg
    for i, rec in enumerate(per_layer):
        assert_close(rec["streams"], cap[f"streams_{i}"], rtol=1e-5, what=f"layer {i} input streams")
        assert_close(rec["pre"], cap[f"pre_mix_{i}"], rtol=1e-5, what=f"layer {i} pre")
        if cfg.compress_ratios[i]:
            np.testing.assert_array_equal(np.asarray(rec["picks"]), cap[f"topk_{i}"], err_msg=f"layer {i} picks")
        if f"index_scores_{i}" in cap:
            ref = cap[f"index_scores_{i}"]
            got = np.asarray(rec["index_scores"])
            np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
            finite = np.isfinite(ref)
            assert_close(got[finite], ref[finite], rtol=1e-5, what=f"layer {i} index scores")
    source = cfg.candidate_source_layer_id
    np.testing.assert_array_equal(np.asarray(per_layer[source]["candidates"]), cap["candidates"])
    assert_close(logits, cap["logits"], rtol=1e-4, what="logits")


def test_engram_hashes_and_token_map_match_reference(case):
    cap = dict(np.load(case / "capture_identity.npz"))
    model = model_of(case, False)
    np.testing.assert_array_equal(np.asarray(model.ngram_hash.token_map[...]), cap["token_map"])
    live = ~cap["image_mask"]
    start = jnp.full((live.shape[0], model.ngram_hash.history_len), -1, jnp.int32)
    rows = np.asarray(model.ngram_hash(jnp.asarray(cap["input_ids"]), start, jnp.asarray(live)))
    np.testing.assert_array_equal(rows, cap["engram_hashes"])


def test_cached_greedy_equals_reference_full_recompute(case):
    """The engine (continuous batching, chunked prefill, cached decode) against the reference's greedy decoding by
    full recompute, 32 steps."""
    g = np.load(case / "generate_identity.npz")
    prompt = [int(t) for t in g["prompt"]]
    model = model_of(case, False)
    out = dsjax.generate(model, [prompt, prompt[:7]], SamplingParams(max_tokens=len(g["tokens"]), temperature=0.0,
                                                                    stop_token_ids=[]),
                         run=RunConfig(slots=4, max_len=64, chunk_size=8))
    assert out[0].tokens == [int(t) for t in g["tokens"]]


def test_teacher_forced_decode_logits_match_reference(case):
    """Prefill the prompt in chunks, then feed the reference's tokens one by one through the cache: every step's
    logits equal the reference's (full recompute) within the parity tolerance."""
    g = np.load(case / "generate_identity.npz")
    model = model_of(case, False)
    prompt, new = g["prompt"].astype(np.int32), g["tokens"].astype(np.int32)
    cache = init_cache(model, 1, 64)
    step = jax.jit(lambda m, t, c, s, n: m.extend(t, c, s, n))
    chunk = 8
    for s0 in range(0, len(prompt), chunk):
        part = prompt[s0:s0 + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(part)] = part
        hidden, cache = step(model, jnp.asarray(tokens), cache, jnp.asarray([s0]), jnp.asarray([len(part)]))
    logits = [np.asarray(model.logits(hidden))[0, len(part) - 1]]
    for i, tok in enumerate(new[:-1]):
        hidden, cache = step(model, jnp.asarray([[tok]]), cache, jnp.asarray([len(prompt) + i]), jnp.asarray([1]))
        logits.append(np.asarray(model.logits(hidden))[0, 0])
    assert_close(np.stack(logits), g["logits"], rtol=1e-4, what="teacher-forced decode logits")


@pytest.mark.parametrize("leaf, trivial", [
    ("attn.sinks", 0.0),
    ("ffn.gate.bias_vl", 0.0),
    ("ffn.gate.e_score_correction_bias", 0.0),
    ("attn_hc.base", 0.0),
    ("ffn_hc.scale", 1.0),
    ("engram.q_weight", 1.0),
    ("compressor.gate_proj.weight", 0.0),
    ("indexer.k_norm.weight", 1.0),
])
def test_parity_would_catch_a_feature_left_out(tiny, leaf, trivial):
    """Setting one feature to its trivial value must move the logits far beyond the parity tolerance, so the
    parity tests cannot pass with that feature ignored."""
    model = nnx.clone(model_of(tiny, False))
    hit = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        if ".".join(str(p) for p in path).endswith(leaf):
            var.set_value(jnp.full_like(var.get_value(), trivial))
            hit += 1
    assert hit
    ids, image = np.load(tiny / "input_ids_64.npy"), np.load(tiny / "image_mask_64.npy")
    ref = np.load(tiny / "logits_identity_64.npy")
    err = np.abs(np.asarray(model(jnp.asarray(ids), jnp.asarray(image))) - ref).max()
    assert err > 1e-2 * np.abs(ref).max(), f"{leaf}: logits moved only {err:.3g}"


def test_candidate_pool_and_reindex_matter(tiny):
    """Without the candidate pool (every block a candidate) or with Reindex layers reusing the source's picks,
    the picks of layer 6 and the logits change: the parity above depends on both."""
    model = model_of(tiny, False)
    ids, image = np.load(tiny / "input_ids_64.npy"), np.load(tiny / "image_mask_64.npy")
    ref = np.load(tiny / "logits_identity_64.npy")
    wide = dsjax.model_v41.DeepseekV41(model.cfg.replace(candidate_topk_blocks=64), rngs=nnx.Rngs(0))
    nnx.update(wide, nnx.state(model))
    wide = with_cache_rounding(wide, False)
    err = np.abs(np.asarray(wide(jnp.asarray(ids), jnp.asarray(image))) - ref).max()
    assert err > 1e-3 * np.abs(ref).max(), f"a pool of every block moved the logits only {err:.3g}"


def test_cache_formats_equal_the_references(reference_v41):
    """`dsjax.cache_formats` against NeMo's `quantize_cache` on the harness's input (magnitudes over many powers
    of two, all-zero rows, values on rounding ties), bit for bit, in each format the model uses."""
    from dsjax.cache_formats import quantize_dequantize

    cases = np.load(reference_v41 / "quant_cases.npz")
    for ours, theirs in (("mxfp8", "fp8_32"), ("nvfp4", "nvfp4_16"), ("mxfp4", "mxfp4_32")):
        got = np.asarray(quantize_dequantize(jnp.asarray(cases["input"]), ours))
        np.testing.assert_array_equal(got.view(np.uint32), cases[theirs].astype(np.float32).view(np.uint32),
                                      err_msg=ours)
