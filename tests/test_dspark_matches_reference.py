"""DeepSeek-V4.1's DSpark drafter against NeMo AutoModel 0.7.0's `DeepseekV41DSparkBackbone`
(tests/reference/run_v41_dspark_reference.py), fp32 on CPU, from the release-layout checkpoint the reference writes
(`mtp.*` included): the target features, then blocks of draft positions at three anchors a row (their final states,
Markov bias, confidence and logits), with the window keys' MXFP8 rounding off and on."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers import dspark
from dsjax.model_v41 import with_cache_rounding
from tests.helpers import assert_close

RTOL = 1e-4  # the bound; the runs here agree to about 1e-6


@pytest.fixture(scope="module")
def case(reference_v41_dspark):
    return reference_v41_dspark / "dspark"


@pytest.fixture(scope="module")
def model(case):
    return dsjax.load_model(case / "ckpt")


def draft_blocks(model, case, confidence_from_normed: bool):
    """(normed, Markov bias, confidence logits, logits) `[B, A, k, …]` for the reference's anchors: each block is
    the token at its anchor a, then noise tokens, at positions a …; its context the reference's features' keys at
    a − window … a − 1; each position's previous token the input id at its own position."""
    cfg = model.cfg
    features, ids, anchors = (np.load(case / f"{n}.npy") for n in ("features", "input_ids", "anchors"))
    b, t, _ = features.shape
    n_blocks, k = anchors.shape[1], cfg.dspark_block_size
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    keys = dspark.context_keys(model.mtp, dspark.main_states(model.mtp, jnp.asarray(features)), positions)
    per_block = lambda x: jnp.repeat(x, n_blocks, axis=0)  # noqa: E731  rows b·A, block-major within a row
    anchor = jnp.asarray(anchors).reshape(-1)
    visible = dspark.context_visible(per_block(positions), anchor, cfg.sliding_window)
    block_pos = anchor[:, None] + jnp.arange(k)
    first = jnp.take_along_axis(jnp.asarray(ids), jnp.asarray(anchors), axis=1).reshape(-1)
    tokens = jnp.full((b * n_blocks, k), cfg.dspark_noise_token_id).at[:, 0].set(first)
    state = dspark.draft_states(model.mtp, model.embed_tokens(tokens), block_pos, [per_block(x) for x in keys],
                                jnp.broadcast_to(visible[:, None], (b * n_blocks, k, t)))
    previous = jnp.take_along_axis(per_block(jnp.asarray(ids)), block_pos, axis=1)
    normed, transition, confidence = dspark.draft_heads(model.mtp, state, previous, confidence_from_normed)
    out = normed, transition, confidence, model.logits(normed) + transition
    return [np.asarray(x).reshape(b, n_blocks, k, *x.shape[2:]) for x in out]


@pytest.mark.parametrize("variant", ["identity", "quantized"])
def test_draft_blocks_match_reference(model, case, variant):
    """Identity: the reference's fp8 rounding of context and draft keys replaced by the identity, ours off;
    quantized: both as released (MXFP8 in blocks of 32). The confidence head reads the normed state here, as
    NeMo's does."""
    ref = np.load(case / f"draft_{variant}.npz")
    got = draft_blocks(with_cache_rounding(model, variant == "quantized"), case, confidence_from_normed=True)
    for name, value in zip(("normed", "transition", "confidence", "logits"), got):
        assert value.dtype == np.float32
        assert_close(value, ref[name], rtol=RTOL, what=f"{variant} {name}")


def test_release_confidence_reads_the_state_before_the_norm(model, case):
    """The release (and DeepInfer) feed the confidence head the collapsed state before the final norm; NeMo's
    trainer feeds it the normed one. The two differ, and only the confidence: the drafts are the same."""
    ref = np.load(case / "draft_identity.npz")
    plain = with_cache_rounding(model, False)
    normed, _, confidence, logits = draft_blocks(plain, case, confidence_from_normed=False)
    assert_close(logits, ref["logits"], rtol=RTOL, what="logits")
    assert np.abs(confidence - ref["confidence"]).max() > 1e-2 * np.abs(ref["confidence"]).max()


def test_target_features_match_reference(model, case):
    """The streams entering each target layer's attention mixes (after Engram), averaged over the streams, as
    NeMo's `get_dspark_target_feature_modules` capture them (its cache rounding off: ours off)."""
    ids = jnp.asarray(np.load(case / "input_ids.npy"))
    got = np.asarray(with_cache_rounding(model, False).dspark_features(ids))
    assert_close(got, np.load(case / "features.npy"), rtol=RTOL, what="features")
