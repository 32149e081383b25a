"""Training DSpark's stages against a frozen V4.1 target, with the objective NeMo AutoModel's DSpark recipe uses.

Each training row gets `anchors` random anchor positions a (a + 1 still inside the row). The block at a is what
the engine drafts when the target has just emitted token a: that token at position a, then noise tokens at
a + 1 … a + k − 1, seeing the stages' context keys of positions a − window … a − 1 and the whole block. Draft i
is scored against the row's token a + 1 + i (cross-entropy), against the target's own distribution there
(the L1 distance of the probabilities, whose half is one minus the chance speculative sampling keeps the draft),
and its confidence logit against that keep chance (binary cross-entropy on the detached value). The Markov bias
sees the true previous tokens (teacher forcing). The target's features, logits, embedding and head are frozen.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsjax.layers.dspark import context_keys, draft_heads, draft_states, main_states, target_features
from dsjax.model_v41 import DeepseekV41
from dsjax.training.loss import token_nll
from dsjax.training.train import TrainConfig, fit

# The stages only: `training.train.fit`'s trainable filter for the drafter.
STAGES = nnx.All(nnx.Param, nnx.PathContains("mtp"))


@dataclasses.dataclass(frozen=True)
class DraftLossWeights:
    """The weights of the three terms (NeMo AutoModel's `train_dspark` defaults) and anchors per row."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    anchors: int = 32


def sample_anchors(key: jax.Array, rows: int, seq: int, count: int) -> jax.Array:
    """`[rows, count]` distinct anchor positions in 0 … seq − 2 per row, increasing."""
    if not 1 <= count <= seq - 1:
        raise ValueError(f"{count} anchors do not fit rows of {seq} tokens (at most {seq - 1})")
    order = jnp.argsort(jax.random.uniform(key, (rows, seq - 1)), axis=-1)
    return jnp.sort(order[:, :count], axis=-1).astype(jnp.int32)


def _blocks(model: DeepseekV41, tokens_bs: jax.Array, anchors_ba: jax.Array):
    """Everything the stages read for blocks anchored at `anchors_ba`, flattened to rows `[B·A, …]`: the block's
    input embeddings and positions, each stage's context window and its visibility, the previous and target
    tokens and which targets lie inside the row, and the target's logits for the same positions."""
    cfg = model.cfg
    b, s = tokens_bs.shape
    a = anchors_ba.shape[1]
    k, w = cfg.dspark_block_size, cfg.sliding_window
    sg = jax.lax.stop_gradient
    hidden, per_layer = model.hidden_states(tokens_bs, record=True)
    features = target_features([per_layer[i]["attn_streams"] for i in cfg.dspark_target_layer_ids])
    main_x = main_states(model.mtp, sg(features))
    positions_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    contexts = context_keys(model.mtp, main_x, positions_bs)
    window_baw = anchors_ba[..., None] - w + jnp.arange(w, dtype=jnp.int32)  # positions a − w … a − 1
    gather = lambda x_bs_, idx: jnp.take_along_axis(x_bs_, jnp.clip(idx, 0, s - 1).reshape(b, -1)[..., None],  # noqa: E731
                                                    axis=1)
    windows = [gather(c, window_baw).reshape(b * a, w, -1) for c in contexts]
    visible = jnp.broadcast_to((window_baw >= 0).reshape(b * a, 1, w), (b * a, k, w))
    block_bak = anchors_ba[..., None] + jnp.arange(k, dtype=jnp.int32)  # positions a … a + k − 1
    label_bak = block_bak + 1
    in_row = label_bak < s
    take = lambda idx: jnp.take_along_axis(tokens_bs, jnp.clip(idx, 0, s - 1).reshape(b, -1), axis=1)  # noqa: E731
    first = take(anchors_ba)
    labels = take(label_bak).reshape(b, a, k)
    ids = jnp.concatenate([first[..., None], jnp.full((b, a, k - 1), cfg.dspark_noise_token_id, jnp.int32)], -1)
    x = sg(model.embed_tokens(ids.reshape(b * a, k)))
    previous = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)
    target_logits = sg(model.logits(gather(sg(hidden), block_bak))).reshape(b, a, k, -1)
    return (x, block_bak.reshape(b * a, k), windows, visible, previous.reshape(b * a, k), labels, in_row,
            target_logits)


def draft_loss(model: DeepseekV41, tokens_bs: jax.Array, key: jax.Array,
               weights: DraftLossWeights = DraftLossWeights()):
    """`(total, metrics)`: the weighted drafter objective over `weights.anchors` random blocks per row, and the
    expected keep rate per draft position and accepted length per block (τ = 1 + Σ_i Π_{j≤i} keep_j)."""
    b, s = tokens_bs.shape
    anchors = sample_anchors(key, b, s, weights.anchors)
    return block_losses(model, tokens_bs, anchors, weights)


def block_losses(model: DeepseekV41, tokens_bs: jax.Array, anchors_ba: jax.Array,
                 weights: DraftLossWeights = DraftLossWeights()):
    """`draft_loss` at given anchors `[B, A]`."""
    b, a = anchors_ba.shape
    k = model.cfg.dspark_block_size
    x, positions, windows, visible, previous, labels, in_row, target_logits = _blocks(model, tokens_bs, anchors_ba)
    state = draft_states(model.mtp, x, positions, windows, visible)
    normed, transition, confidence = draft_heads(model.mtp, state, previous)
    logits = (model.logits(normed) + transition).reshape(b, a, k, -1)
    confidence = confidence.reshape(b, a, k)
    mask = in_row.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    ce = jnp.sum(token_nll(logits, labels) * mask) / count
    l1_bak = jnp.sum(jnp.abs(jax.nn.softmax(logits, axis=-1) - jax.nn.softmax(target_logits, axis=-1)), axis=-1)
    keep = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_bak, 0.0, 1.0))
    l1 = jnp.sum(l1_bak * mask) / count
    bce = optax.sigmoid_binary_cross_entropy(confidence.astype(jnp.float32), keep)
    conf = jnp.sum(bce * mask) / count
    total = weights.ce * ce + weights.l1 * l1 + weights.confidence * conf
    per_position = jnp.sum(keep * mask, axis=(0, 1)) / jnp.maximum(jnp.sum(mask, axis=(0, 1)), 1.0)
    tau = 1.0 + jnp.mean(jnp.sum(jnp.cumprod(keep * mask, axis=-1), axis=-1))
    return total, {"draft_ce": ce, "draft_l1": l1, "confidence_bce": conf, "keep_by_position": per_position,
                   "expected_accepted": tau}


@nnx.jit
def _heldout_blocks(model: DeepseekV41, tokens_bs: jax.Array, anchors_ba: jax.Array):
    return block_losses(model, tokens_bs, anchors_ba)[1]


def evaluate_drafter(model: DeepseekV41, rows: np.ndarray, anchors: int | None = None, seed: int = 0,
                     batch_size: int = 8) -> dict:
    """The drafter's held-out figures on `rows [R, S]` at fixed random anchors (`anchors` per row, default
    min(64, S − 1)): draft cross-entropy, mean expected keep rate per draft position and expected accepted
    length."""
    rows = np.asarray(rows, np.int32)
    anchors = min(64, rows.shape[1] - 1) if anchors is None else anchors
    key = jax.random.key(seed)
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = jnp.asarray(rows[i:i + batch_size])
        found = _heldout_blocks(model, chunk, sample_anchors(jax.random.fold_in(key, i), *chunk.shape, anchors))
        out.append((len(chunk), jax.device_get(found)))
    n = sum(c for c, _ in out)
    mean = lambda name: sum(c * np.asarray(m[name], np.float64) for c, m in out) / n  # noqa: E731
    return {"heldout_draft_ce": round(float(mean("draft_ce")), 4),
            "heldout_keep_by_position": [round(float(x), 4) for x in mean("keep_by_position")],
            "heldout_expected_accepted": round(float(mean("expected_accepted")), 4)}


def train_drafter(model: DeepseekV41, tc: TrainConfig, train_rows: np.ndarray, heldout_rows: np.ndarray,
                  weights: DraftLossWeights = DraftLossWeights(), log=print) -> DeepseekV41:
    """Train `model`'s DSpark stages from their current weights against the rest of it, frozen."""
    if model.mtp is None:
        raise ValueError("this model has no DSpark stages to train (its config has num_nextn_predict_layers = 0)")
    return fit(model, STAGES, lambda m, tokens, key: draft_loss(m, tokens, key, weights), tc, train_rows,
               lambda m: evaluate_drafter(m, heldout_rows), log)
