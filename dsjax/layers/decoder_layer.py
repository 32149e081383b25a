"""One V4 decoder layer: mHC around attention, then mHC around the MoE, on N residual streams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import LayerCache
from dsjax.config import ModelConfig
from dsjax.layers.attention import Attention
from dsjax.layers.mhc import HyperConnection, mix_streams
from dsjax.layers.moe import MoE
from dsjax.layers.norms import RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, attention_type: str, mlp_type: str, *, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.attn_hc = HyperConnection(cfg, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, attention_type, rngs=rngs, dtype=dtype)
        self.ffn_hc = HyperConnection(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, mlp_type, rngs=rngs, dtype=dtype)

    def __call__(self, h_bsnh: jax.Array, positions_bs: jax.Array, token_ids_bs: jax.Array,
                 record: dict | None = None) -> jax.Array:
        """`record`, if given, receives this layer's intermediates (see `DeepseekV4.forward`)."""
        post, comb, collapsed = self.attn_hc(h_bsnh)
        a_bsh = self.self_attn(self.input_layernorm(collapsed), positions_bs, record)
        h_bsnh = mix_streams(post, comb, a_bsh, h_bsnh)
        if record is not None:
            record["attn_hc_comb"] = comb
        post, comb, collapsed = self.ffn_hc(h_bsnh)
        f_bsh = self.mlp(self.post_attention_layernorm(collapsed), token_ids_bs, record)
        if record is not None:
            record["ffn_hc_comb"] = comb
        return mix_streams(post, comb, f_bsh, h_bsnh)

    def extend(self, h_bcnh: jax.Array, token_ids_bc: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
               cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """The cached form for a chunk of C tokens per row; returns the new streams and layer cache."""
        post, comb, collapsed = self.attn_hc(h_bcnh)
        # Named scopes label the step's kernels for `dsjax bench`'s per-part split (profiler trace).
        with jax.named_scope("attention"):
            a_bch, cache = self.self_attn.extend(self.input_layernorm(collapsed), start_b, n_valid_b, cache)
        h_bcnh = mix_streams(post, comb, a_bch, h_bcnh)
        post, comb, collapsed = self.ffn_hc(h_bcnh)
        with jax.named_scope("moe"):
            f_bch = self.mlp(self.post_attention_layernorm(collapsed), token_ids_bc)
        return mix_streams(post, comb, f_bch, h_bcnh), cache
