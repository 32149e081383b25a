"""The image encoder of dsjax's embedded demo model (V4 family): dsjax's own design, made before V4.1's
encoder was public, and kept for the demo only (its weights are trained for it). DeepSeek-V4.1's released
encoder is `layers/vision_v41.py`. The contract is the same (`deepseek-recipe` resolves and preprocesses
images to W×H pixels, multiples of 14, and counts `rows·(cols + 1) + 2` input tokens per image, see
`config.VisionConfig`):

1. the image is cut into 14-pixel patches, grouped by 3×3 cells (the grid padded up to whole cells
   with masked patches), so that the 9 patches of one cell are neighbours in the sequence (on the host:
   `dsjax.engine.pixels.patchify`);
2. a ViT (pre-norm blocks, GELU MLPs, 2-D rotary positions on interleaved pairs: half of each head's
   channels turn with the patch's row, half with its column) runs over the valid patches of the image;
3. each cell's 9 patch vectors are concatenated patch-major and projected by a 2-layer MLP to the
   decoder's width;
4. a learned row-end embedding closes each row of cells, learned image-begin and image-end embeddings
   open and close the image.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig, VisionConfig
from dsjax.layers.image_span import layout
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.layers.patch_attention import QUERY_BLOCK, attend, attend_fused, fused_attention_fits, valid_first
from dsjax.layers.rope import apply_rope, rope_2d


class DemoVisionBlock(nnx.Module):
    """Pre-norm transformer block: bidirectional attention over the image's valid patches, GELU MLP."""

    def __init__(self, vision: VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, self.heads = vision.hidden_size, vision.num_heads
        self.attn_norm = RMSNorm(d, vision.norm_eps)
        self.qkv = Linear(d, 3 * d, rngs=rngs, dtype=dtype, bias=True)
        self.out = Linear(d, d, rngs=rngs, dtype=dtype, bias=True)
        self.mlp_norm = RMSNorm(d, vision.norm_eps)
        self.fc1 = Linear(d, vision.intermediate_size, rngs=rngs, dtype=dtype, bias=True)
        self.fc2 = Linear(vision.intermediate_size, d, rngs=rngs, dtype=dtype, bias=True)

    def __call__(self, x_nd: jax.Array, cos: jax.Array, sin: jax.Array, valid_n: jax.Array,
                 query_block: int = QUERY_BLOCK, n_valid: jax.Array | None = None) -> jax.Array:
        """`n_valid` (valid patches first): attention through cuDNN's fused kernel (`attend_fused`)."""
        n, d = x_nd.shape
        q_nhk, k_nhk, v_nhk = jnp.split(self.qkv(self.attn_norm(x_nd)).reshape(n, 3 * self.heads, -1), 3, axis=1)
        q_nhk, k_nhk = apply_rope(q_nhk, cos[:, None], sin[:, None]), apply_rope(k_nhk, cos[:, None], sin[:, None])
        if n_valid is None:
            attn_nhk = attend(q_nhk[None], k_nhk[None], v_nhk[None], valid_n[None], query_block)[0]
        else:
            attn_nhk = attend_fused(q_nhk[None], k_nhk[None], v_nhk[None], n_valid.reshape(1))[0]
        x_nd = x_nd + self.out(attn_nhk.reshape(n, d))
        return x_nd + self.fc2(jax.nn.gelu(self.fc1(self.mlp_norm(x_nd)), approximate=True))


class DemoVisionEncoder(nnx.Module):
    """Patches of one image → `rows·(cols + 1) + 2` embeddings of the decoder's width (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        v = cfg.vision
        if v is None:
            raise ValueError("the model config has no vision_config: it reads no images")
        self.vision = v
        d, out = v.hidden_size, cfg.hidden_size
        self.patch_embed = Linear(v.patch_size ** 2 * 3, d, rngs=rngs, dtype=dtype, bias=True)
        self.blocks = nnx.List([DemoVisionBlock(v, rngs=rngs, dtype=dtype) for _ in range(v.num_layers)])
        self.norm = RMSNorm(d, v.norm_eps)
        self.merge_in = Linear(v.merge_size ** 2 * d, out, rngs=rngs, dtype=dtype, bias=True)
        self.merge_out = Linear(out, out, rngs=rngs, dtype=dtype, bias=True)
        std = cfg.initializer_range
        self.row_end = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))
        self.image_begin = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))
        self.image_end = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))

    @property
    def patch_weight(self) -> jax.Array:
        """The patch embedding's weight: its dtype is the encoder's compute dtype, its devices the encoder's."""
        return self.patch_embed.weight[...]

    def cells(self, patches_nk: jax.Array, row_n: jax.Array, col_n: jax.Array, valid_n: jax.Array,
              query_block: int = QUERY_BLOCK, fused: bool = False) -> jax.Array:
        """`engine.pixels.patchify`'s arrays (N patches, cell by cell) → one embedding per cell
        `[N / m², hidden]`. Whole padding cells (all patches invalid) may follow the image's: they do not
        change its cells.
        `query_block`: queries per block of the attention (`attend`); `fused`: cuDNN's fused attention
        instead (NVIDIA GPUs; `fused_attention_fits`), the valid patches moved first for it."""
        v = self.vision
        if patches_nk.shape[0] % v.merge_size ** 2:
            raise ValueError(f"{patches_nk.shape[0]} patches do not make whole cells of {v.merge_size ** 2}")
        dtype = self.patch_weight.dtype
        if fused and not fused_attention_fits(dtype, v.hidden_size // v.num_heads):
            raise ValueError(f"cuDNN's fused attention does not take {jnp.dtype(dtype).name} heads of "
                             f"{v.hidden_size // v.num_heads} channels")
        n_valid = None
        if fused:  # every patch's position travels with it: the order is free
            order_n = valid_first(valid_n[None])[0]
            patches_nk, row_n, col_n, valid_n = (a[order_n] for a in (patches_nk, row_n, col_n, valid_n))
            n_valid = jnp.sum(valid_n, dtype=jnp.int32)
        x_nd = self.patch_embed(patches_nk.astype(dtype))
        cos, sin = rope_2d(row_n, col_n, v.hidden_size // v.num_heads, v.rope_theta)
        for block in self.blocks:
            x_nd = block(x_nd, cos, sin, valid_n, query_block, n_valid)
        if fused:
            x_nd, valid_n = (jnp.zeros_like(a).at[order_n].set(a) for a in (x_nd, valid_n))
        x_nd = jnp.where(valid_n[:, None], self.norm(x_nd), 0)  # padding patches add nothing to their cell
        cell_ce = x_nd.reshape(-1, v.merge_size ** 2 * x_nd.shape[-1])
        return self.merge_out(jax.nn.gelu(self.merge_in(cell_ce), approximate=True))

    def frame(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The learned (image-begin, row-end, image-end) embeddings `[hidden]` each."""
        return self.image_begin[...], self.row_end[...], self.image_end[...]

    def __call__(self, patches_nk: jax.Array, row_n: jax.Array, col_n: jax.Array, valid_n: jax.Array,
                 rows: int, cols: int) -> jax.Array:
        """`patchify`'s arrays for an image of `rows × cols` cells → `[rows·(cols + 1) + 2, hidden]`."""
        if patches_nk.shape[0] != rows * cols * self.vision.merge_size ** 2:
            raise ValueError(f"{patches_nk.shape[0]} patches for {rows}x{cols} cells of {self.vision.merge_size ** 2}")
        cell_ce = self.cells(patches_nk, row_n, col_n, valid_n)
        return layout(cell_ce, rows, cols, *(e.astype(cell_ce.dtype) for e in self.frame()), xp=jnp)
