"""The DeepSeek-V4.1 causal LM: embed → N streams → 40 single-pass mHC blocks (CSA2 sharing state from
layer to layer, Engram before its layers) → collapse with the last `pre` → norm → fp32 head.

Layers 0 … `first_decoder_layer − 1` form the causal encoder, the rest the decoder, which reads the
global cache the first decoder layer writes; the full forward here runs every layer on every token, as
the release's reference does. Engram's table rows are hashed from the token ids on the device
(`layers/ngram_hash.py`), from the tokenizer's compressed token map (`dsjax.engram_hash`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import Cache, buffer_at, restore_rows
from dsjax.config_v41 import V41Config
from dsjax.engram_hash import EngramHasher
from dsjax.layers.csa2 import Shared
from dsjax.layers.dspark import DSparkStage, target_features
from dsjax.layers.embedding import Embedding
from dsjax.layers.linear import Linear
from dsjax.layers.mhc import collapse
from dsjax.layers.ngram_hash import NgramHash, default_token_map
from dsjax.layers.norms import RMSNorm
from dsjax.layers.patch_attention import QUERY_BLOCK
from dsjax.layers.single_pass_block import SinglePassBlock
from dsjax.layers.vision_v41 import Aligner, ViT
from dsjax.model import zero_past
from dsjax.numerics import precision


class DeepseekV41(nnx.Module):
    """`model(input_ids [B,T], image_mask=None, lengths=None)` → float32 logits `[B,T,vocab]`."""

    def __init__(self, cfg: V41Config, *, rngs: nnx.Rngs, dtype=jnp.float32, token_map: np.ndarray | None = None):
        """`token_map`: the tokenizer's compressed ids for Engram (`dsjax.engram_hash.tokenizer_token_map`);
        None takes `ngram_hash.default_token_map` (a model of random weights has no tokenizer)."""
        self.cfg = cfg
        self.dtype = dtype
        self.kept_weights = None  # set by the loader: release tensors dsjax does not use (`names_v41.KEPT_PREFIXES`)
        if token_map is None:
            token_map = default_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
        self.ngram_hash = nnx.data(NgramHash(EngramHasher.from_config(cfg, token_map)) if cfg.engram_layer_ids
                                   else None)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([SinglePassBlock(cfg, role, rngs=rngs, dtype=dtype) for role in cfg.layer_roles()])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype)
        # The DSpark drafter's stages, under the release's names (`mtp.S.*`).
        n = cfg.num_nextn_predict_layers
        self.mtp = nnx.data(nnx.List([DSparkStage(cfg, s == 0, s == n - 1, rngs=rngs, dtype=dtype) for s in range(n)])
                            if n else None)
        # The image encoder, under the release's names (vision.*, aligner.*, image_start/newline/end).
        v = cfg.vision
        self.vision = nnx.data(ViT(v, rngs=rngs, dtype=dtype) if v else None)
        self.aligner = nnx.data(Aligner(v, cfg.hidden_size, rngs=rngs, dtype=dtype) if v else None)
        for name in ("image_start", "image_newline", "image_end"):
            setattr(self, name, nnx.data(nnx.Param((cfg.initializer_range * jax.random.normal(
                rngs.params(), (cfg.hidden_size,))).astype(dtype)) if v else None))

    def image_cells(self, patches_bnk: jax.Array, row_bn: jax.Array, col_bn: jax.Array, valid_bn: jax.Array,
                    query_block: int = QUERY_BLOCK, fused: bool = False) -> jax.Array:
        """A batch of images' patches, cell by cell (`engine.pixels.patchify`, padded to one length) → one
        decoder embedding per cell `[B, N / m², hidden]`: the ViT, then the aligner."""
        if self.vision is None:
            raise ValueError("this model has no image encoder (its config has no vision_config)")
        return self.aligner(self.vision(patches_bnk, row_bn, col_bn, valid_bn, query_block, fused))

    def image_frame(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The learned (image start, row end, image end) embeddings `[hidden]` each."""
        return self.image_start[...], self.image_newline[...], self.image_end[...]

    def hidden_states(self, input_ids: jax.Array, image_mask: jax.Array | None = None,
                      engram_rows: jax.Array | None = None, embeds: jax.Array | None = None,
                      record: bool = False):
        """Final normed hidden states `[B,T,H]` (positions 0 … T−1); with `record`, also one dict per layer
        (`streams`, `picks`, `index_scores`, `candidates`, `expert_ids`, `pre`). `engram_rows`
        `[B,T,n_engram_layers,heads]` (None: hashed here from the ids, image tokens dead); `embeds` replaces the
        token embeddings (image spans spliced in)."""
        cfg = self.cfg
        b, t = input_ids.shape
        positions_bs = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        image_bs = jnp.zeros((b, t), bool) if image_mask is None else jnp.asarray(image_mask, bool)
        if cfg.engram_layer_ids and engram_rows is None:
            start = jnp.full((b, self.ngram_hash.history_len), -1, jnp.int32)
            engram_rows = self.ngram_hash(input_ids, start, ~image_bs)
        x = self.embed_tokens(input_ids) if embeds is None else embeds.astype(self.dtype)
        h_bsnh = jnp.broadcast_to(x[:, :, None, :], (b, t, cfg.hc_mult, x.shape[-1]))
        pre_bsn = jnp.zeros((b, t, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        shared, per_layer = Shared(), []
        for layer in self.layers:
            rec = {"pre": pre_bsn} if record else None
            rows = None if layer.role.engram is None else engram_rows[:, :, layer.role.engram]
            h_bsnh, pre_bsn, shared = layer(h_bsnh, pre_bsn, positions_bs, image_bs, rows, shared, rec)
            per_layer.append(rec)
        hidden = self.norm(collapse(pre_bsn, h_bsnh))
        return (hidden, per_layer) if record else hidden

    def extend(self, tokens_bc: jax.Array, cache: Cache, start_b: jax.Array, n_valid_b: jax.Array,
               spliced: tuple[jax.Array, jax.Array] | None = None, decoder: bool = True,
               floor_b: jax.Array | None = None, record: dict | None = None, rewindable: bool = True):
        """Run C new tokens per slot through the cache (`dsjax.cache.init_cache`): row b's tokens sit at
        positions start[b] …, the first n_valid[b] real (0 leaves the slot untouched). Returns the final
        hidden states `[B,C,H]` and the cache with those tokens added. `spliced` = (embeds, mask) replaces
        the embeddings where the mask is set and marks those tokens as image tokens (router bias, Engram).

        The causal encoder-decoder's prefill shortcut: `decoder=False` runs the encoder and only the global
        cache's write of the first decoder layer (hidden states None). A decoder layer's output at position
        p reads the layer below within its window only, so a prompt of length L whose chunks before
        `L − decoder_keep(cfg)` run so and whose later chunks run whole ends with exactly the caches, and
        the last position exactly the logits, of running every layer on every token. `floor_b` hides the
        decoder windows' positions below it (DeepInfer's approximate bounded replay). `record`, if given (a dict),
        receives what `rewind` needs to take back the chunk's later tokens (speculative decoding's rejected ones)
        and, for a model with DSpark stages, the chunk's target `features` `[B,C,len(target layers)·H]`; with
        `rewindable` False it receives the features only (a prefill chunk, which may be longer than the window)."""
        cfg = self.cfg
        b, c = tokens_bc.shape
        x = self.embed_tokens(tokens_bc)
        image_bc = jnp.zeros((b, c), bool)
        if spliced is not None:
            embeds, image_bc = spliced
            x = jnp.where(image_bc[..., None], embeds.astype(x.dtype), x)
        rows, history = None, cache.history
        if history is not None:  # a row starting a sequence has no earlier tokens, whatever its slot held before
            history = jnp.where(((start_b == 0) & (n_valid_b > 0))[:, None], -1, history)
        if record is not None and rewindable:
            record.update(history=history, image=image_bc, layers=[])
        targets = self.cfg.dspark_target_layer_ids if self.mtp is not None else ()
        streams = []
        if self.ngram_hash is not None:
            rows = self.ngram_hash(tokens_bc, history, ~image_bc)
            history = self.ngram_hash.next_history(tokens_bc, history, ~image_bc, n_valid_b)
        h = jnp.broadcast_to(x[:, :, None, :], (b, c, cfg.hc_mult, x.shape[-1]))
        pre = jnp.zeros((b, c, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        shared, groups = Shared(), []
        first_dec = cfg.first_decoder_layer
        if not decoder and any(i >= first_dec for i in cfg.engram_layer_ids):
            raise ValueError(f"an encoder-only prefill chunk needs every Engram layer ({list(cfg.engram_layer_ids)}) "
                             f"in the encoder (layers below {first_dec})")
        for i, (layer, (stacked,)) in enumerate(zip(self.layers, cache.groups)):
            one = jax.tree.map(lambda a: a[0], stacked)
            if not decoder and i >= first_dec:
                if i == first_dec and layer.role.mode == "full":
                    one = layer.write_source(h, pre, start_b, n_valid_b, one)
                groups.append((jax.tree.map(lambda a: a[None], one),))
                if record is not None and rewindable:
                    record["layers"].append({})  # an encoder-only chunk is never taken back
                continue
            layer_rows = None if layer.role.engram is None else rows[:, :, layer.role.engram]
            undo = {} if record is not None and rewindable else None
            h, pre, shared, one = layer.extend(h, pre, start_b, n_valid_b, image_bc, layer_rows, shared, one,
                                               floor_b if i >= first_dec else None, undo,
                                               streams if record is not None and i in targets else None)
            if undo is not None:
                record["layers"].append(undo)
            groups.append((jax.tree.map(lambda a: a[None], one),))
        hidden = self.norm(collapse(pre, h)) if decoder else None
        if record is not None and streams:
            record["features"] = target_features(streams)
        return hidden, Cache(lengths=start_b + n_valid_b, groups=tuple(groups), history=history)

    def rewind(self, cache: Cache, record: dict, tokens_bc: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
               n_kept_b: jax.Array) -> Cache:
        """The cache `extend` left after a chunk of n_valid tokens at positions start … (with `record` given),
        turned into the one a chunk of its first n_kept tokens leaves: the window rings get back the rows the
        rest overwrote, the ratio-2 buffers hold the partial pair at the new end, Engram's history is that of the
        kept tokens, and the lengths end there. Compressed entries and index keys past the new end stay written:
        no query reads an entry its slot's length does not hold (`cache.num_entries`), and they are written again
        before one does."""
        end_b = start_b + n_kept_b
        cut = (n_kept_b < n_valid_b)[:, None, None]
        groups = []
        for (stacked,), rec in zip(cache.groups, record["layers"]):
            one = jax.tree.map(lambda a: a[0], stacked)
            if "ring" in rec:
                one = dataclasses.replace(one, window=restore_rows(one.window, rec["ring"], start_b, n_valid_b,
                                                                   n_kept_b))
            if "windows" in rec:
                state = one.compressor
                back = buffer_at(state, rec["windows"], end_b)
                one = dataclasses.replace(one, compressor=dataclasses.replace(
                    state, buffer_kv=jnp.where(cut, back.buffer_kv, state.buffer_kv),
                    buffer_gate=jnp.where(cut, back.buffer_gate, state.buffer_gate)))
            groups.append((jax.tree.map(lambda a: a[None], one),))
        history = cache.history
        if self.ngram_hash is not None:
            history = self.ngram_hash.next_history(tokens_bc, record["history"], ~record["image"], n_kept_b)
        return Cache(lengths=end_b, groups=tuple(groups), history=history)

    def dspark_features(self, input_ids: jax.Array, image_mask: jax.Array | None = None) -> jax.Array:
        """DSpark's target features `[B,T,len(dspark_target_layer_ids)·H]` of whole sequences: the streams each
        target layer's attention mixes read (after its Engram update), averaged over the streams, concatenated."""
        _, per_layer = self.hidden_states(input_ids, image_mask, record=True)
        return target_features([per_layer[i]["attn_streams"] for i in self.cfg.dspark_target_layer_ids])

    def logits(self, hidden_bsh: jax.Array) -> jax.Array:
        """fp32 logits, never rounded to bf16: in the head's dtype with fp32 accumulation, as DeepInfer computes
        them (bf16 × bf16 → fp32; an fp32 model's are fp32 throughout, as the reference's). Promoting a bf16
        head to fp32 instead cost 2.4-3.4 ms of a 19-34 ms decode step on an H200 (`docs/benchmarks.md`)."""
        w = self.lm_head.dense_weight(self.dtype)
        return jnp.einsum("bsh,vh->bsv", hidden_bsh.astype(w.dtype), w, preferred_element_type=jnp.float32,
                          precision=precision(w))

    def forward(self, input_ids, image_mask=None, engram_rows=None, lengths=None, embeds=None,
                record: bool = False):
        """The traceable forward behind `__call__`; logits at positions ≥ `lengths` are zero."""
        out = self.hidden_states(input_ids, image_mask, engram_rows, embeds, record)
        hidden, per_layer = out if record else (out, None)
        logits = zero_past(self.logits(hidden), lengths)
        return (logits, per_layer) if record else logits

    def __call__(self, input_ids, image_mask=None, lengths=None) -> jax.Array:
        graphdef, state = nnx.split(self)
        return _jitted_forward(graphdef, state, jnp.asarray(input_ids), image_mask, None, lengths)


def decoder_keep(cfg: V41Config) -> int:
    """Prompt positions the decoder layers must run on for exact prefill: its layer count × (window − 1) + 1."""
    return (cfg.num_hidden_layers - cfg.first_decoder_layer) * (cfg.sliding_window - 1) + 1


# DeepInfer's approximate bounded replay keeps the window plus a margin for speculative backtracking: its
# recommended `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS` for V4.1 is 140 = 128 + 12.
REPLAY_MARGIN = 12


def replay_keep(cfg: V41Config) -> int:
    """Prompt positions the decoder runs on under bounded replay (140 for the release's 128-token window)."""
    return cfg.sliding_window + REPLAY_MARGIN


def with_cache_rounding(model: nnx.Module, on: bool) -> nnx.Module:
    """`model` with the release's cache rounding (window in MXFP8, entries in NVFP4, index queries and keys
    in MXFP4) applied in its full forward or not: a new module tree over the same weights. On is the
    release's model; off is the reference's tight-parity variant (and what a float cache holds)."""
    model = nnx.merge(*nnx.split(model))
    model.set_attributes(cache_rounding=bool(on), raise_if_not_found=False)
    return model


def abstract_state(cfg: V41Config, dtype=jnp.bfloat16, token_map: np.ndarray | None = None
                   ) -> tuple[nnx.GraphDef, list]:
    """(graphdef, flat state of ShapeDtypeStructs) of a `cfg` model, nothing allocated."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV41(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                                   token_map=token_map)))
    return graphdef, list(nnx.to_flat_state(state))


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, state, input_ids, image_mask, engram_rows, lengths):
    return nnx.merge(graphdef, state).forward(input_ids, image_mask, engram_rows, lengths)
