"""The training objective: next-token cross-entropy plus the auxiliary losses (the indexers' distillation, V4's
lightning indexer and V4.1's CSA2 indexers alike, and the expert balance), and held-out evaluation.

`evaluate` is the training code's held-out loss; `dsjax.engine.scoring` computes the same quantity
through the inference path (chunked prefill and cached decode), and the two must agree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.model import DeepseekV4
from dsjax.model_v41 import DeepseekV41


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """`indexer`: weight of the indexers' KL distillation loss (it only trains the indexers);
    `balance`: weight of the sequence-wise expert balance loss of the top-k MoE layers."""

    indexer: float = 1.0
    balance: float = 0.01


def token_nll(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
    """`−log p(target)` per position, in fp32."""
    logp = jax.nn.log_softmax(logits_bsv.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_bs[..., None], axis=-1)[..., 0]


def training_loss(model: DeepseekV4 | DeepseekV41, tokens_bs: jax.Array, weights: LossWeights = LossWeights()):
    """`(total, metrics)` for rows of `S` tokens: mean cross-entropy of predicting tokens 1…S−1, plus
    the weighted auxiliary losses summed over layers."""
    logits, per_layer = model.forward(tokens_bs[:, :-1], record=True)
    ce = jnp.mean(token_nll(logits, tokens_bs[:, 1:]))
    kl = sum((r["indexer_kl"] for r in per_layer if "indexer_kl" in r), jnp.float32(0))
    balance = sum((r["moe_balance"] for r in per_layer if "moe_balance" in r), jnp.float32(0))
    total = ce + weights.indexer * kl + weights.balance * balance
    return total, {"ce": ce, "indexer_kl": kl, "moe_balance": balance}


@nnx.jit
def _row_nll(model: DeepseekV4 | DeepseekV41, tokens_bs: jax.Array) -> jax.Array:
    return token_nll(model.forward(tokens_bs[:, :-1]), tokens_bs[:, 1:])


def evaluate(model: DeepseekV4 | DeepseekV41, rows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position of `rows [R, S]`, no cache."""
    rows = np.asarray(rows)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        nll = np.asarray(_row_nll(model, jnp.asarray(rows[i:i + batch_size])), np.float64)
        total += float(nll.sum())
        count += nll.size
    return total / count


def unigram_entropy(rows: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) of the predicted tokens under their own empirical unigram distribution: the
    best loss any context-free model can reach on these rows."""
    targets = np.asarray(rows)[:, 1:].reshape(-1)
    p = np.bincount(targets, minlength=vocab_size) / targets.size
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())
