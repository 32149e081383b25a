"""The DeepSeek-V4 causal LM: embed → N-stream decoder layers (scanned) → hyper-head → norm → head.

Layers are grouped into runs of a repeating pattern of layer kinds (attention type, MLP type): the
V4-Flash schedule is 3 × [HCA/hash] then 20 × [CSA/moe, HCA/moe]. Each group's layers are stacked
and run with one `lax.scan`, so compile time depends on the number of distinct groups, not layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import Cache
from dsjax.config import ModelConfig
from dsjax.kernels.expert_matmul.fp4_codes import check_layout, repack_codes, unrepack_codes
from dsjax.layers.decoder_layer import DecoderLayer
from dsjax.layers.experts import EXPERT_LEAVES, RoutedExperts
from dsjax.layers.demo_vision import DemoVisionEncoder
from dsjax.layers.embedding import Embedding
from dsjax.layers.linear import Linear
from dsjax.layers.mhc import HyperHead
from dsjax.layers.norms import RMSNorm
from dsjax.layers.patch_attention import QUERY_BLOCK
from dsjax.numerics import einsum
from dsjax.run_config import KERNELS, check_choice
from dsjax.stacked import READ_IN_PLACE, StackedSlice

_MAX_PERIOD = 4


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers `start … start + len(pattern)·repeats − 1`, the kinds `pattern` repeated `repeats` times."""

    start: int
    pattern: tuple[tuple[str, str], ...]
    repeats: int

    def layer_index(self, repeat: int, position: int) -> int:
        return self.start + repeat * len(self.pattern) + position


def layer_groups(kinds: tuple[tuple[str, str], ...]) -> tuple[LayerGroup, ...]:
    """Greedily cover the schedule with the longest runs of a pattern (period ≤ 4) repeated at least twice;
    a layer that starts no such run forms a group of its own."""
    groups, i = [], 0
    while i < len(kinds):
        covered, best_period = 1, 1
        for period in range(1, _MAX_PERIOD + 1):
            pattern = kinds[i:i + period]
            reps = 1
            while kinds[i + reps * period:i + (reps + 1) * period] == pattern:
                reps += 1
            if reps >= 2 and reps * period > covered:
                covered, best_period = reps * period, period
        groups.append(LayerGroup(i, tuple(kinds[i:i + best_period]), covered // best_period))
        i += covered
    return tuple(groups)


def _stack(modules: list[nnx.Module]) -> nnx.Module:
    """One module whose every variable gains a leading axis over `modules` (all of one structure)."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.state(m) for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class StackedLayers(nnx.Module):
    """One layer group: `layers[p]` holds the `repeats` layers at pattern position p, stacked."""

    def __init__(self, cfg: ModelConfig, group: LayerGroup, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.group = group
        self.layers = nnx.List([
            _stack([DecoderLayer(cfg, attn, mlp, rngs=rngs, dtype=dtype) for _ in range(group.repeats)])
            for attn, mlp in group.pattern
        ])

    def _scanned(self):
        """`(layers_at, state)`: the scan slices `state` over the repeats, and `layers_at(i, state slice)`
        is the pattern's layers of repeat i. Weights marked `READ_IN_PLACE` are not in `state`: the
        layers get them as `StackedSlice`s of the whole stack (`dsjax.stacked`)."""
        graphdef, in_place, state = nnx.split(self.layers, _read_in_place, ...)

        def layers_at(index, layer_state):
            return nnx.merge(graphdef, layer_state, jax.tree.map(lambda w: StackedSlice(w, index), in_place))

        return layers_at, state

    def __call__(self, h_bsnh, positions_bs, token_ids_bs, record: bool = False):
        """The streams after the group, and (with `record`) one dict of intermediates per pattern
        position, each value stacked over the repeats."""
        layers_at, state = self._scanned()

        def body(carry, layer_state):
            h, index = carry
            records = []
            for layer in layers_at(index, layer_state):
                records.append({} if record else None)
                h = layer(h, positions_bs, token_ids_bs, records[-1])
            return (h, index + 1), records if record else None

        (h_bsnh, _), records = jax.lax.scan(body, (h_bsnh, jnp.int32(0)), state)
        return h_bsnh, records

    def extend(self, h_bcnh: jax.Array, token_ids_bc: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
               caches: tuple) -> tuple[jax.Array, tuple]:
        """Cached form: `caches[p]` is pattern position p's LayerCache stacked over the repeats; returns the
        streams and the new caches."""
        layers_at, state = self._scanned()

        def body(carry, xs):
            h, index = carry
            layer_state, layer_caches = xs
            new = []
            for layer, cache in zip(layers_at(index, layer_state), layer_caches):
                h, cache = layer.extend(h, token_ids_bc, start_b, n_valid_b, cache)
                new.append(cache)
            return (h, index + 1), tuple(new)

        (h_bcnh, _), caches = jax.lax.scan(body, (h_bcnh, jnp.int32(0)), (state, caches))
        return h_bcnh, caches


def _read_in_place(path, var) -> bool:
    del path
    return bool(isinstance(var, nnx.Variable) and var.get_metadata().get(READ_IN_PLACE, False))


class DeepseekV4(nnx.Module):
    """`model(input_ids [B,T], lengths=None)` → float32 logits `[B,T,vocab]` for whole sequences.

    `lengths [B]` marks right padding: each row's logits at positions < its length equal those of the
    row run alone; logits at padded positions are zero.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.groups_meta = layer_groups(cfg.layer_kinds)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.groups = nnx.List([StackedLayers(cfg, g, rngs=rngs, dtype=dtype) for g in self.groups_meta])
        self.hc_head = HyperHead(cfg, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype))
        # Made last, so that a text-only model's weights draw the same random numbers with or without it.
        self.vision = DemoVisionEncoder(cfg, rngs=rngs, dtype=dtype) if cfg.vision is not None else None

    def image_cells(self, patches_bnk: jax.Array, row_bn: jax.Array, col_bn: jax.Array, valid_bn: jax.Array,
                    query_block: int = QUERY_BLOCK, fused: bool = False) -> jax.Array:
        """A batch of images' patches (`engine.pixels.patchify`, padded to one length) → one decoder
        embedding per cell `[B, N / m², hidden]`; the demo encoder takes the images one after another."""
        if self.vision is None:
            raise ValueError("this model has no image encoder (its config has no vision_config)")
        return jnp.stack([self.vision.cells(*(a[i] for a in (patches_bnk, row_bn, col_bn, valid_bn)), query_block,
                                            fused) for i in range(patches_bnk.shape[0])])

    def image_frame(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The learned (image begin, row end, image end) embeddings `[hidden]` each."""
        return self.vision.frame()

    def layer(self, index: int) -> DecoderLayer:
        """Decoder layer `index` on its own (a view of its slice of the stacked weights)."""
        for group, meta in zip(self.groups, self.groups_meta):
            if meta.start <= index < meta.start + len(meta.pattern) * meta.repeats:
                repeat, position = divmod(index - meta.start, len(meta.pattern))
                graphdef, state = nnx.split(group.layers[position])
                return nnx.merge(graphdef, jax.tree.map(lambda x: x[repeat], state))
        raise IndexError(f"layer {index} out of range for {self.cfg.num_hidden_layers} layers")

    def embed(self, token_ids: jax.Array, spliced: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """Token embeddings `[..., H]`; `spliced` = (embeds `[..., H]`, mask `[...]`) replaces them where the
        mask is set (an image's embeddings at its placeholder tokens)."""
        x = self.embed_tokens(token_ids)
        if spliced is None:
            return x
        embeds, mask = spliced
        return jnp.where(mask[..., None], embeds.astype(x.dtype), x)

    def hidden_states(self, input_ids: jax.Array, record: bool = False,
                      spliced: tuple[jax.Array, jax.Array] | None = None):
        """Final normed hidden states `[B,T,H]` (positions 0…T−1 in every row); with `record`, also the
        per-layer intermediates (see `forward`); `spliced` as in `embed`."""
        b, t = input_ids.shape
        positions_bs = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = self.embed(input_ids, spliced)
        h_bsnh = jnp.broadcast_to(x[:, :, None, :], (b, t, self.cfg.hc_mult, x.shape[-1]))
        per_layer = []
        for group, meta in zip(self.groups, self.groups_meta):
            h_bsnh, records = group(h_bsnh, positions_bs, input_ids, record)
            if record:
                per_layer += [{k: v[r] for k, v in records[p].items()}
                              for r in range(meta.repeats) for p in range(len(meta.pattern))]
        hidden = self.norm(self.hc_head(h_bsnh))
        return (hidden, per_layer) if record else hidden

    def extend(self, tokens_bc: jax.Array, cache: Cache, start_b: jax.Array, n_valid_b: jax.Array,
               spliced: tuple[jax.Array, jax.Array] | None = None):
        """Run C new tokens per slot through the cache: row b's tokens sit at positions start[b]…, of
        which the first n_valid[b] are real (0 leaves the slot untouched). Returns the final hidden
        states `[B,C,H]` and the cache with those tokens added (`lengths = start + n_valid`).

        `spliced` = (embeds `[B,C,H]`, mask `[B,C]`) replaces the token embeddings where the mask is
        set (an image's embeddings at its placeholder tokens); the token ids still route hash-MoE layers."""
        b, c = tokens_bc.shape
        x = self.embed(tokens_bc, spliced)
        h = jnp.broadcast_to(x[:, :, None, :], (b, c, self.cfg.hc_mult, x.shape[-1]))
        groups = []
        for group, caches in zip(self.groups, cache.groups):
            h, caches = group.extend(h, tokens_bc, start_b, n_valid_b, caches)
            groups.append(caches)
        return self.norm(self.hc_head(h)), Cache(lengths=start_b + n_valid_b, groups=tuple(groups))

    def logits(self, hidden_bsh: jax.Array) -> jax.Array:
        if self.lm_head is None:
            w = self.embed_tokens.weight[...].astype(hidden_bsh.dtype)
            return einsum("bsh,vh->bsv", hidden_bsh, w).astype(jnp.float32)
        return self.lm_head(hidden_bsh).astype(jnp.float32)

    def __call__(self, input_ids: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        graphdef, state = nnx.split(self)
        return _jitted_forward(graphdef, state, input_ids, lengths)

    def forward(self, input_ids: jax.Array, lengths: jax.Array | None = None, record: bool = False,
                spliced: tuple[jax.Array, jax.Array] | None = None):
        """The traceable forward behind `__call__` (which jits it); use it inside your own transforms.

        With `record`, returns `(logits, per_layer)`: for each layer a dict of what it computed on the way,
        `attn_hc_comb`/`ffn_hc_comb [B,T,N,N]` (mHC mixing), `expert_ids [B,T,k]`, and for CSA layers
        `indexer_picks [B,T,entries]` and `indexer_kl`, for top-k MoE layers `moe_balance` (the training
        losses of `dsjax.training.loss`). `spliced` (embeds `[B,T,H]`, mask `[B,T]`) as in `embed`.
        """
        hidden = self.hidden_states(input_ids, record, spliced)
        hidden, per_layer = hidden if record else (hidden, None)
        logits = zero_past(self.logits(hidden), lengths)
        return (logits, per_layer) if record else logits


def zero_past(logits_bsv: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """`logits` with the positions at or past each row's length zeroed (right padding); as is without lengths."""
    if lengths is None:
        return logits_bsv
    valid_bs = jnp.arange(logits_bsv.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    return jnp.where(valid_bs[..., None], logits_bsv, 0.0)


def with_kernels(model: nnx.Module, kernels: str) -> nnx.Module:
    """`model` with its kernel-backed operations (attention, the indexer, the experts, mHC's Sinkhorn, FP8
    linears) run as `kernels` says (`dsjax.run_config.KERNELS`): a new module tree over the same weights
    (nothing is copied). How the operations run is a run option, part of the programs and not of the architecture,
    so it is set here and not in `ModelConfig`."""
    check_choice("kernels", kernels, KERNELS)
    model = nnx.merge(*nnx.split(model))
    model.set_attributes(kernels=kernels, raise_if_not_found=False)
    return model


def expert_code_layout(kernels: str, platform: str) -> str:
    """The FP4 expert codes' layout for a run whose kernels are `kernels` on `platform` (a JAX backend name):
    "repacked" where the GPU kernels read them ("auto" on GPUs, "interpret" anywhere), which decode it in
    fewer operations (the FP4 kernel 6-12% faster at 128 and 256 tokens on the H200, docs/benchmarks.md);
    else "checkpoint"."""
    check_choice("kernels", kernels, KERNELS)
    return "repacked" if kernels == "interpret" or (kernels == "auto" and platform == "gpu") else "checkpoint"


def _fp4_experts(model: nnx.Module) -> Iterator[tuple[tuple, RoutedExperts]]:
    for path, module in nnx.iter_graph(model):
        if isinstance(module, RoutedExperts) and module.storage == "fp4":
            yield tuple(path), module


def with_code_layout(model: nnx.Module, code_layout: str) -> nnx.Module:
    """`model` with its FP4 experts' codes in `code_layout` (`fp4_codes.CODE_LAYOUTS`): a new module tree
    over the same weights, but the codes it moves, which it takes from `model` (their buffers are donated
    to the move, so the experts are never held twice): use only the returned model. Other weights, and
    models without FP4 experts, stay as they are. `stored_variables` gives the checkpoint's layout back."""
    check_layout(code_layout, "with_code_layout")
    model = nnx.merge(*nnx.split(model))
    move = jax.jit(repack_codes if code_layout == "repacked" else unrepack_codes, donate_argnums=0)
    for _, experts in _fp4_experts(model):
        if experts.code_layout == code_layout:
            continue
        for name in EXPERT_LEAVES:
            var = getattr(experts, name)
            var.set_value(move(var.get_value()))
        experts.code_layout = code_layout
    return model


def stored_variables(model: nnx.Module) -> Iterator[tuple[tuple, np.ndarray]]:
    """(path, numpy array) for every variable of `model`, as a checkpoint stores it: FP4 expert codes
    in the checkpoint's layout whatever layout the model holds them in (`with_code_layout`)."""
    repacked = {path + (name,) for path, experts in _fp4_experts(model) if experts.code_layout != "checkpoint"
                for name in EXPERT_LEAVES}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        value = var.get_value()
        yield path, np.asarray(unrepack_codes(value) if tuple(path) in repacked else value)


def abstract_state(cfg: ModelConfig, dtype=jnp.bfloat16) -> tuple[nnx.GraphDef, list]:
    """(graphdef, flat state of ShapeDtypeStructs) of a `cfg` model, nothing allocated."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype)))
    return graphdef, list(nnx.to_flat_state(state))


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, state, input_ids, lengths):
    return nnx.merge(graphdef, state).forward(input_ids, lengths)
