"""DeepSeek-V4.1's image path against NeMo AutoModel 0.7.0 (tests/reference/run_v41_reference.py, the `vision`
case: tiny-v4.1-vision, fp32 on CPU) on five images: upscaled to the minimum pixels, as is, shrunk to the token cap,
5:1 and square. The pixels, the ViT's patch features, the aligner's rows, the image's span through the engine's
encoder and the logits of a prompt holding the image."""

import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import RunConfig
from dsjax.engine.engine import Engine
from dsjax.engine.pixels import _V41_PIXELS, patchify
from dsjax.layers.image_span import layout
from dsjax.model_v41 import with_cache_rounding
from tests.conftest import assert_close

IMAGES = range(5)


@pytest.fixture(scope="module")
def case(reference_v41):
    return reference_v41 / "vision"


@pytest.fixture(scope="module")
def model(case):
    return dsjax.load_model(case / "ckpt")


def canvas_pixels(case, i: int) -> np.ndarray:
    """The processor's canvas `[H, W, 3]` uint8, rebuilt from its normalised bf16 patches (scanline order over
    the exact patch grid): each value mapped back to the pixel the release's normalisation sends to it."""
    patches = np.load(case / f"vision_patches_{i}.npy")
    n_h, n_w = np.load(case / f"vision_grid_{i}.npy")
    p = patches.shape[-1]
    canvas_hwc = patches.reshape(n_h, n_w, 3, p, p).transpose(0, 3, 1, 4, 2).reshape(n_h * p, n_w * p, 3)
    codes = np.searchsorted(_V41_PIXELS, canvas_hwc)  # the table rises; equal values share the first code
    assert (_V41_PIXELS[np.minimum(codes, 255)] == canvas_hwc).all(), "a patch value no pixel normalises to"
    return codes.astype(np.uint8)


def scanline(arrays: dict, n_w: int) -> np.ndarray:
    """For each of `patchify`'s valid patches, its index in the processor's scanline order."""
    return arrays["row"][arrays["valid"]] * n_w + arrays["col"][arrays["valid"]]


@pytest.mark.parametrize("i", IMAGES)
def test_pixels_features_and_rows_match_reference(case, model, i):
    """`patchify` of the canvas gives the processor's patches bit for bit (normalisation and the (c, y, x)
    order), the ViT its patch features and the aligner its rows within 1e-4 relative."""
    n_h, n_w = np.load(case / f"vision_grid_{i}.npy")
    ref_patches = np.load(case / f"vision_patches_{i}.npy")
    arrays = patchify(canvas_pixels(case, i), model.cfg.vision)
    at = scanline(arrays, n_w)
    assert arrays["valid"].sum() == n_h * n_w and sorted(at) == list(range(n_h * n_w))
    np.testing.assert_array_equal(arrays["patches"][arrays["valid"]], ref_patches.reshape(n_h * n_w, -1)[at])

    batch = {k: jnp.asarray(a[None]) for k, a in arrays.items()}
    features = np.asarray(model.vision(batch["patches"], batch["row"], batch["col"], batch["valid"]))[0]
    assert not features[~arrays["valid"]].any()
    assert_close(features[arrays["valid"]], np.load(case / f"vision_features_{i}.npy")[at], rtol=1e-4,
                 what=f"image {i} patch features")
    rows_h, rows_w = model.cfg.vision.grid(n_w * 14, n_h * 14)
    cells = np.asarray(model.image_cells(batch["patches"], batch["row"], batch["col"], batch["valid"]))[0]
    assert_close(cells, np.load(case / f"vision_rows_{i}.npy"), rtol=1e-4, what=f"image {i} aligner rows")
    assert len(cells) == rows_h * rows_w


def test_engine_encodes_the_images_together_as_the_reference(case, model):
    """The engine's batched encoder (cell buckets, padding, copies filling a batch) on all five canvases at
    once gives each image's span as the reference lays it out: start, each row of cells and a newline,
    end, its length the processor's."""
    engine = Engine(model, RunConfig(slots=2, max_len=64, chunk_size=16))
    spans = engine.encode_images([canvas_pixels(case, i) for i in IMAGES])
    frame = [np.asarray(x) for x in model.image_frame()]
    for i in IMAGES:
        n_h, n_w = np.load(case / f"vision_grid_{i}.npy")
        rows_h, rows_w = model.cfg.vision.grid(n_w * 14, n_h * 14)
        assert len(spans[i]) == int(np.load(case / f"vision_tokens_{i}.npy"))
        assert_close(spans[i], layout(np.load(case / f"vision_rows_{i}.npy"), rows_h, rows_w, *frame), rtol=1e-4,
                     what=f"image {i} span")


def prompt_embeds(case, model) -> tuple[np.ndarray, np.ndarray, jnp.ndarray]:
    """The reference prompt's ids, image mask and embeddings with the image's span spliced in (its start,
    newline and end where the token types say)."""
    ids, types = np.load(case / "vision_input_ids.npy"), np.load(case / "vision_token_types.npy")
    mask = np.load(case / "vision_image_mask.npy")
    n_h, n_w = np.load(case / "vision_grid_0.npy")
    rows_h, rows_w = model.cfg.vision.grid(n_w * 14, n_h * 14)
    frame = [np.asarray(x) for x in model.image_frame()]
    span = layout(np.load(case / "vision_rows_0.npy"), rows_h, rows_w, *frame)
    # The layout's delimiters sit where NeMo's token types put them: 0 start, 2 newline, 3 end.
    kinds = np.full(len(span), 1)
    kinds[0], kinds[-1] = 0, 3
    kinds[1 + rows_w::rows_w + 1] = 2
    np.testing.assert_array_equal(types[mask], kinds)
    embeds = np.array(model.embed_tokens(jnp.asarray(ids)))
    embeds[mask] = span
    return ids, mask, jnp.asarray(embeds)


def test_logits_with_an_image_match_reference(case, model):
    """The whole model on a prompt holding image 0 (the reference's cache rounding replaced by the identity,
    ours off): within 1e-4 of the largest logit, and the image changes them."""
    plain = with_cache_rounding(model, False)
    ids, mask, embeds = prompt_embeds(case, plain)
    ref = np.load(case / "vision_logits_identity.npy")
    got = np.asarray(plain.forward(jnp.asarray(ids), jnp.asarray(mask), embeds=embeds))
    assert_close(got, ref, rtol=1e-4, what="logits with an image")
    blank = np.asarray(plain.forward(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(blank - ref)[0, mask[0].argmax() + 1:].max() > 1e-2 * np.abs(ref).max()


def test_logits_with_an_image_and_release_cache_formats_match_reference(case, model):
    """Cache rounding as released on both sides, judged as in test_model_v41_matches_reference: a flipped
    rounding code may move a few positions past 1e-4 of the largest logit, never past 1e-2 nor the greedy
    token."""
    ids, mask, embeds = prompt_embeds(case, model)
    ref = np.load(case / "vision_logits_quantized.npy")
    got = np.asarray(with_cache_rounding(model, True).forward(jnp.asarray(ids), jnp.asarray(mask), embeds=embeds))
    err_t = np.abs(got - ref).max(-1)[0] / np.abs(ref).max()
    assert err_t.max() <= 1e-2
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    assert (err_t <= 1e-4).mean() >= 0.9, f"only {(err_t <= 1e-4).sum()} of {err_t.size} positions within 1e-4"
