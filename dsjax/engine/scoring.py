"""Teacher-forced scoring through the inference path: chunked prefill, then one cached decode step per
token, the given next token fed in place of a sampled one. It yields the log-probability the engine
would assign to each token of a fixed text (held-out loss, perplexity, prompt logprobs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import init_cache
from dsjax.model import DeepseekV4


def teacher_forced_logprobs(model: DeepseekV4, rows: np.ndarray, prefill_tokens: int, chunk_size: int = 64,
                            cache_dtype=None, kv_dtype: str | None = None, full: bool = False) -> np.ndarray:
    """`log p(rows[:, t] | rows[:, :t])` for t = 1…S−1, as `[R, S−1]` float32; with `full`, the whole
    next-token log-distributions `[R, S−1, vocab]` instead.

    The first `prefill_tokens` tokens of each row enter the cache through prefill chunks of
    `chunk_size`; every later token enters through a single-token decode step, as in generation.
    `cache_dtype` and `kv_dtype` choose the cache's storage (`dsjax.cache.init_cache`).
    """
    rows = np.asarray(rows, np.int32)
    n_rows, seq = rows.shape
    if not 1 <= prefill_tokens <= seq:
        raise ValueError(f"prefill_tokens must be in [1, {seq}], got {prefill_tokens}")
    graphdef, params = nnx.split(model)
    cache = init_cache(model, n_rows, seq, cache_dtype, kv_dtype)
    targets = np.concatenate([rows[:, 1:], np.zeros((n_rows, 1), np.int32)], axis=1)
    out = np.zeros((n_rows, seq) + ((model.cfg.vocab_size,) if full else ()), np.float32)
    spans = [(s, min(s + chunk_size, prefill_tokens)) for s in range(0, prefill_tokens, chunk_size)]
    spans += [(s, s + 1) for s in range(prefill_tokens, seq)]
    for start, end in spans:
        width = chunk_size if start < prefill_tokens else 1  # two compiled shapes in all
        tokens = np.zeros((n_rows, width), np.int32)
        want = np.zeros((n_rows, width), np.int32)
        tokens[:, :end - start] = rows[:, start:end]
        want[:, :end - start] = targets[:, start:end]
        cache, logp = _score_step(graphdef, full, params, cache, jnp.asarray(tokens), jnp.asarray(want),
                                  jnp.full((n_rows,), start, jnp.int32), jnp.full((n_rows,), end - start, jnp.int32))
        out[:, start:end] = np.asarray(logp)[:, :end - start]
    return out[:, :-1]


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _score_step(graphdef, full, params, cache, tokens_bc, targets_bc, start_b, n_valid_b):
    model = nnx.merge(graphdef, params)
    hidden_bch, cache = model.extend(tokens_bc, cache, start_b, n_valid_b)
    logp_bcv = jax.nn.log_softmax(model.logits(hidden_bch), axis=-1)
    return cache, logp_bcv if full else jnp.take_along_axis(logp_bcv, targets_bc[..., None], axis=-1)[..., 0]
