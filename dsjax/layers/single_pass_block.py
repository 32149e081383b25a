"""One DeepSeek-V4.1 block: optional Engram write, CSA2 attention and the image-aware MoE, on N residual
streams joined by single-pass mHC.

Each sublayer's post and comb weights come from its own input streams, but its input is collapsed with
the `pre` weights of the sublayer before it (the previous block's FFN site, or a one-hot on stream 0 at
the first block): so one read of the streams serves both the mixing and the collapse. The block returns
its FFN site's `pre` for the next one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import LayerCache
from dsjax.config import IMAGE_MOE
from dsjax.config_v41 import LayerRole, V41Config
from dsjax.layers.csa2 import CSA2Attention, Shared
from dsjax.layers.engram import Engram
from dsjax.layers.mhc import HyperConnection, collapse
from dsjax.layers.moe import MoE
from dsjax.layers.norms import RMSNorm
from dsjax.numerics import einsum


def post_update(post_bsn: jax.Array, comb_bsnn: jax.Array, out_bsh: jax.Array, h_bsnh: jax.Array) -> jax.Array:
    """`h_new[k] = post[k]·out + Σ_j comb[j,k]·h[j]` in fp32, stored in the streams' dtype."""
    expand = post_bsn[..., None] * out_bsh.astype(jnp.float32)[:, :, None, :]
    return (expand + einsum("bsjk,bsjh->bskh", comb_bsnn, h_bsnh.astype(jnp.float32))).astype(h_bsnh.dtype)


class SinglePassBlock(nnx.Module):
    def __init__(self, cfg: V41Config, role: LayerRole, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.role = role
        self.engram = (None if role.engram is None else
                       Engram(cfg, cfg.engram_num_embeddings[role.engram], rngs=rngs, dtype=dtype))
        self.attn_hc = HyperConnection(cfg, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = CSA2Attention(cfg, role, rngs=rngs, dtype=dtype)
        self.ffn_hc = HyperConnection(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, IMAGE_MOE, rngs=rngs, dtype=dtype)

    def __call__(self, h_bsnh: jax.Array, pre_bsn: jax.Array, positions_bs: jax.Array, image_bs: jax.Array,
                 engram_rows_bsk: jax.Array | None, shared: Shared, record: dict | None = None):
        """`(streams, pre for the next block, shared)`; `record` receives the block's intermediates."""
        if record is not None:
            record["streams"] = h_bsnh
        if self.engram is not None:
            h_bsnh = self.engram(h_bsnh, engram_rows_bsk, ~image_bs)
        if record is not None:
            record["attn_streams"] = h_bsnh  # what the attention mixes read: DSpark's target features
        pre_a, post_a, comb_a = self.attn_hc.mixes(h_bsnh)
        with jax.named_scope("attention"):
            a_bsh, shared = self.attn(self.attn_norm(collapse(pre_bsn, h_bsnh)), positions_bs, shared, record)
        h_bsnh = post_update(post_a, comb_a, a_bsh, h_bsnh)
        pre_f, post_f, comb_f = self.ffn_hc.mixes(h_bsnh)
        with jax.named_scope("moe"):
            f_bsh = self.ffn(self.ffn_norm(collapse(pre_a, h_bsnh)), image_bs, record)
        return post_update(post_f, comb_f, f_bsh, h_bsnh), pre_f, shared

    def extend(self, h_bcnh: jax.Array, pre_bcn: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
               image_bc: jax.Array, engram_rows_bck: jax.Array | None, shared: Shared, cache: LayerCache,
               floor_b: jax.Array | None = None, undo: dict | None = None, streams: list | None = None):
        """The cached form for a chunk of C tokens per row: `(streams, pre, shared, layer cache)`; `floor_b` and
        `undo` as in `CSA2Attention.extend`. `streams`, if given, receives the streams the attention's mixes read
        (after the Engram update): DSpark's target features where this is a target layer."""
        if self.engram is not None:
            h_bcnh = self.engram(h_bcnh, engram_rows_bck, ~image_bc)
        if streams is not None:
            streams.append(h_bcnh)
        pre_a, post_a, comb_a = self.attn_hc.mixes(h_bcnh)
        with jax.named_scope("attention"):
            a_bch, shared, cache = self.attn.extend(self.attn_norm(collapse(pre_bcn, h_bcnh)), start_b, n_valid_b,
                                                    shared, cache, floor_b, undo)
        h_bcnh = post_update(post_a, comb_a, a_bch, h_bcnh)
        pre_f, post_f, comb_f = self.ffn_hc.mixes(h_bcnh)
        with jax.named_scope("moe"):
            f_bch = self.ffn(self.ffn_norm(collapse(pre_a, h_bcnh)), image_bc)
        return post_update(post_f, comb_f, f_bch, h_bcnh), pre_f, shared, cache

    def write_source(self, h_bcnh: jax.Array, pre_bcn: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
                     cache: LayerCache) -> LayerCache:
        """Only this (Full, Engram-free) layer's compressed entries and index keys for the chunk: they depend on
        its input streams alone, which the encoder gives."""
        with jax.named_scope("attention"):
            return self.attn.write_source(self.attn_norm(collapse(pre_bcn, h_bcnh)), start_b, n_valid_b, cache)
