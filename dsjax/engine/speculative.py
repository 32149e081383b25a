"""Speculative decoding's on-device halves: DSpark's draft of k tokens after one target step, and the target's
verification of drafts in one step.

Verification is exact speculative sampling. Draft i is drawn from the drafter's distribution p_i (the request's
temperature, top-k and top-p applied to the draft logits, `sampling.distribution`), and kept with probability
min(1, q_i(d_i) / p_i(d_i)), q_i being what the target's sampler would draw position i from; at the first rejection
the token is drawn from the residual max(q_i − p_i, 0) renormalised, and when every draft is kept, a bonus token from
the next q. Each emitted token is then distributed exactly as plain sampling from the target would draw it. A
greedy request (temperature 0) has one-hot q and p, so this is the longest prefix of drafts equal to the target's
argmax, then the target's argmax. DeepInfer subtracts α·p with α = exp(−5e-5) so the residual is never empty; that
mixes (1 − α)·p, about 5e-5 of the draft's distribution, into the corrected token's. Here α = 1: the residual is
empty only where q = p, where a rejection cannot happen (q_i(d)/p_i(d) = 1 everywhere); should rounding make one
happen, the token is drawn from q itself.

Randomness per request and position: the drafts, the acceptance draws and the sampler's own noise (which draws the
corrected and bonus tokens; `sampling.noise_key`) are separate streams of `fold_in(key(seed), position)`, so a
request's output depends on its seed alone, whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.cache import ring_positions, write_window
from dsjax.engine.sampling import SamplingArrays, distribution, gumbel_noise, noise_key
from dsjax.layers import dspark

DRAFT_STREAM = 1  # fold_in tags after the position: the draft tokens' noise,
ACCEPT_STREAM = 2  # and the uniforms that accept drafts


def draw(probs_bv: jax.Array, seed_b: jax.Array, position_b: jax.Array, stream: int | None = None) -> jax.Array:
    """One token per row from `probs_bv` (Gumbel-max on its logarithm: a one-hot row gives its token), the noise
    keyed by the row's seed, position and stream (None: the sampler's own noise at that position)."""
    noise = gumbel_noise(seed_b, position_b, probs_bv.shape[-1], stream)
    return jnp.argmax(jnp.log(probs_bv) + noise, axis=-1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    tokens: jax.Array  # [B,k] i32: draft i is the token at position + 1 + i
    probs: jax.Array  # [B,k,V] f32: the distribution draft i was drawn from
    confidence: jax.Array  # [B,k] f32: the drafter's estimate that draft i is accepted, given the ones before


def draft_tokens(model, state_bkh: jax.Array, first_b: jax.Array, params: SamplingArrays, position_b: jax.Array,
                 confidence_temperature: float = 1.0) -> Drafts:
    """The k drafts of blocks whose collapsed states are `state_bkh` (`layers.dspark.draft_states`), the block of
    row b standing at positions `position_b[b]` … with `first_b[b]` (the token the target emitted) first: each
    position's logits are the head's on the normed state plus the Markov bias of the token before it (the emitted
    token, then each draft in turn), drawn with the row's sampling parameters."""
    last = model.mtp[-1]
    base_bkv = model.logits(last.norm(state_bkh))
    tokens, probs, confidence = [], [], []
    previous = first_b
    for i in range(state_bkh.shape[1]):
        bias_bv, emb_br = last.markov_head(previous)
        p_bv = distribution(base_bkv[:, i] + bias_bv, params)
        previous = draw(p_bv, params.seed, position_b + 1 + i, DRAFT_STREAM)
        tokens.append(previous)
        probs.append(p_bv)
        logit_b = last.confidence_head(state_bkh[:, i], emb_br)
        confidence.append(jax.nn.sigmoid(logit_b / max(confidence_temperature, 1e-5)))
    return Drafts(jnp.stack(tokens, 1), jnp.stack(probs, 1), jnp.stack(confidence, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    accepted: jax.Array  # [B] i32: how many of the row's drafts are kept
    token: jax.Array  # [B] i32: the token after them (the corrected one, or the bonus one)


def verify(target_logits_bjv: jax.Array, drafts_bk: jax.Array, draft_probs_bkv: jax.Array, n_draft_b: jax.Array,
           params: SamplingArrays, position_b: jax.Array) -> Verified:
    """Exact speculative sampling of one step: `target_logits_bjv [B, k+1, V]` are the target's logits at the
    positions of the k drafts and the one after (row b's first at `position_b[b]`, where its draft 0 stands); only
    the first `n_draft_b[b]` drafts of a row count (0: a plain decode step)."""
    b, j, v = target_logits_bjv.shape
    k = j - 1
    rows = SamplingArrays(*(jnp.repeat(x, j, axis=0) for x in (params.temperature, params.top_k, params.top_p,
                                                                params.seed)), modes=params.modes)
    q_bjv = distribution(target_logits_bjv.reshape(b * j, v), rows).reshape(b, j, v)
    if k == 0:
        return Verified(jnp.zeros((b,), jnp.int32), draw(q_bjv[:, 0], params.seed, position_b))
    q_d = jnp.take_along_axis(q_bjv[:, :k], drafts_bk[..., None], axis=-1)[..., 0]
    p_d = jnp.take_along_axis(draft_probs_bkv, drafts_bk[..., None], axis=-1)[..., 0]
    offsets = jnp.arange(k)
    u_bk = jax.vmap(lambda s, p: jax.vmap(lambda i: jax.random.uniform(noise_key(s, p + i, ACCEPT_STREAM)))(offsets))(
        params.seed, position_b)
    keep_bk = (u_bk * p_d < q_d) & (offsets[None] < n_draft_b[:, None])
    accepted = jnp.sum(jnp.cumprod(keep_bk, axis=1), axis=1).astype(jnp.int32)
    rows_b = jnp.arange(b)
    q_m = q_bjv[rows_b, accepted]
    rejected = accepted < n_draft_b
    p_m = jnp.where(rejected[:, None], draft_probs_bkv[rows_b, jnp.minimum(accepted, k - 1)], 0.0)
    residual = jnp.maximum(q_m - p_m, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, q_m)
    token = draw(residual, params.seed, position_b + accepted)
    return Verified(accepted, token)


def block_inputs(model, first_b: jax.Array) -> jax.Array:
    """`[B,k,H]`: the embeddings of a draft block, the emitted token then k − 1 noise tokens."""
    cfg = model.cfg
    tokens = jnp.full((first_b.shape[0], cfg.dspark_block_size), cfg.dspark_noise_token_id, jnp.int32)
    return model.embed_tokens(tokens.at[:, 0].set(first_b))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    """A slot's drafting state between target steps: each stage's context keys in a ring (slot = position % window,
    as the target's window rings), the last emitted token (at position `cache.lengths`, not yet in the target's
    cache) and the drafts proposed after it."""

    rings: tuple  # per stage [B, W, D]
    token: jax.Array  # [B] i32
    drafts: Drafts


def new_rings(model, num_slots: int) -> tuple:
    """Empty context-key rings, one per DSpark stage."""
    cfg = model.cfg
    return tuple(jnp.zeros((num_slots, cfg.sliding_window, cfg.head_dim), model.dtype) for _ in model.mtp)


def write_context(model, rings: tuple, features_bcf: jax.Array, start_b: jax.Array, n_b: jax.Array) -> tuple:
    """The rings with the context keys of target tokens at positions start … start + n − 1 written, from their
    features (`DeepseekV41.extend`'s `record["features"]`)."""
    positions = start_b[:, None] + jnp.arange(features_bcf.shape[1])[None, :]
    keys = dspark.context_keys(model.mtp, dspark.main_states(model.mtp, features_bcf), positions)
    return tuple(write_window(ring, k.astype(ring.dtype), start_b, n_b) for ring, k in zip(rings, keys))


def propose(model, rings: tuple, token_b: jax.Array, position_b: jax.Array, params: SamplingArrays) -> Drafts:
    """The drafts after `token_b` at `position_b` (its context: the rings' positions before it, within the
    window), for positions position + 1 … position + k."""
    cfg = model.cfg
    k = cfg.dspark_block_size
    held_bw = ring_positions(position_b - 1, cfg.sliding_window)
    visible = jnp.broadcast_to((held_bw >= 0)[:, None, :], (token_b.shape[0], k, cfg.sliding_window))
    block = position_b[:, None] + jnp.arange(k)[None, :]
    state = dspark.draft_states(model.mtp, block_inputs(model, token_b), block, list(rings), visible)
    return draft_tokens(model, state, token_b, params, position_b)


def speculative_step(model, cache, state: DraftState, params: SamplingArrays, n_draft_b: jax.Array):
    """One target step over each row's emitted token and its first `n_draft` drafts: verified, the cache taken
    back past the rejected ones, the context keys of the kept tokens written and the next drafts proposed. Returns
    `(cache, state, emitted [B, k+1], n_emitted [B])`: the kept drafts then the target's token after them."""
    start = cache.lengths
    k = state.drafts.tokens.shape[1]
    tokens = jnp.concatenate([state.token[:, None], state.drafts.tokens], axis=1)
    n_valid = 1 + n_draft_b
    record: dict = {}
    hidden, cache = model.extend(tokens, cache, start, n_valid, record=record)
    verified = verify(model.logits(hidden), state.drafts.tokens, state.drafts.probs, n_draft_b, params, start + 1)
    n_kept = 1 + verified.accepted
    cache = model.rewind(cache, record, tokens, start, n_valid, n_kept)
    rings = write_context(model, state.rings, record["features"], start, n_kept)
    position = start + n_kept  # of the target's new token
    drafts = propose(model, rings, verified.token, position, params)
    emitted = jnp.concatenate([state.drafts.tokens, jnp.zeros_like(state.token)[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == verified.accepted[:, None], verified.token[:, None], emitted)
    return cache, DraftState(rings, verified.token, drafts), emitted, n_kept
