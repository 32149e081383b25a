"""Sampling parameters and the on-device sampler (temperature, top-k, top-p, per-request seeds, logprobs).

A request's random draw for the token at position p uses `fold_in(key(seed), p)`, so the same seed
gives the same output whatever else shares the batch. Reported log-probabilities are those of the
model's own distribution (`log_softmax(logits)`), before temperature or filtering.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 means greedy. top_k: 0 keeps every token. top_p: 1 keeps every token.
    seed: None draws one from the job's seed. stop_token_ids: None means the model's EOS ids;
    an empty list never stops early. max_tokens: new tokens at most. logprobs: None, or N for the
    chosen token's log-probability plus the N most likely alternatives (N ≤ 20).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    max_tokens: int = 16
    logprobs: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


@dataclasses.dataclass(frozen=True)
class SamplingModes:
    """Which parts of the sampler a batch needs, decided on the host: each mix is a sampler program of its
    own (`SAMPLER_MODES`, all compiled before a job starts). (A device-side `lax.cond` would make the host
    wait for the device inside every step: 2.3 ms of idle device per decode step on an H200,
    docs/benchmarks.md.) Any superset of what the rows need gives the same tokens; the default,
    everything, serves any rows."""

    random: bool = True  # some row samples (temperature > 0)
    filtered: bool = True  # some sampled row cuts by top-k or top-p (the vocabulary is sorted)
    logprobs: bool = True  # some row asks for alternatives

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> "SamplingModes":
        """Exactly what these rows need."""
        sampled = [p for p in params if p.temperature > 0]
        return cls(random=bool(sampled), filtered=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
                   logprobs=any(p.logprobs for p in params))

    def __or__(self, other: "SamplingModes") -> "SamplingModes":
        return SamplingModes(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


# Every mix of modes `SamplingModes.of` can give (filtering only where rows sample): the sampler programs
# `Engine.precompile` builds, so that no mix of requests compiles anything mid-job.
SAMPLER_MODES = tuple(SamplingModes(random, filtered, logprobs) for random in (False, True)
                      for filtered in ((False, True) if random else (False,)) for logprobs in (False, True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters as device arrays, and the batch's `modes` (static: part of the
    compiled step's identity)."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32
    seed: jax.Array  # [B] u32
    modes: SamplingModes = dataclasses.field(default=SamplingModes(), metadata={"static": True})

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
           modes: SamplingModes | None = None) -> "SamplingArrays":
        """The rows' arrays; `modes` are what they need, widened by `modes` if given."""
        needed = SamplingModes.of(params)
        return cls(temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
                   top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
                   top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
                   seed=jnp.asarray(np.asarray(seeds, np.uint32)),
                   modes=needed if modes is None else needed | modes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampled:
    token: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32, of the chosen token
    # The most likely alternatives, most likely first: zeros where the step's modes leave them out
    # (`SamplingModes.logprobs`), so meaningful only for rows that asked.
    top_ids: jax.Array  # [B, min(MAX_LOGPROBS, vocab)]
    top_logprobs: jax.Array  # [B, min(MAX_LOGPROBS, vocab)]


def sample(logits_bv: jax.Array, params: SamplingArrays, positions_b: jax.Array,
           mask_bw: jax.Array | None = None) -> Sampled:
    """Pick one token per row; `positions_b` is where each chosen token will sit in its sequence. `mask_bw`, if
    given, holds each row's allowed tokens as bits (`grammar.mask_words` int32 words a row): the others are never
    picked, and sampling renormalises over the allowed ones. Reported log-probabilities stay the model's own."""
    logits_bv = logits_bv.astype(jnp.float32)
    logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    if mask_bw is not None:
        logits_bv = jnp.where(allowed_tokens(mask_bw, logits_bv.shape[-1]), logits_bv, -jnp.inf)
    greedy_b = jnp.argmax(logits_bv, axis=-1)

    # Sorting the vocabulary (2.6 ms per decode step at 128 rows × 129K on an H200) only where a
    # sampled row filters; greedy batches skip the noise as well. The paths agree on every row: each
    # token id owns its noise draw, so the sorted and unsorted maxima pick the same token.
    modes = params.modes
    token_b = greedy_b.astype(jnp.int32)
    if modes.random:
        sampled_b = (_sample_filtered if modes.filtered else _sample_plain)(logits_bv, params, positions_b)
        token_b = jnp.where(params.temperature == 0, token_b, sampled_b).astype(jnp.int32)
    return report(logp_bv, token_b, modes)


def allowed_tokens(mask_bw: jax.Array, vocab: int) -> jax.Array:
    """`[B, vocab]` bool from bit masks `[B, words]` (bit t % 32 of word t // 32 allows token t)."""
    bits = (mask_bw[:, :, None] >> jnp.arange(32, dtype=mask_bw.dtype)) & 1
    return bits.reshape(mask_bw.shape[0], -1)[:, :vocab].astype(bool)


def report(logp_bv: jax.Array, token_b: jax.Array, modes: SamplingModes) -> Sampled:
    """The rows' chosen tokens with their log-probabilities under `logp_bv` (the model's `log_softmax`), and the
    most likely alternatives where `modes` ask for them."""
    # The alternatives are a vocabulary sort on GPUs (1 ms per decode step at 128 rows): only when a row asks.
    top_lp, top_ids = (_top_logprobs if modes.logprobs else _no_top_logprobs)(logp_bv)
    return Sampled(token=token_b, logprob=jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0],
                   top_ids=top_ids, top_logprobs=top_lp)


def _top_logprobs(logp_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
    top_lp, top_ids = jax.lax.top_k(logp_bv, min(MAX_LOGPROBS, logp_bv.shape[-1]))
    return top_lp, top_ids.astype(jnp.int32)


def _no_top_logprobs(logp_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = (logp_bv.shape[0], min(MAX_LOGPROBS, logp_bv.shape[-1]))
    return jnp.zeros(shape, logp_bv.dtype), jnp.zeros(shape, jnp.int32)


def noise_key(seed: jax.Array, position: jax.Array, stream: int | None = None) -> jax.Array:
    """The key of a request's random draws for the token at `position`: `fold_in(key(seed), position)`, the
    sampler's own; other streams (speculative decoding's) fold in their tag after it."""
    key = jax.random.fold_in(jax.random.key(seed), position)
    return key if stream is None else jax.random.fold_in(key, stream)


def gumbel_noise(seed_b: jax.Array, positions_b: jax.Array, vocab: int, stream: int | None = None) -> jax.Array:
    """Per-row Gumbel noise `[B, vocab]`, one draw per token id, keyed by the row's seed, position and stream."""
    return jax.vmap(lambda s, p: jax.random.gumbel(noise_key(s, p, stream), (vocab,), jnp.float32))(
        seed_b, positions_b)


def _sample_plain(logits_bv: jax.Array, params: SamplingArrays, positions_b: jax.Array) -> jax.Array:
    """Temperature sampling without top-k/top-p: the Gumbel-max trick on the unsorted logits."""
    temp_b = jnp.maximum(params.temperature, 1e-6)[:, None]
    noise_bv = gumbel_noise(params.seed, positions_b, logits_bv.shape[-1])
    return jnp.argmax(logits_bv / temp_b + noise_bv, axis=-1).astype(jnp.int32)


def _filtered_sorted(logits_bv: jax.Array, params: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Each row's tempered logits over the vocabulary sorted in descending order, −inf past its top-k and top-p
    cuts, and the sorted token ids."""
    temp_b = jnp.maximum(params.temperature, 1e-6)[:, None]
    # A stable sort orders tied logits by token id, so top-k/top-p cuts never depend on how the sort
    # happened to order ties (which differs with the batch's shape).
    ids_bv = jnp.broadcast_to(jnp.arange(logits_bv.shape[-1]), logits_bv.shape)
    sorted_logits, sorted_ids = jax.lax.sort((-logits_bv, ids_bv), dimension=-1, is_stable=True, num_keys=1)
    scaled = -sorted_logits / temp_b  # descending
    rank = jnp.arange(logits_bv.shape[-1])[None, :]
    keep = (params.top_k[:, None] == 0) | (rank < params.top_k[:, None])
    scaled = jnp.where(keep, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this rank
    keep &= before < params.top_p[:, None]
    return jnp.where(keep, scaled, -jnp.inf), sorted_ids


def _sample_filtered(logits_bv: jax.Array, params: SamplingArrays, positions_b: jax.Array) -> jax.Array:
    """Temperature sampling with each row's top-k and top-p cuts, over the sorted vocabulary."""
    scaled, sorted_ids = _filtered_sorted(logits_bv.astype(jnp.float32), params)
    # Each token id owns its noise draw, so a request's choice depends only on its own logits.
    noise_sorted = jnp.take_along_axis(gumbel_noise(params.seed, positions_b, logits_bv.shape[-1]), sorted_ids,
                                       axis=-1)
    picked_rank = jnp.argmax(scaled + noise_sorted, axis=-1)
    return jnp.take_along_axis(sorted_ids, picked_rank[:, None], axis=-1)[:, 0].astype(jnp.int32)


def distribution(logits_bv: jax.Array, params: SamplingArrays) -> jax.Array:
    """`[B,V]` fp32: the distribution `sample` draws each row's token from (temperature, then the top-k and top-p
    cuts; one-hot on the most likely token for greedy rows), in vocabulary order. As in `sample`, the vocabulary is
    sorted only where the batch's modes filter, and nothing but the argmax is computed where no row samples."""
    logits_bv = logits_bv.astype(jnp.float32)
    greedy = jax.nn.one_hot(jnp.argmax(logits_bv, axis=-1), logits_bv.shape[-1], dtype=jnp.float32)
    if not params.modes.random:
        return greedy
    if params.modes.filtered:
        scaled, sorted_ids = _filtered_sorted(logits_bv, params)
        b = jnp.arange(logits_bv.shape[0])[:, None]
        probs = jnp.zeros_like(logits_bv).at[b, sorted_ids].set(jax.nn.softmax(scaled, axis=-1))
    else:
        probs = jax.nn.softmax(logits_bv / jnp.maximum(params.temperature, 1e-6)[:, None], axis=-1)
    return jnp.where((params.temperature == 0)[:, None], greedy, probs)
