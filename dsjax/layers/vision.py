"""The V4.1 image encoder: a preprocessed image in, exactly the recipe's number of decoder embeddings out.

No V4.1 vision weights or code are public, so the internals are dsjax's design; the contract is the
recipe's (`deepseek-recipe` resolves and preprocesses images to W×H pixels, multiples of 14, and counts
`rows·(cols + 1) + 2` input tokens per image, see `config.VisionConfig`):

1. the image is cut into 14-pixel patches, grouped by 3×3 cells (the grid padded up to whole cells
   with masked patches), so that the 9 patches of one cell are neighbours in the sequence (on the host:
   `dsjax.engine.pixels.patchify`);
2. a ViT (pre-norm blocks, 2-D rotary positions: half of each head's channels turn with the patch's
   row, half with its column) runs over the valid patches of the image;
3. each cell's 9 patch vectors are concatenated and projected by a 2-layer MLP to the decoder's width;
4. a learned row-end embedding closes each row of cells, learned image-begin and image-end embeddings
   open and close the image.

Shapes depend on the image's size, so one compiled program serves one size (the engine pads images to
a few sizes: `dsjax.engine.encoder`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.config import ModelConfig, VisionConfig
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.numerics import einsum
from dsjax.layers.rope import apply_rope

# Queries per block of the encoder's attention: a block's fp32 scores are heads·QUERY_BLOCK·N, not
# heads·N² (4.9 GB per layer for the 8,712 patches of a 1848×924 image at 16 heads, 0.57 GB in blocks
# of 1024), so encoding an image fits beside a decoder that fills the device.
QUERY_BLOCK = 1024


def rope_2d(row_n: jax.Array, col_n: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[N, head_dim/2]`: the first half of the rotated pairs turn with the row, the second
    half with the column, each at the frequencies of a 1-D rotary table of `head_dim/2` channels."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (np.arange(quarter, dtype=np.float32) / quarter))
    angles = jnp.concatenate([row_n.astype(jnp.float32)[:, None] * inv, col_n.astype(jnp.float32)[:, None] * inv],
                             axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


class VisionBlock(nnx.Module):
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
            attn_nhk = attend(q_nhk, k_nhk, v_nhk, valid_n, query_block)
        else:
            attn_nhk = attend_fused(q_nhk, k_nhk, v_nhk, n_valid)
        x_nd = x_nd + self.out(attn_nhk.reshape(n, d))
        return x_nd + self.fc2(jax.nn.gelu(self.fc1(self.mlp_norm(x_nd)), approximate=True))


def _attend_dense(q_qhk: jax.Array, k_nhk: jax.Array, v_nhk: jax.Array, valid_n: jax.Array) -> jax.Array:
    scores_hqn = einsum("qhk,nhk->hqn", q_qhk, k_nhk).astype(jnp.float32) * (q_qhk.shape[-1] ** -0.5)
    scores_hqn = jnp.where(valid_n[None, None, :], scores_hqn, -jnp.inf)
    probs_hqn = jax.nn.softmax(scores_hqn, axis=-1).astype(v_nhk.dtype)
    return einsum("hqn,nhk->qhk", probs_hqn, v_nhk)


def attend(q_nhk: jax.Array, k_nhk: jax.Array, v_nhk: jax.Array, valid_n: jax.Array,
           query_block: int = QUERY_BLOCK) -> jax.Array:
    """Bidirectional attention of every patch over the valid ones `[N, heads, head_dim]`, softmax in fp32.
    Past `query_block` patches the queries go in blocks of that many (the last one padded), one after
    another, each over every key: the same sums per query, a block's scores at a time."""
    n = q_nhk.shape[0]
    if n <= query_block:
        return _attend_dense(q_nhk, k_nhk, v_nhk, valid_n)
    blocks = -(-n // query_block)
    q_bqhk = jnp.pad(q_nhk, ((0, blocks * query_block - n), (0, 0), (0, 0))).reshape(
        blocks, query_block, *q_nhk.shape[1:])
    out_bqhk = jax.lax.map(lambda q_qhk: _attend_dense(q_qhk, k_nhk, v_nhk, valid_n), q_bqhk)
    return out_bqhk.reshape(blocks * query_block, *q_nhk.shape[1:])[:n]


def fused_attention_fits(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes these heads: half-precision operands, at most 128 channels,
    a multiple of 8."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim <= 128 \
        and head_dim % 8 == 0


def attend_fused(q_nhk: jax.Array, k_nhk: jax.Array, v_nhk: jax.Array, n_valid: jax.Array) -> jax.Array:
    """`attend` through cuDNN's fused (flash) attention, on NVIDIA GPUs only: no score matrix in memory.
    The first `n_valid` patches must be the valid ones: cuDNN masks keys by a sequence length."""
    out_1nhk = jax.nn.dot_product_attention(q_nhk[None], k_nhk[None], v_nhk[None],
                                            key_value_seq_lengths=n_valid.reshape(1).astype(jnp.int32),
                                            implementation="cudnn")
    return out_1nhk[0]


class VisionEncoder(nnx.Module):
    """Patches of one image → `rows·(cols + 1) + 2` embeddings of the decoder's width (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        v = cfg.vision
        if v is None:
            raise ValueError("the model config has no vision_config: it reads no images")
        self.vision = v
        d, out = v.hidden_size, cfg.hidden_size
        self.patch_embed = Linear(v.patch_size ** 2 * 3, d, rngs=rngs, dtype=dtype, bias=True)
        self.blocks = nnx.List([VisionBlock(v, rngs=rngs, dtype=dtype) for _ in range(v.num_layers)])
        self.norm = RMSNorm(d, v.norm_eps)
        self.merge_in = Linear(v.merge_size ** 2 * d, out, rngs=rngs, dtype=dtype, bias=True)
        self.merge_out = Linear(out, out, rngs=rngs, dtype=dtype, bias=True)
        std = cfg.initializer_range
        self.row_end = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))
        self.image_begin = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))
        self.image_end = nnx.Param((std * jax.random.normal(rngs.params(), (out,))).astype(dtype))

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
        dtype = self.patch_embed.weight[...].dtype
        if fused and not fused_attention_fits(dtype, v.hidden_size // v.num_heads):
            raise ValueError(f"cuDNN's fused attention does not take {jnp.dtype(dtype).name} heads of "
                             f"{v.hidden_size // v.num_heads} channels")
        n_valid = None
        if fused:  # every patch's position travels with it: the order is free
            order_n = jnp.argsort(~valid_n, stable=True)
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


def layout(cell_ce, rows: int, cols: int, begin_e, row_end_e, end_e, xp=np):
    """The image's embeddings in prompt order: `[begin, row 0's cells, row end, row 1's cells, row end, …,
    end]`, from its `rows·cols` cell embeddings (row-major) and the learned frame (`xp`: numpy or jnp)."""
    e = cell_ce.shape[-1]
    grid_rce = cell_ce[:rows * cols].reshape(rows, cols, e)
    body = xp.concatenate([grid_rce, xp.broadcast_to(row_end_e, (rows, 1, e))], axis=1).reshape(rows * (cols + 1), e)
    return xp.concatenate([begin_e[None], body, end_e[None]], axis=0)
