"""The embedded demo model's image encoder (dsjax's design): the recipe's token count image by image, the
patch layout, the embeddings' layout, 2-D rotary positions that only relative placement matters to, and the
refusals."""

import io

import deepseek_recipe as dr
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from dsjax.config import ConfigError, ModelConfig, VisionConfig
from dsjax.engine.encoder import fused_vision
from dsjax.engine.pixels import ImageError, cell_bucket, decode_image, pad_cells, patchify
from dsjax.layers.demo_vision import DemoVisionEncoder

TINY_VISION = VisionConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def encoder():
    cfg = ModelConfig.preset("tiny").replace(vision=TINY_VISION)
    return DemoVisionEncoder(cfg, rngs=nnx.Rngs(0))


def _png(w: int, h: int, rng) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 256, 3))).save(out, "PNG")
    return out.getvalue()


def _out_len(encoder, width: int, height: int) -> int:
    rows, cols = encoder.vision.grid(width, height)
    n = rows * cols * encoder.vision.merge_size ** 2
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    out = jax.eval_shape(lambda p, r, c, v: encoder(p, r, c, v, rows, cols), spec((n, 588), jnp.float32),
                         spec((n,), jnp.int32), spec((n,), jnp.int32), spec((n,), jnp.bool_))
    assert out.shape[1] == 64  # the tiny decoder's width
    return out.shape[0]


def test_token_count_is_the_recipes_image_by_image(encoder):
    """200 random sizes, both detail levels: the preprocessed image decodes at the size the recipe
    reports, and the encoder gives it `image_token_adjustment() + 1` embeddings."""
    rng = np.random.default_rng(0)
    resolver = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor())
    seen = set()
    for _ in range(200):
        w, h = (int(x) for x in np.exp(rng.uniform(np.log(4), np.log(5000), 2)))
        data = _png(w, h, rng)
        for detail in ("low", "high"):
            resolved = resolver.resolve([dr.BytesImageSource(data, detail)], dr.ImageQuota())
            (image,) = resolved.images
            want = resolved.image_token_adjustment() + 1
            pixels = decode_image(image.data, TINY_VISION)
            assert pixels.shape == (image.height, image.width, 3)
            assert _out_len(encoder, image.width, image.height) == want, (w, h, detail, image.width, image.height)
            seen.add(want)
    assert len(seen) > 50  # many different grids, not one size over and over


@pytest.mark.parametrize("size,tokens", [((546, 546), 184), ((644, 490), 206), ((1036, 1036), 652),
                                         ((1288, 728), 578), ((1848, 924), 992), ((126, 2436), 234)])
def test_the_issues_vectors(size, tokens):
    assert TINY_VISION.image_tokens(*size) == tokens


def test_patches_are_laid_out_cell_by_cell():
    """A 5×4-patch image (2×2 cells of 3×3 after padding): each cell's 9 patches are consecutive, in
    row-major order within the cell, and carry the pixels of their place; padding is marked."""
    p = TINY_VISION.patch_size
    h, w = 4 * p, 5 * p
    pixels = np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8)
    a = patchify(pixels, TINY_VISION)
    assert a["patches"].shape == (4 * 9, p * p * 3)
    assert a["valid"].sum() == 5 * 4
    for n in range(36):
        cell, k = divmod(n, 9)
        r, c = (cell // 2) * 3 + k // 3, (cell % 2) * 3 + k % 3
        assert (a["row"][n], a["col"][n]) == (r, c)
        assert a["valid"][n] == (r < 4 and c < 5)
        if a["valid"][n]:
            want = pixels[r * p:(r + 1) * p, c * p:(c + 1) * p].astype(np.float32) * (2 / 255) - 1
            np.testing.assert_allclose(a["patches"][n], want.reshape(-1), rtol=1e-6)
        else:
            assert not a["patches"][n].any()


def _image_inputs(seed: int, h_patches: int, w_patches: int):
    p = TINY_VISION.patch_size
    pixels = np.random.default_rng(seed).integers(0, 256, (h_patches * p, w_patches * p, 3), dtype=np.uint8)
    return pixels, {k: jnp.asarray(v) for k, v in patchify(pixels, TINY_VISION).items()}


def test_rows_end_and_the_image_is_framed(encoder):
    """`[begin, cells of row 0, row end, cells of row 1, row end, …, end]`."""
    pixels, a = _image_inputs(2, 7, 4)  # 3 rows of 2 cells
    rows, cols = TINY_VISION.grid(pixels.shape[1], pixels.shape[0])
    out = np.asarray(encoder(a["patches"], a["row"], a["col"], a["valid"], rows, cols))
    assert (rows, cols) == (3, 2) and out.shape == (3 * 3 + 2, 64)
    np.testing.assert_array_equal(out[0], np.asarray(encoder.image_begin[...]))
    np.testing.assert_array_equal(out[-1], np.asarray(encoder.image_end[...]))
    for r in range(rows):
        np.testing.assert_array_equal(out[1 + r * (cols + 1) + cols], np.asarray(encoder.row_end[...]))
    cells = out[1:-1].reshape(rows, cols + 1, -1)[:, :cols].reshape(rows * cols, -1)
    assert np.isfinite(cells).all() and len({c.tobytes() for c in cells}) == rows * cols


def test_padding_patches_change_nothing(encoder):
    """Whatever the padding patches hold, the embeddings are the same: they are masked out of attention
    and out of their cells."""
    _, a = _image_inputs(3, 4, 5)
    rows, cols = 2, 2
    base = encoder(a["patches"], a["row"], a["col"], a["valid"], rows, cols)
    noisy = jnp.where(a["valid"][:, None], a["patches"], 7.0)
    np.testing.assert_array_equal(np.asarray(encoder(noisy, a["row"], a["col"], a["valid"], rows, cols)),
                                  np.asarray(base))


def test_only_relative_positions_matter(encoder):
    """Shifting every patch's row and column by a constant leaves the output unchanged (rotary
    positions enter attention only through differences), and transposing the positions changes it
    (rows and columns are told apart)."""
    encoder = nnx.clone(encoder)
    for block in encoder.blocks:  # sharper attention than the initializer's, so that positions show
        block.qkv.weight[...] = block.qkv.weight[...] * 30
    _, a = _image_inputs(4, 6, 6)
    args = (a["patches"], a["row"], a["col"], a["valid"], 2, 2)
    base = np.asarray(encoder(*args))
    shifted = np.asarray(encoder(a["patches"], a["row"] + 5, a["col"] + 11, a["valid"], 2, 2))
    np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-5)
    swapped = np.asarray(encoder(a["patches"], a["col"], a["row"], a["valid"], 2, 2))
    assert np.abs(swapped - base).max() > 0.1 * np.abs(base).max()


def test_bad_images_are_refused_with_the_reason():
    with pytest.raises(ImageError, match="cannot decode the image"):
        decode_image(b"not an image", TINY_VISION)
    rng = np.random.default_rng(5)
    with pytest.raises(ImageError, match="image is 30x28 pixels; .* multiples of 14"):
        decode_image(_png(30, 28, rng), TINY_VISION)


def test_vision_config_round_trips_and_refuses_bad_fields():
    cfg = ModelConfig.preset("tiny").replace(vision=TINY_VISION)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert "vision_config" not in ModelConfig.preset("tiny").to_hf()
    with pytest.raises(ConfigError, match="unknown keys \\['depth'\\]"):
        ModelConfig.from_hf({**cfg.to_hf(), "vision_config": {**TINY_VISION.to_hf(), "depth": 3}})
    with pytest.raises(ConfigError, match="num_heads \\(3\\) heads of a multiple of 4"):
        VisionConfig(hidden_size=32, num_layers=1, num_heads=3, intermediate_size=8)
    with pytest.raises(ConfigError, match="patch_size must be a positive int"):
        VisionConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=8, patch_size=0)
    with pytest.raises(ValueError, match="no vision_config"):
        DemoVisionEncoder(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))


def _xla_fused(q_bnhk, k_bnhk, v_bnhk, n_valid_b):
    """`attend_fused`'s contract (keys past `n_valid` masked) through XLA's attention, for CPUs."""
    return jax.nn.dot_product_attention(q_bnhk, k_bnhk, v_bnhk, key_value_seq_lengths=n_valid_b,
                                        implementation="xla")


def test_fused_path_moves_valid_patches_first_and_back(encoder, monkeypatch):
    """With the valid patches moved first and keys masked by a length (as cuDNN takes them), the cells
    are the masked attention's, padding cells and partial cells included."""
    import dsjax.layers.demo_vision as vision

    monkeypatch.setattr(vision, "attend_fused", _xla_fused)
    monkeypatch.setattr(vision, "fused_attention_fits", lambda dtype, head_dim: True)
    _, a = _image_inputs(6, 5, 7)  # partial cells on two edges
    padded = {k: jnp.asarray(v) for k, v in pad_cells({k: np.asarray(v) for k, v in a.items()}, 8,
                                                      TINY_VISION).items()}
    assert not bool(padded["valid"].all()) and bool(padded["valid"][-1]) is False
    args = (padded["patches"], padded["row"], padded["col"], padded["valid"])
    want = np.asarray(encoder.cells(*args))
    np.testing.assert_allclose(np.asarray(encoder.cells(*args, fused=True)), want, rtol=1e-5, atol=1e-6)


def test_fused_attention_is_refused_where_cudnn_would_not_take_it(encoder):
    _, a = _image_inputs(7, 3, 3)
    with pytest.raises(ValueError, match="cuDNN's fused attention does not take float32 heads of 16 channels"):
        encoder.cells(a["patches"], a["row"], a["col"], a["valid"], fused=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_cudnn_attention_gives_the_blocked_attentions_cells():
    """On an NVIDIA GPU: the bf16 encoder through cuDNN's fused attention against the blocked XLA one, for
    an image with partial and padding cells; the engine picks the fused path there."""
    vision = VisionConfig(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512)
    cfg = ModelConfig.preset("tiny").replace(vision=vision)
    enc = DemoVisionEncoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    pixels = np.random.default_rng(0).integers(0, 256, (40 * 14, 31 * 14, 3), dtype=np.uint8)
    rows, cols = vision.grid(pixels.shape[1], pixels.shape[0])
    a = pad_cells(patchify(pixels, vision), cell_bucket(rows * cols), vision)
    args = [jnp.asarray(a[k]) for k in ("patches", "row", "col", "valid")]
    blocked = np.asarray(jax.jit(lambda *x: enc.cells(*x, query_block=256))(*args), np.float32)
    fused = np.asarray(jax.jit(lambda *x: enc.cells(*x, fused=True))(*args), np.float32)
    assert np.abs(fused - blocked).max() <= 0.03 * np.abs(blocked).max()
    import dsjax

    model = dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert fused_vision(model)


def test_patch_weight_gives_the_compute_dtype_of_a_bf16_model():
    """`fused_vision` reads the encoder's compute dtype from its patch embedding: in a bf16 model that is bf16
    although its norms keep float32 weights (the first parameter of the tree is such a norm)."""
    import dsjax
    from dsjax.config_v41 import V41Config
    from dsjax.model_v41 import DeepseekV41

    demo = dsjax.DeepseekV4(ModelConfig.preset("tiny-vision"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    v41 = DeepseekV41(V41Config.preset("tiny-v4.1-vision"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    for model in (demo, v41):
        assert model.vision.patch_weight.dtype == jnp.bfloat16
        assert not fused_vision(model)  # CPU
    leaves = jax.tree.leaves(nnx.state(demo.vision, nnx.Param))
    assert leaves[0].dtype == jnp.float32
