"""Jitted prefill and decode steps over the fixed-shape cache, with the cache buffers donated.

`decode` advances every active slot by one token; `prefill` fills the given slots from position 0,
one fixed-size chunk at a time, so a prompt of any length runs through the same compiled chunk step.
Both sample on device and return `Sampled` rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import Cache, init_cache
from dsjax.engine.sampling import Sampled, SamplingArrays, SamplingModes, sample
from dsjax.layers.vision import cell_bucket, fused_attention_fits, layout, pad_cells, patchify
from dsjax.parallel.rules import slot_axes
from dsjax.quant import KV_DTYPES


def take_slots(cache: Cache, slots: jax.Array) -> Cache:
    """The rows `slots` of every cache array (slot axis 0 for lengths, 1 under the repeat axis)."""
    return Cache(lengths=cache.lengths[slots],
                 groups=jax.tree.map(lambda x: jnp.take(x, slots, axis=1), cache.groups))


def put_slots(cache: Cache, part: Cache, slots: jax.Array) -> Cache:
    """`cache` with rows `slots` replaced by `part` (slots must be distinct)."""
    return Cache(lengths=cache.lengths.at[slots].set(part.lengths),
                 groups=jax.tree.map(lambda x, y: x.at[:, slots].set(y), cache.groups, part.groups))


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


def _graph(graphdef):
    return graphdef.graphdef if isinstance(graphdef, StaticGraph) else graphdef


class Engine:
    """Compiled steps for one model, `num_slots` sequences of up to `max_len` tokens, prefill chunks of
    `chunk_size` tokens. `params` are the model's weights (taken once; steps take them as an argument).
    `cache_dtype` is the cache's float dtype (default: the model's); `kv_dtype` "bfloat16", "fp8" or "fp4"
    stores its K=V rows that way (`dsjax.cache`)."""

    def __init__(self, model, num_slots: int, max_len: int, chunk_size: int = 64, cache_dtype=None,
                 kv_dtype: str | None = None):
        if num_slots < 1 or max_len < 1 or chunk_size < 1:
            raise ValueError("num_slots, max_len and chunk_size must be positive")
        self.model = model
        self.cfg = model.cfg
        self.num_slots, self.max_len, self.chunk_size = num_slots, max_len, chunk_size
        if kv_dtype not in (None, *KV_DTYPES):
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        self.cache_dtype, self.kv_dtype = cache_dtype, kv_dtype
        self.graphdef, self.params = nnx.split(model)
        self._static = StaticGraph(self.graphdef)
        # The sampler parts the steps have needed so far (`SamplingModes`); only `widen_sampling` changes them.
        self.sampling_modes = SamplingModes(random=False, filtered=False, logprobs=False)
        # The experts import tokamax on first use; doing it inside the first trace changes jax's tracing
        # context once, so every step would be traced again by the next engine. Import it before.
        import tokamax  # noqa: F401

    def widen_sampling(self, modes: SamplingModes) -> SamplingModes:
        """Add `modes` to the sampler parts the steps compile for, and return them all. They only ever
        widen, so each widening compiles the steps once and later, narrower jobs reuse them."""
        self.sampling_modes = self.sampling_modes | modes
        return self.sampling_modes

    def new_cache(self) -> Cache:
        """An empty cache; under `jax.set_mesh` each device holds the slots the rules give it."""
        make = functools.partial(init_cache, self.model, self.num_slots, self.max_len, self.cache_dtype,
                                 self.kv_dtype)
        mesh = jax.sharding.get_mesh()
        if not mesh.axis_names:
            return make()
        specs = _cache_specs(jax.eval_shape(make))
        return jax.jit(make, out_shardings=jax.tree.map(lambda p: jax.sharding.NamedSharding(mesh, p), specs))()

    def encode_image(self, pixels_hwc: np.ndarray) -> np.ndarray:
        """One image's embeddings `[image_tokens, hidden]` (float32, on the host) from its `[H, W, 3]`
        uint8 pixels (`layers.vision.decode_image`), for `Spliced`. The image is padded with blank cells
        to `cell_bucket` cells, so images of many sizes share a few compiled encoders."""
        vision = self.cfg.vision
        if self.model.vision is None:
            raise ValueError("this model has no image encoder (its config has no vision_config)")
        h, w = pixels_hwc.shape[:2]
        rows, cols = vision.grid(w, h)
        a = pad_cells(patchify(pixels_hwc, vision), cell_bucket(rows * cols), vision)
        cells, begin, row_end, end = jax.device_get(_encode_cells(
            self._static, self._fused_vision(), self.params, a["patches"], a["row"], a["col"], a["valid"]))
        return layout(np.asarray(cells, np.float32)[:rows * cols], rows, cols,
                      *(np.asarray(x, np.float32) for x in (begin, row_end, end)))

    def _fused_vision(self) -> bool:
        """Whether the encoder's attention goes through cuDNN's fused kernel: on NVIDIA GPUs, for heads it
        takes. Chosen here and not by `platform_dependent`: tracing the cuDNN call needs cuDNN present."""
        weight = self.model.vision.patch_embed.weight[...]
        v = self.cfg.vision
        return all(d.platform == "gpu" for d in weight.devices()) and fused_attention_fits(
            weight.dtype, v.hidden_size // v.num_heads)

    @staticmethod
    def compilations() -> int:
        """Programs compiled so far by the steps of every engine in this process. Engines of the same
        model structure and shapes share them, so this stays constant once a job has warmed up."""
        return _decode._cache_size() + _prefill_chunk._cache_size() + _encode_cells._cache_size()

    def decode(self, cache: Cache, last_tokens: jax.Array, active: jax.Array,
               sampling: SamplingArrays) -> tuple[Cache, Sampled]:
        """Feed each active slot its last token and sample the next; inactive slots are untouched."""
        return _decode(self._static, self.params, cache, *_step_inputs(last_tokens, active), sampling)

    def lower_decode(self, cache: Cache, last_tokens: jax.Array, active: jax.Array,
                     sampling: SamplingArrays) -> jax.stages.Lowered:
        """The decode step lowered for these arguments (to compile with other options, or inspect);
        its compiled form takes `(self.params, cache, last_tokens, active, sampling)`."""
        return _decode.lower(self._static, self.params, cache, *_step_inputs(last_tokens, active), sampling)

    def prefill(self, cache: Cache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                sampling: SamplingArrays, pad_slots: Sequence[int] = (),
                spliced: Sequence[Spliced | None] | None = None) -> tuple[Cache, Sampled]:
        """Fill `slots` with `prompts` from position 0, chunk by chunk, and sample each prompt's next token.

        `pad_slots` are extra distinct slots that ride along unchanged (to keep the row count, hence the
        compiled shape, within a few buckets); `sampling` has one row per slot and pad slot. `spliced`
        (one entry per prompt, or None) gives embeddings that replace the token embeddings at some of a
        prompt's positions (images at their placeholders); a chunk without any runs the text-only program.
        """
        rows = list(slots) + list(pad_slots)
        if len(set(rows)) != len(rows):
            raise ValueError(f"prefill slots must be distinct, got {rows}")
        n = len(rows)
        spliced = _check_spliced(spliced, prompts, self.cfg.hidden_size)
        lengths = np.zeros(n, np.int64)
        lengths[:len(prompts)] = [len(p) for p in prompts]
        current = np.asarray(cache.lengths)[rows]
        c = self.chunk_size
        n_chunks = max(1, -(-int(lengths.max()) // c))
        padded = np.zeros((n, n_chunks * c), np.int32)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        is_prompt = np.arange(n) < len(prompts)
        slot_ids = jnp.asarray(rows, jnp.int32)
        out = None
        for k in range(n_chunks):
            n_valid = np.clip(lengths - k * c, 0, c)
            start = np.where(is_prompt, np.minimum(k * c, lengths), current)
            ends_here = is_prompt & (lengths > k * c) & (lengths <= (k + 1) * c)
            cache, sampled = _prefill_chunk(
                self._static, self.params, cache, jnp.asarray(padded[:, k * c:(k + 1) * c]), slot_ids,
                jnp.asarray(start, jnp.int32), jnp.asarray(n_valid, jnp.int32), sampling,
                _chunk_spliced(spliced, n, k * c, c))
            out = sampled if out is None else jax.tree.map(
                lambda new, old: jnp.where(_expand(jnp.asarray(ends_here), new), new, old), sampled, out)
        return cache, out


@dataclasses.dataclass(frozen=True)
class Spliced:
    """Embeddings `[P, hidden]` that replace a prompt's token embeddings at `positions` `[P]`."""

    positions: np.ndarray
    embeds: np.ndarray


def _check_spliced(spliced, prompts, hidden: int) -> list[Spliced | None] | None:
    if spliced is None or all(s is None for s in spliced):
        return None
    if len(spliced) != len(prompts):
        raise ValueError(f"spliced has {len(spliced)} entries for {len(prompts)} prompts")
    for i, (s, p) in enumerate(zip(spliced, prompts)):
        if s is None:
            continue
        pos = np.asarray(s.positions)
        if pos.ndim != 1 or s.embeds.shape != (len(pos), hidden):
            raise ValueError(f"prompt {i}: spliced embeddings {s.embeds.shape} must be [{len(pos)}, {hidden}] "
                             f"for its {len(pos)} positions")
        if len(pos) and (pos.min() < 0 or pos.max() >= len(p) or len(np.unique(pos)) != len(pos)):
            raise ValueError(f"prompt {i}: spliced positions must be distinct and within its {len(p)} tokens")
    return list(spliced)


def _chunk_spliced(spliced, n: int, first: int, c: int):
    """(embeds `[n, c, hidden]`, mask `[n, c]`) for the chunk at `first`, or None if nothing lands in it."""
    if spliced is None:
        return None
    hits = []
    for i, s in enumerate(spliced):
        if s is not None:
            pos = np.asarray(s.positions)
            at = (pos >= first) & (pos < first + c)
            if at.any():
                hits.append((i, pos[at] - first, s.embeds[at]))
    if not hits:
        return None
    embeds = np.zeros((n, c, hits[0][2].shape[-1]), np.float32)
    mask = np.zeros((n, c), bool)
    for i, cols, rows in hits:
        embeds[i, cols], mask[i, cols] = rows, True
    return jnp.asarray(embeds), jnp.asarray(mask)


def _step_inputs(last_tokens, active) -> tuple[jax.Array, jax.Array]:
    """The decode step's tokens and active mask, replicated over the context mesh if there is one. The
    scheduler passes the host's tokens to the first step after a prefill and the step in flight's
    (replicated, on the mesh) to the others: under a mesh their shardings differed, and the step
    compiled twice, the second time inside the decode loop."""
    last_tokens, active = jnp.asarray(last_tokens, jnp.int32), jnp.asarray(active, bool)
    mesh = jax.sharding.get_mesh()
    if not mesh.axis_names:
        return last_tokens, active
    return jax.device_put((last_tokens, active), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _cache_specs(cache: Cache):
    """Partition specs of the cache on the context mesh: slots split by the rules (axis 1 of the group
    arrays, under the stacked-layer axis); the lengths replicated, since the host reads them."""
    axes = slot_axes(jax.sharding.get_abstract_mesh(), cache.lengths.shape[0])
    slots = axes[0] if len(axes) == 1 else (axes or None)
    return Cache(lengths=jax.sharding.PartitionSpec(),
                 groups=jax.tree.map(lambda x: jax.sharding.PartitionSpec(None, slots), cache.groups))


def _constrain(cache: Cache) -> Cache:
    """The cache a step returns, laid out as it came in (so donation reuses the buffers and the next
    step sees the same shardings); the lengths replicated for the host. A no-op without a mesh."""
    if not jax.sharding.get_abstract_mesh().axis_names:
        return cache
    return jax.lax.with_sharding_constraint(cache, _cache_specs(cache))


def _for_host(tree):
    """What the host reads back (sampled tokens, cache lengths), replicated over the context mesh, so that
    every process of a multi-host run holds it whole. A no-op without a mesh."""
    if not jax.sharding.get_abstract_mesh().axis_names:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()), tree)


def _expand(mask_b, like):
    return mask_b.reshape(mask_b.shape + (1,) * (like.ndim - 1))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode(graphdef, params, cache: Cache, last_tokens_b, active_b, sampling):
    model = nnx.merge(_graph(graphdef), params)
    start_b = cache.lengths
    hidden_b1h, cache = model.extend(last_tokens_b[:, None], cache, start_b, active_b.astype(jnp.int32))
    logits_bv = model.logits(hidden_b1h)[:, 0]
    return _constrain(cache), _for_host(sample(logits_bv, sampling, start_b + 1))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _prefill_chunk(graphdef, params, cache: Cache, tokens_nc, slots_n, start_n, n_valid_n, sampling, spliced=None):
    model = nnx.merge(_graph(graphdef), params)
    part = take_slots(cache, slots_n)
    hidden_nch, part = model.extend(tokens_nc, part, start_n, n_valid_n, spliced)
    last = jnp.clip(n_valid_n - 1, 0, tokens_nc.shape[1] - 1)
    hidden_nh = jnp.take_along_axis(hidden_nch, last[:, None, None], axis=1)
    logits_nv = model.logits(hidden_nh)[:, 0]
    cache = put_slots(cache, part, slots_n)
    return _constrain(cache), _for_host(sample(logits_nv, sampling, start_n + n_valid_n))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _encode_cells(graphdef, fused, params, patches_nk, row_n, col_n, valid_n):
    encoder = nnx.merge(_graph(graphdef), params).vision
    return (encoder.cells(patches_nk, row_n, col_n, valid_n, fused=fused), *encoder.frame())
