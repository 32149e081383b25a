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
from dsjax.engine.sampling import Sampled, SamplingArrays, distribution, gumbel_noise, noise_key, report
from dsjax.layers import dspark

DRAFT_STREAM = 1  # fold_in tags after the position: the draft tokens' noise,
ACCEPT_STREAM = 2  # and the uniforms that accept drafts


def check_drafting(cfg, drafts: int | None) -> None:
    """Raise ValueError unless a model of `cfg` drafts with DSpark (a DeepSeek-V4.1 config with draft stages) and
    `drafts` (None: any) is within its block."""
    if getattr(cfg, "family", "v4") != "v4.1" or not cfg.num_nextn_predict_layers:
        raise ValueError("--speculative dspark needs a model with DSpark draft stages (a DeepSeek-V4.1 checkpoint "
                         "whose config has num_nextn_predict_layers > 0 and whose weights hold mtp.*); this one has "
                         "none")
    if drafts is not None and drafts > cfg.dspark_block_size:
        raise ValueError(f"--drafts {drafts}: this model's DSpark drafts at most {cfg.dspark_block_size} tokens a step")


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
    """The slots' drafting state between target steps: each stage's context keys in a ring (slot = position % window,
    as the target's window rings), the last emitted token (at position `cache.lengths`, not yet in the target's
    cache), the drafts proposed after it, and the tokens each slot may still emit (0: none; the scheduler sets it
    when a slot starts, from the request's max_tokens and the cache's max_len), which bounds the drafts a step
    verifies."""

    rings: tuple  # per stage [B, W, D]
    token: jax.Array  # [B] i32
    drafts: Drafts
    budget: jax.Array  # [B] i32


def new_state(model, num_slots: int) -> DraftState:
    """The drafting state of `num_slots` empty slots."""
    cfg = model.cfg
    k, v = cfg.dspark_block_size, cfg.vocab_size
    rings = tuple(jnp.zeros((num_slots, cfg.sliding_window, cfg.head_dim), model.dtype) for _ in model.mtp)
    zeros = jnp.zeros((num_slots,), jnp.int32)
    drafts = Drafts(jnp.zeros((num_slots, k), jnp.int32), jnp.zeros((num_slots, k, v), jnp.float32),
                    jnp.zeros((num_slots, k), jnp.float32))
    return DraftState(rings, zeros, drafts, zeros)


def write_context(model, rings: tuple, features_bcf: jax.Array, start_b: jax.Array, n_b: jax.Array) -> tuple:
    """The rings with the context keys of target tokens at positions start … start + n − 1 written, from their
    features (`DeepseekV41.extend`'s `record["features"]`). Of a chunk longer than the window (a prefill's), only
    the last window's positions are projected: the ring keeps no others."""
    window = rings[0].shape[1]
    if features_bcf.shape[1] > window:
        skip_b = jnp.maximum(n_b - window, 0)
        features_bcf = jnp.take_along_axis(features_bcf, (skip_b[:, None] + jnp.arange(window))[..., None], axis=1)
        start_b, n_b = start_b + skip_b, jnp.minimum(n_b, window)
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


def block_tokens(state: DraftState, width: int) -> jax.Array:
    """`[B, width]`: what a step of this width feeds the target, each row's emitted token then its first drafts."""
    return jnp.concatenate([state.token[:, None], state.drafts.tokens[:, :width - 1]], axis=1)


def rows_fed(state: DraftState, active_b: jax.Array, width: int) -> jax.Array:
    """`[B]`: the positions each row feeds the target in a step of this width: its token and as many drafts as the
    width and its budget allow (a row emits at most one token more than it verifies drafts); 0 for rows not
    active or with nothing left to emit."""
    live = active_b & (state.budget > 0)
    return jnp.where(live, 1 + jnp.clip(jnp.minimum(width - 1, state.budget - 1), 0), 0).astype(jnp.int32)


def target_pass(model, cache, tokens_bw: jax.Array, n_valid_b: jax.Array):
    """The target over each row's block: `(cache, record, logits [B, w, V])`, the record what `take_back` needs."""
    record: dict = {}
    hidden, cache = model.extend(tokens_bw, cache, cache.lengths, n_valid_b, record=record)
    return cache, record, model.logits(hidden)


def emitted_tokens(drafts_bk: jax.Array, verified: Verified, width: int) -> jax.Array:
    """`[B, width]`: the kept drafts, then the target's token after them (what lies past it means nothing)."""
    out = jnp.concatenate([drafts_bk[:, :width - 1], jnp.zeros_like(verified.token)[:, None]], axis=1)
    return jnp.where(jnp.arange(width)[None, :] == verified.accepted[:, None], verified.token[:, None], out)


def take_back(model, cache, record: dict, rings: tuple, tokens_bw: jax.Array, start_b: jax.Array,
              n_valid_b: jax.Array, n_kept_b: jax.Array):
    """After a target pass over n_valid positions per row from `start_b`: the cache taken back to the first n_kept
    (`DeepseekV41.rewind`) and the kept positions' context keys written to the rings. Returns `(cache, rings)`."""
    cache = model.rewind(cache, record, tokens_bw, start_b, n_valid_b, n_kept_b)
    return cache, write_context(model, rings, record["features"], start_b, n_kept_b)


def speculative_step(model, cache, state: DraftState, params: SamplingArrays, n_draft_b: jax.Array):
    """One target step over each row's emitted token and its first `n_draft` drafts: verified, the cache taken
    back past the rejected ones, the context keys of the kept tokens written and the next drafts proposed. Returns
    `(cache, state, emitted [B, k+1], n_emitted [B])`: the kept drafts then the target's token after them. (The
    engine runs the same parts as separate programs, `engine.steps`; this ignores the state's budget.)"""
    start = cache.lengths
    k = state.drafts.tokens.shape[1]
    tokens = block_tokens(state, k + 1)
    n_valid = 1 + n_draft_b
    cache, record, logits = target_pass(model, cache, tokens, n_valid)
    verified = verify(logits, state.drafts.tokens, state.drafts.probs, n_draft_b, params, start + 1)
    n_kept = 1 + verified.accepted
    cache, rings = take_back(model, cache, record, state.rings, tokens, start, n_valid, n_kept)
    drafts = propose(model, rings, verified.token, start + n_kept, params)
    return (cache, DraftState(rings, verified.token, drafts, state.budget - n_kept),
            emitted_tokens(state.drafts.tokens, verified, k + 1), n_kept)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verdict:
    """A verification step's result for the host and the next step."""

    rows: Sampled  # [B, w] each ([B, w, top] the alternatives): the tokens at positions start + 1 …, as the sampler's
    count: jax.Array  # [B] i32: how many of them the row emits (0: it did not run)
    verified: jax.Array  # [B] i32: the drafts it verified
    token: jax.Array  # [B] i32: its last emitted token (the state's, for a row that did not run)
    budget: jax.Array  # [B] i32: what it may still emit


def verdict(logits_bwv: jax.Array, state: DraftState, start_b: jax.Array, n_valid_b: jax.Array,
            params: SamplingArrays) -> Verdict:
    """`verify` of a target pass over `n_valid_b` positions per row (`rows_fed`), the first at `start_b`: the
    emitted tokens with their log-probabilities under the target (`sampling.report`)."""
    b, w, v = logits_bwv.shape
    n_draft = jnp.maximum(n_valid_b - 1, 0)
    verified = verify(logits_bwv, state.drafts.tokens[:, :w - 1], state.drafts.probs[:, :w - 1], n_draft, params,
                      start_b + 1)
    ran = n_valid_b > 0
    count = jnp.where(ran, 1 + verified.accepted, 0).astype(jnp.int32)
    tokens_bw = emitted_tokens(state.drafts.tokens, verified, w)
    rows = report(jax.nn.log_softmax(logits_bwv.reshape(b * w, v), axis=-1), tokens_bw.reshape(b * w), params.modes)
    rows = jax.tree.map(lambda x: x.reshape(b, w, *x.shape[1:]), rows)
    return Verdict(rows, count, n_draft, jnp.where(ran, verified.token, state.token), state.budget - count)
