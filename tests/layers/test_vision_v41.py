"""DeepSeek-V4.1's image encoder (layers/vision_v41.py) piece by piece, against formulas written here from
the release's description (deepseek_v41_spec.md §6): the release's pixel values and patch layout, the
half-split 2-D rotary form, the aligner's channel-major 3 × 3 cells with zero padding, the cuDNN path's
reordering, batches, and the release's names. Parity with NeMo AutoModel's encoder is in
tests/test_vision_v41_matches_reference.py."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsjax.checkpoint import names_v41
from dsjax.config_v41 import V41Config
from dsjax.engine.pixels import cell_bucket, pad_cells, patchify
from dsjax.layers.rope import apply_rope_half_split, rope_2d
from dsjax.model_v41 import DeepseekV41

CFG = V41Config.preset("tiny-v4.1-vision")
V = CFG.vision


@pytest.fixture(scope="module")
def model():
    return DeepseekV41(CFG, rngs=nnx.Rngs(0))


def _pixels(h_patches: int, w_patches: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (14 * h_patches, 14 * w_patches, 3), dtype=np.uint8)


def _release_patches(pixels: np.ndarray) -> np.ndarray:
    """The release's patches `[n_h·n_w, 3·14·14]` in scanline order: (x/255 − 0.5)/0.5 in fp32 then bf16,
    each patch flattened (channel, y, x)."""
    h, w = pixels.shape[0] // 14, pixels.shape[1] // 14
    values = ((pixels.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)).astype(
        ml_dtypes.bfloat16).astype(np.float32)
    chw = values.transpose(2, 0, 1)
    return chw.reshape(3, h, 14, w, 14).transpose(1, 3, 0, 2, 4).reshape(h * w, 588)


def test_patches_hold_the_release_pixel_values_in_channel_major_order():
    """`patchify` for V4.1: every valid patch is the release's patch of the same grid position."""
    pixels = _pixels(5, 7, 1)
    a = patchify(pixels, V)
    want = _release_patches(pixels)
    valid = a["valid"]
    assert valid.sum() == 35 and len(valid) == 2 * 3 * 9  # 2 × 3 cells of 9 patches, partial ones padded
    index = a["row"][valid] * 7 + a["col"][valid]
    np.testing.assert_array_equal(a["patches"][valid], want[index])
    assert not a["patches"][~valid].any()


def test_half_split_rotary_pairs_channel_i_with_i_plus_half():
    """Channels 0–15 turn with the row and 16–31 with the column (head of 64), each paired with the one 32
    further, at the frequencies 10000^(−i/16)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 2, 64)).astype(np.float32)
    row, col = np.array([0, 1, 2, 3, 4, 5]), np.array([5, 4, 3, 2, 1, 0])
    cos, sin = rope_2d(jnp.asarray(row), jnp.asarray(col), 64, 10000.0)
    got = np.asarray(apply_rope_half_split(jnp.asarray(x), cos[:, None], sin[:, None]))
    inv = 10000.0 ** (-np.arange(16) / 16)
    angle = np.concatenate([row[:, None] * inv, col[:, None] * inv], axis=1)[:, None]  # [6, 1, 32]
    a, b = x[..., :32], x[..., 32:]
    want = np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_aligner_merges_each_cell_channel_major_with_zero_padding(model):
    """The aligner's rows from ViT features equal Linear → GELU → Linear over the zero-padded grid's 3 × 3
    cells, each cell's features at index channel·9 + 3·dy + dx (as `F.unfold`)."""
    pixels = _pixels(7, 4, 3)  # 3 × 2 cells, the last row and column partial
    a = patchify(pixels, V)
    args = [jnp.asarray(a[k])[None] for k in ("patches", "row", "col", "valid")]
    feats = np.asarray(model.vision(*args))[0]
    d = feats.shape[-1]
    grid = np.zeros((9, 6, d), np.float32)
    grid[a["row"][a["valid"]], a["col"][a["valid"]]] = feats[a["valid"]]
    assert not feats[~a["valid"]].any()
    cells = grid.reshape(3, 3, 2, 3, d).transpose(0, 2, 4, 1, 3).reshape(6, d * 9)  # [cell, channel·9 + 3dy + dx]
    w1, b1 = np.asarray(model.aligner.w1.weight[...]), np.asarray(model.aligner.w1.bias[...])
    w2, b2 = np.asarray(model.aligner.w2.weight[...]), np.asarray(model.aligner.w2.bias[...])
    hidden = cells @ w1.T + b1
    gelu = 0.5 * hidden * (1 + np.vectorize(math.erf)(hidden / np.sqrt(2)))
    want = gelu @ w2.T + b2
    got = np.asarray(model.image_cells(*args))[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_an_image_alone_and_in_a_batch_with_padding_cells_gives_the_same_rows(model):
    """Blank padding cells (`cell_bucket`) and other images in the batch change none of an image's rows."""
    images = [_pixels(5, 7, 4), _pixels(6, 6, 5)]
    alone = []
    for p in images:
        a = patchify(p, V)
        alone.append(np.asarray(model.image_cells(*(jnp.asarray(a[k])[None] for k in ("patches", "row", "col",
                                                                                          "valid"))))[0])
    padded = [pad_cells(patchify(p, V), 8, V) for p in images]
    together = np.asarray(model.image_cells(*(jnp.asarray(np.stack([a[k] for a in padded]))
                                              for k in ("patches", "row", "col", "valid"))))
    for i, rows in enumerate(alone):
        np.testing.assert_allclose(together[i, :len(rows)], rows, rtol=1e-5, atol=1e-6)
    assert cell_bucket(6) == 6


def _xla_fused(q_bnhk, k_bnhk, v_bnhk, n_valid_b):
    return jax.nn.dot_product_attention(q_bnhk, k_bnhk, v_bnhk, key_value_seq_lengths=n_valid_b,
                                        implementation="xla")


def test_fused_path_moves_valid_patches_first_and_back(model, monkeypatch):
    """With each image's valid patches moved first and keys masked by a length (as cuDNN takes them), the
    rows are the masked attention's, for a batch of two images with partial and padding cells."""
    import dsjax.layers.vision_v41 as vision_v41

    monkeypatch.setattr(vision_v41, "attend_fused", _xla_fused)
    monkeypatch.setattr(vision_v41, "fused_attention_fits", lambda dtype, head_dim: True)
    padded = [pad_cells(patchify(p, V), 8, V) for p in (_pixels(5, 7, 6), _pixels(4, 4, 7))]
    args = [jnp.asarray(np.stack([a[k] for a in padded])) for k in ("patches", "row", "col", "valid")]
    want = np.asarray(model.image_cells(*args))
    np.testing.assert_allclose(np.asarray(model.image_cells(*args, fused=True)), want, rtol=1e-5, atol=1e-6)


def test_fused_attention_is_refused_where_cudnn_would_not_take_it(model):
    a = patchify(_pixels(3, 3, 8), V)
    with pytest.raises(ValueError, match="cuDNN's fused attention does not take float32 heads of 16 channels"):
        model.image_cells(*(jnp.asarray(a[k])[None] for k in ("patches", "row", "col", "valid")), fused=True)


def test_release_names_are_the_module_paths(model):
    """Every encoder variable's path is its release tensor name (spec §4.4), both ways, and the release's
    shapes are the variables'."""
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    shapes = names_v41.release_shapes(CFG)
    image = {k for k in shapes if k.startswith(("vision.", "aligner.", "image_"))}
    assert len(image) == 3 + 8 * V.num_hidden_layers + 4 + 3
    for name in image:
        assert names_v41.to_dsjax(name) == name and names_v41.to_release(name) == name
        assert tuple(flat[name][...].shape) == shapes[name][0], name
    assert not any(names_v41.is_kept(n) for n in image)
    assert {k for k in flat if k.startswith(("vision.", "aligner.", "image_"))} == image


def test_a_text_only_config_builds_no_encoder():
    cfg = V41Config.preset("tiny-v4.1")
    m = DeepseekV41(cfg, rngs=nnx.Rngs(0))
    assert m.vision is None and m.image_start is None
    with pytest.raises(ValueError, match="no image encoder"):
        m.image_cells(jnp.zeros((1, 9, 588)), jnp.zeros((1, 9), jnp.int32), jnp.zeros((1, 9), jnp.int32),
                      jnp.ones((1, 9), bool))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_cudnn_attention_gives_the_blocked_attentions_rows():
    """On an NVIDIA GPU: the bf16 encoder at the release's head width (64) through cuDNN's fused attention
    against the blocked XLA one, two images with partial and padding cells; the engine picks the fused path."""
    from dsjax.engine.encoder import fused_vision

    vision = {**CFG.to_hf()["vision_config"], "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512}
    cfg = V41Config.from_hf({**CFG.to_hf(), "vision_config": vision})
    m = DeepseekV41(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    padded = [pad_cells(patchify(p, cfg.vision), cell_bucket(14 * 11), cfg.vision)
              for p in (_pixels(40, 31, 9), _pixels(39, 33, 10))]
    args = [jnp.asarray(np.stack([a[k] for a in padded])) for k in ("patches", "row", "col", "valid")]
    blocked = np.asarray(jax.jit(lambda *x: m.image_cells(*x, query_block=256))(*args), np.float32)
    fused = np.asarray(jax.jit(lambda *x: m.image_cells(*x, fused=True))(*args), np.float32)
    assert np.abs(fused - blocked).max() <= 0.03 * np.abs(blocked).max()
    assert fused_vision(m)
