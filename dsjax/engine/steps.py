"""The engine's steps as pure jitted functions over the fixed-shape cache (its buffers donated), and the
layout the cache keeps on a mesh.

The model's graph is each step's static first argument (`StaticGraph`), its weights the second:

- `decode` feeds each active slot its last token; `prefill_chunk` writes one chunk of tokens into the
  given slots from their start positions. Both return the cache, next-token logits for every slot and
  the positions the sampled tokens will take; `sample_rows` (the sampler, a program of its own per
  `SamplingModes`) turns those into `Sampled` rows. So the model's programs never depend on the
  requests' sampling options. `new_cache` makes an empty cache on the devices. `Engine`
  (`engine/engine.py`) calls these.
- `decode_step` and `prefill_step` are the same steps with the sampler in one function: what `dsjax
  export` writes and `dsjax plan` measures (`decode_program`, `prefill_program`: their jitted forms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import Cache, init_cache
from dsjax.engine import speculative
from dsjax.engine.sampling import Sampled, SamplingArrays, sample
from dsjax.engine.slots import put_slots, take_slots
from dsjax.parallel.rules import slot_axes


class StaticGraph:
    """A model's graphdef as the steps' static argument: hashed once, and equal to itself at once.

    jit hashes its static arguments on every call, and a V4 graphdef hashes its whole node tree anew
    each time (about a millisecond, on the host, per decode step). Graphs of equal structure still
    compare equal, so engines of one model share their compiled steps."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (
            self is other or (self._hash == other._hash and self.graphdef == other.graphdef))


def graph_of(graphdef):
    """The graphdef a step was given, unwrapped from its `StaticGraph`."""
    return graphdef.graphdef if isinstance(graphdef, StaticGraph) else graphdef


def cache_specs(cache: Cache):
    """Partition specs of the cache on the context mesh: slots split by the rules (axis 1 of the group
    arrays, under the stacked-layer axis); the lengths replicated, since the host reads them."""
    axes = slot_axes(jax.sharding.get_abstract_mesh(), cache.lengths.shape[0])
    slots = axes[0] if len(axes) == 1 else (axes or None)
    return Cache(lengths=jax.sharding.PartitionSpec(),
                 groups=jax.tree.map(lambda x: jax.sharding.PartitionSpec(None, slots), cache.groups),
                 history=None if cache.history is None else jax.sharding.PartitionSpec(slots))


def constrain_cache(cache: Cache) -> Cache:
    """The cache a step returns, laid out as it came in (so donation reuses the buffers and the next
    step sees the same shardings); the lengths replicated for the host. A no-op without a mesh."""
    if not jax.sharding.get_abstract_mesh().axis_names:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_specs(cache))


def _for_host(tree):
    """What the host reads back (sampled tokens, cache lengths), replicated over the context mesh, so that
    every process of a multi-host run holds it whole. A no-op without a mesh."""
    if not jax.sharding.get_abstract_mesh().axis_names:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()), tree)


def _decode_logits(graphdef, params, cache: Cache, last_tokens_b, active_b):
    """Each active slot's next-token logits `[slots, vocab]` (float32) after feeding it its last token."""
    model = nnx.merge(graph_of(graphdef), params)
    hidden_b1h, cache = model.extend(last_tokens_b[:, None], cache, cache.lengths, active_b.astype(jnp.int32))
    return cache, model.logits(hidden_b1h)[:, 0].astype(jnp.float32)


def _prefill_logits(graphdef, params, cache: Cache, tokens_nc, slots_n, start_n, n_valid_n, spliced=None,
                    floor_n=None, rings=None):
    """One prefill chunk of rows `slots_n`: the cache with their tokens written, and each row's logits
    `[n, vocab]` (float32) after its last valid token of the chunk. `floor_n` (V4.1's bounded replay)
    hides the decoder windows' positions below it. With DSpark's context rings (`rings`, one row per slot), also
    the rings with the chunk's context keys written."""
    model = nnx.merge(graph_of(graphdef), params)
    part = take_slots(cache, slots_n)
    options = {} if floor_n is None else {"floor_b": floor_n}
    record = None if rings is None else {}
    if record is not None:
        options.update(record=record, rewindable=False)
    hidden_nch, part = model.extend(tokens_nc, part, start_n, n_valid_n, spliced, **options)
    last = jnp.clip(n_valid_n - 1, 0, tokens_nc.shape[1] - 1)
    hidden_nh = jnp.take_along_axis(hidden_nch, last[:, None, None], axis=1)
    out = put_slots(cache, part, slots_n), model.logits(hidden_nh)[:, 0].astype(jnp.float32)
    if rings is None:
        return out
    taken = speculative.write_context(model, tuple(r[slots_n] for r in rings), record["features"], start_n, n_valid_n)
    return *out, tuple(r.at[slots_n].set(t) for r, t in zip(rings, taken))


def decode_step(graphdef, params, cache: Cache, last_tokens_b, active_b, sampling: SamplingArrays
                ) -> tuple[Cache, Sampled]:
    """Decode and sample as one function (what `dsjax export` and `dsjax plan` compile as one program;
    the engine runs the two as separate programs): the sampled token of every slot."""
    start_b = cache.lengths
    cache, logits_bv = _decode_logits(graphdef, params, cache, last_tokens_b, active_b)
    return constrain_cache(cache), _for_host(sample(logits_bv, sampling, start_b + 1))


def prefill_step(graphdef, params, cache: Cache, tokens_nc, slots_n, start_n, n_valid_n, sampling: SamplingArrays,
                 spliced=None) -> tuple[Cache, Sampled]:
    """One prefill chunk and the sampler as one function (`dsjax export`, `dsjax plan`): `sampling` and
    the result have one row per chunk row."""
    cache, logits_nv = _prefill_logits(graphdef, params, cache, tokens_nc, slots_n, start_n, n_valid_n, spliced)
    return constrain_cache(cache), _for_host(sample(logits_nv, sampling, start_n + n_valid_n))


# Each with the sampler in the same program, as `dsjax plan` measures and `dsjax export` writes them.
decode_program = jax.jit(decode_step, static_argnums=0, donate_argnums=2)
prefill_program = jax.jit(prefill_step, static_argnums=0, donate_argnums=2)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode(graphdef, params, cache: Cache, last_tokens_b, active_b):
    """The engine's decode step: (cache, logits `[slots, vocab]`, positions `[slots]`)."""
    cache, logits_bv = _decode_logits(graphdef, params, cache, last_tokens_b, active_b)
    # The positions the sampled tokens will take (the new lengths, for active slots), as an output of
    # their own: the next step donates the cache while the sampler may still read them.
    return constrain_cache(cache), *_for_host((logits_bv, cache.lengths + 0))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3, 11))
def prefill_chunk(graphdef, params, cache: Cache, logits_sv, tokens_nc, slots_n, start_n, n_valid_n, ends_n,
                  spliced=None, floor_n=None, rings=None):
    """A prefill chunk; the logits of rows whose prompt ends in it land in their slot's row of `logits_sv`.
    Returns (cache, logits `[slots, vocab]`, positions `[slots]`), and DSpark's context rings after them when
    `rings` are given (`speculative.DraftState.rings`)."""
    out = _prefill_logits(graphdef, params, cache, tokens_nc, slots_n, start_n, n_valid_n, spliced, floor_n, rings)
    cache, logits_nv = out[:2]
    logits_sv = logits_sv.at[slots_n].set(jnp.where(ends_n[:, None], logits_nv, logits_sv[slots_n]))
    result = constrain_cache(cache), *_for_host((logits_sv, cache.lengths + 0))
    return result if rings is None else (*result, _for_host(out[2]))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill_encoder_chunk(graphdef, params, cache: Cache, tokens_nc, slots_n, start_n, n_valid_n, spliced=None):
    """A prefill chunk through a causal encoder-decoder's encoder only (and its global cache's write): for
    chunks wholly before the positions the decoder must see (`model_v41.DeepseekV41.extend`)."""
    model = nnx.merge(graph_of(graphdef), params)
    part = take_slots(cache, slots_n)
    _, part = model.extend(tokens_nc, part, start_n, n_valid_n, spliced, decoder=False)
    return constrain_cache(put_slots(cache, part, slots_n))


# Speculative decoding (DSpark, `engine.speculative`): one verification step is four programs, so that only the
# small ones depend on the requests' sampling modes and each model program is compiled once per width.

@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def spec_target(graphdef, width: int, params, cache: Cache, state: speculative.DraftState, active_b):
    """The target over each active row's token and drafts (`speculative.rows_fed` at this width): (cache, record,
    logits `[slots, width, vocab]`, the rows' first positions, the positions each fed)."""
    model = nnx.merge(graph_of(graphdef), params)
    n_valid = speculative.rows_fed(state, active_b, width)
    start = cache.lengths + 0
    cache, record, logits = speculative.target_pass(model, cache, speculative.block_tokens(state, width), n_valid)
    return constrain_cache(cache), *_for_host((record, logits, start, n_valid))


@jax.jit
def spec_verify(logits_bwv, state: speculative.DraftState, start_b, n_valid_b,
                sampling: SamplingArrays) -> speculative.Verdict:
    """The verification of a target pass (`speculative.verdict`): one program per width and `SamplingModes`."""
    return _for_host(speculative.verdict(logits_bwv, state, start_b, n_valid_b, sampling))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def spec_take_back(graphdef, params, cache: Cache, record, state: speculative.DraftState, start_b, n_valid_b, count_b):
    """The cache taken back past each row's rejected drafts and the kept positions' context keys written: (cache,
    rings, the rows' next positions)."""
    model = nnx.merge(graph_of(graphdef), params)
    tokens = speculative.block_tokens(state, record["image"].shape[1])
    cache, rings = speculative.take_back(model, cache, record, state.rings, tokens, start_b, n_valid_b, count_b)
    return constrain_cache(cache), *_for_host((rings, cache.lengths + 0))


@functools.partial(jax.jit, static_argnums=0)
def spec_propose(graphdef, params, rings: tuple, token_b, budget_b, positions_b,
                 sampling: SamplingArrays) -> speculative.DraftState:
    """The drafting state with each slot's next drafts proposed after `token_b` at `positions_b`."""
    model = nnx.merge(graph_of(graphdef), params)
    drafts = speculative.propose(model, rings, token_b, positions_b, sampling)
    return _for_host(speculative.DraftState(rings, token_b, drafts, budget_b))


@functools.partial(jax.jit, static_argnums=(0, 1))
def new_draft_state(graphdef, num_slots: int, params) -> speculative.DraftState:
    """The drafting state of empty slots."""
    return _for_host(speculative.new_state(nnx.merge(graph_of(graphdef), params), num_slots))


@jax.jit
def sample_rows(logits_sv, sampling: SamplingArrays, positions_s, mask_sw=None) -> Sampled:
    """The sampler as a program of its own: one per `SamplingModes` (a static part of `sampling`), and one more per
    mix with each row's token mask (`grammar`)."""
    return _for_host(sample(logits_sv, sampling, positions_s, mask_sw))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def new_cache(graphdef, num_slots: int, max_len: int, kv_dtype: str | None, params) -> Cache:
    """An empty cache of the model's float dtype, laid out as `cache_specs` says. The statics come first,
    as in the other steps, so that every step lowers as `step.lower(*statics, *arrays)`."""
    model = nnx.merge(graph_of(graphdef), params)
    return constrain_cache(init_cache(model, num_slots, max_len, kv_dtype=kv_dtype))
