"""DeepSeek-V4.1's image encoder as released (deepseek_v41_spec.md §6): a ViT over 14-pixel patches and
the aligner that merges each 3 × 3 cell of patch features into one decoder embedding.

- ViT: a linear patch embedding with bias; pre-norm blocks of RMSNorm (eps 1e-6), bidirectional
  multi-head attention over the image's patches (fused qkv with bias, 2-D rotary positions in the
  half-split form: channels 0…D/4−1 pair with D/2…3D/4−1 and turn with the patch's row, the next
  quarter with its column) and a SwiGLU MLP without bias (gate rows then up rows in one matrix); a
  final RMSNorm.
- Aligner: the feature grid padded with zeros to whole cells; each cell's 9 feature vectors
  concatenated channel-major (feature index = channel·9 + 3·dy + dx, as `F.unfold` lays them out);
  Linear → exact GELU → Linear.

Module and variable names are the release's tensor names (`vision.blocks.3.attn.wqkv.weight`,
`aligner.w1.bias`). Images come as a batch of one padded patch count, cell by cell
(`dsjax.engine.pixels.patchify`): padding patches are masked out of attention and contribute zeros to
their cell, which is what the release's padding of the feature grid gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config_v41 import V41VisionConfig
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.layers.patch_attention import QUERY_BLOCK, attend, attend_fused, fused_attention_fits, valid_first
from dsjax.layers.rope import apply_rope_half_split, rope_2d

NORM_EPS = 1e-6  # the release's ViT RMSNorm epsilon (not in its config)


class PatchEmbed(nnx.Module):
    """Flattened `(channel, y, x)` patch pixels → the ViT's width."""

    def __init__(self, v: V41VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.proj = Linear(3 * v.patch_size ** 2, v.hidden_size, rngs=rngs, dtype=dtype, bias=True)

    def __call__(self, patches_bnk: jax.Array) -> jax.Array:
        return self.proj(patches_bnk)


class ViTAttention(nnx.Module):
    """Multi-head bidirectional attention over an image's valid patches, 2-D rotary queries and keys."""

    def __init__(self, v: V41VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, self.heads = v.hidden_size, v.num_attention_heads
        self.wqkv = Linear(d, 3 * d, rngs=rngs, dtype=dtype, bias=True)
        self.wo = Linear(d, d, rngs=rngs, dtype=dtype, bias=True)

    def __call__(self, x_bnd: jax.Array, cos_bnr: jax.Array, sin_bnr: jax.Array, valid_bn: jax.Array,
                 query_block: int, n_valid_b: jax.Array | None) -> jax.Array:
        b, n, d = x_bnd.shape
        q_bnhk, k_bnhk, v_bnhk = jnp.split(self.wqkv(x_bnd).reshape(b, n, 3 * self.heads, -1), 3, axis=2)
        cos, sin = cos_bnr[:, :, None], sin_bnr[:, :, None]
        q_bnhk, k_bnhk = apply_rope_half_split(q_bnhk, cos, sin), apply_rope_half_split(k_bnhk, cos, sin)
        if n_valid_b is None:
            out_bnhk = attend(q_bnhk, k_bnhk, v_bnhk, valid_bn, query_block)
        else:
            out_bnhk = attend_fused(q_bnhk, k_bnhk, v_bnhk, n_valid_b)
        return self.wo(out_bnhk.reshape(b, n, d))


class ViTMLP(nnx.Module):
    """SwiGLU without bias: `w2(silu(gate) · up)`, gate and up the two halves of `w1`'s rows."""

    def __init__(self, v: V41VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.w1 = Linear(v.hidden_size, 2 * v.intermediate_size, rngs=rngs, dtype=dtype)
        self.w2 = Linear(v.intermediate_size, v.hidden_size, rngs=rngs, dtype=dtype)

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        gate_bni, up_bni = jnp.split(self.w1(x_bnd), 2, axis=-1)
        return self.w2(jax.nn.silu(gate_bni) * up_bni)


class ViTBlock(nnx.Module):
    def __init__(self, v: V41VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.norm1 = RMSNorm(v.hidden_size, NORM_EPS)
        self.attn = ViTAttention(v, rngs=rngs, dtype=dtype)
        self.norm2 = RMSNorm(v.hidden_size, NORM_EPS)
        self.mlp = ViTMLP(v, rngs=rngs, dtype=dtype)

    def __call__(self, x_bnd, cos_bnr, sin_bnr, valid_bn, query_block, n_valid_b):
        x_bnd = x_bnd + self.attn(self.norm1(x_bnd), cos_bnr, sin_bnr, valid_bn, query_block, n_valid_b)
        return x_bnd + self.mlp(self.norm2(x_bnd))


class ViT(nnx.Module):
    """The release's `vision.*`: normalised patches → patch features (after the final norm)."""

    def __init__(self, v: V41VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = v
        self.patch_embed = PatchEmbed(v, rngs=rngs, dtype=dtype)
        self.blocks = nnx.List([ViTBlock(v, rngs=rngs, dtype=dtype) for _ in range(v.num_hidden_layers)])
        self.norm = RMSNorm(v.hidden_size, NORM_EPS)

    @property
    def patch_weight(self) -> jax.Array:
        """The patch embedding's weight: its dtype is the encoder's compute dtype, its devices the encoder's."""
        return self.patch_embed.proj.weight[...]

    def __call__(self, patches_bnk: jax.Array, row_bn: jax.Array, col_bn: jax.Array, valid_bn: jax.Array,
                 query_block: int = QUERY_BLOCK, fused: bool = False) -> jax.Array:
        """Features `[B, N, width]` of patches in any order (each carries its grid position); padding
        patches' features are zero. `fused`: cuDNN's fused attention (NVIDIA GPUs; `fused_attention_fits`),
        the valid patches moved first for it and back after."""
        v = self.config
        dtype = self.patch_weight.dtype
        head_dim = v.hidden_size // v.num_attention_heads
        n_valid_b = None
        if fused:
            if not fused_attention_fits(dtype, head_dim):
                raise ValueError(f"cuDNN's fused attention does not take {jnp.dtype(dtype).name} heads of "
                                 f"{head_dim} channels")
            order_bn = valid_first(valid_bn)
            patches_bnk, row_bn, col_bn, valid_bn = (jnp.take_along_axis(a, order_bn.reshape(
                *order_bn.shape, *(1,) * (a.ndim - 2)), axis=1) for a in (patches_bnk, row_bn, col_bn, valid_bn))
            n_valid_b = jnp.sum(valid_bn, axis=1, dtype=jnp.int32)
        x_bnd = self.patch_embed(patches_bnk.astype(dtype))
        cos_bnr, sin_bnr = rope_2d(row_bn, col_bn, head_dim, v.rope_theta)
        for block in self.blocks:
            x_bnd = block(x_bnd, cos_bnr, sin_bnr, valid_bn, query_block, n_valid_b)
        x_bnd = jnp.where(valid_bn[..., None], self.norm(x_bnd), 0)
        if fused:
            back_bn = jnp.argsort(order_bn, axis=1)
            x_bnd = jnp.take_along_axis(x_bnd, back_bn[..., None], axis=1)
        return x_bnd


class Aligner(nnx.Module):
    """The release's `aligner.*`: each cell's m² patch features, concatenated channel-major → Linear →
    exact GELU → Linear, in the decoder's width."""

    def __init__(self, v: V41VisionConfig, out: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.m = v.downsample_ratio
        self.w1 = Linear(self.m ** 2 * v.hidden_size, out, rngs=rngs, dtype=dtype, bias=True)
        self.w2 = Linear(out, out, rngs=rngs, dtype=dtype, bias=True)

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        """Features of patches cell by cell (`patchify`'s order, the m² patches of a cell row-major) →
        one embedding per cell `[B, N / m², out]`."""
        b, n, d = x_bnd.shape
        cell_bcd9 = jnp.swapaxes(x_bnd.reshape(b, n // self.m ** 2, self.m ** 2, d), 2, 3)
        return self.w2(jax.nn.gelu(self.w1(cell_bcd9.reshape(b, n // self.m ** 2, -1)), approximate=False))
