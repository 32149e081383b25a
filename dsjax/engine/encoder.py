"""The image encoder as the engine runs it: one image's pixels in, its decoder embeddings out, through a
jitted program per cell bucket (`pixels.cell_bucket`), so that images of many sizes share few programs."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dsjax.engine.pixels import cell_bucket, pad_cells, patchify
from dsjax.engine.steps import graph_of
from dsjax.layers.vision import fused_attention_fits, layout


@functools.partial(jax.jit, static_argnums=(0, 1))
def encode_cells(graphdef, fused: bool, params, patches_nk, row_n, col_n, valid_n):
    """The model's encoder over `patchify`'s arrays: (one embedding per cell, and the learned image-begin,
    row-end and image-end embeddings)."""
    encoder = nnx.merge(graph_of(graphdef), params).vision
    return (encoder.cells(patches_nk, row_n, col_n, valid_n, fused=fused), *encoder.frame())


def fused_vision(model) -> bool:
    """Whether `model`'s encoder attention goes through cuDNN's fused kernel: on NVIDIA GPUs, for heads
    it takes. Chosen here and not by `platform_dependent`: tracing the cuDNN call needs cuDNN present."""
    weight = model.vision.patch_embed.weight[...]
    v = model.cfg.vision
    return all(d.platform == "gpu" for d in weight.devices()) and fused_attention_fits(
        weight.dtype, v.hidden_size // v.num_heads)


def encode_image(model, graphdef, params, pixels_hwc: np.ndarray) -> np.ndarray:
    """One image's embeddings `[image_tokens, hidden]` (float32, on the host) from its `[H, W, 3]` uint8
    pixels (`pixels.decode_image`) by `model`'s encoder (`graphdef` and `params`: its split, the graphdef
    a `StaticGraph`). The image is padded with blank cells to `cell_bucket` cells."""
    vision = model.cfg.vision
    if model.vision is None:
        raise ValueError("this model has no image encoder (its config has no vision_config)")
    h, w = pixels_hwc.shape[:2]
    rows, cols = vision.grid(w, h)
    a = pad_cells(patchify(pixels_hwc, vision), cell_bucket(rows * cols), vision)
    cells, begin, row_end, end = jax.device_get(encode_cells(
        graphdef, fused_vision(model), params, a["patches"], a["row"], a["col"], a["valid"]))
    return layout(np.asarray(cells, np.float32)[:rows * cols], rows, cols,
                  *(np.asarray(x, np.float32) for x in (begin, row_end, end)))
