"""The image encoder as the engine runs it: images' pixels in, their decoder embeddings out.

Images are padded with blank cells to a few sizes (`pixels.cell_bucket`), and the images of one size go
through the encoder together, in batches of a power-of-two count (the last batch filled up with copies
of its last image), so that images of many sizes and any number of them share few compiled programs."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dsjax.engine.pixels import cell_bucket, pad_cells, patchify
from dsjax.engine.steps import graph_of
from dsjax.layers.image_span import layout
from dsjax.layers.patch_attention import fused_attention_fits

# The most patches one encoder call takes (the images of a batch together): it bounds the call's
# activations (B·N·width per layer, and B·heads·QUERY_BLOCK·N fp32 scores without cuDNN), not its speed.
BATCH_PATCHES = 32768


@functools.partial(jax.jit, static_argnums=(0, 1))
def encode_cells(graphdef, fused: bool, params, patches_bnk, row_bn, col_bn, valid_bn):
    """The model's encoder over a batch of `patchify`'s arrays: (one embedding per cell `[B, cells, hidden]`,
    and the learned image-start, row-end and image-end embeddings)."""
    model = nnx.merge(graph_of(graphdef), params)
    return (model.image_cells(patches_bnk, row_bn, col_bn, valid_bn, fused=fused), *model.image_frame())


def fused_vision(model) -> bool:
    """Whether `model`'s encoder attention goes through cuDNN's fused kernel: on NVIDIA GPUs, for heads
    it takes. Chosen here and not by `platform_dependent`: tracing the cuDNN call needs cuDNN present."""
    weight = model.vision.patch_weight
    return all(d.platform == "gpu" for d in weight.devices()) and fused_attention_fits(
        weight.dtype, model.cfg.vision.head_dim)


def batch_size(cells: int, vision, images: int) -> int:
    """Images of `cells` cells per encoder call: a power of two, at most `images` rounded up, within
    `BATCH_PATCHES` patches (at least one image)."""
    fit = max(1, BATCH_PATCHES // (cells * vision.merge_size ** 2))
    want = 1 << max(images - 1, 0).bit_length()
    return max(1, min(want, 1 << (fit.bit_length() - 1)))


def encode_images(model, graphdef, params, images_hwc: list[np.ndarray]) -> list[np.ndarray]:
    """Each image's embeddings `[image_tokens, hidden]` (float32, on the host) from its `[H, W, 3]` uint8
    pixels (`pixels.decode_image`), by `model`'s encoder (`graphdef` and `params`: its split, the graphdef
    a `StaticGraph`); images of one cell bucket share calls."""
    vision = model.cfg.vision
    if model.vision is None:
        raise ValueError("this model has no image encoder (its config has no vision_config)")
    grids = [vision.grid(p.shape[1], p.shape[0]) for p in images_hwc]
    by_bucket: dict[int, list[int]] = {}
    for i, (rows, cols) in enumerate(grids):
        by_bucket.setdefault(cell_bucket(rows * cols), []).append(i)
    fused = fused_vision(model)
    out: list[np.ndarray | None] = [None] * len(images_hwc)
    for cells, members in sorted(by_bucket.items()):
        size = batch_size(cells, vision, len(members))
        for first in range(0, len(members), size):
            group = members[first:first + size]
            arrays = [pad_cells(patchify(images_hwc[i], vision), cells, vision) for i in group]
            arrays += [arrays[-1]] * (size - len(group))
            stacked = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
            cells_bce, begin, row_end, end = jax.device_get(encode_cells(
                graphdef, fused, params, stacked["patches"], stacked["row"], stacked["col"], stacked["valid"]))
            frame = [np.asarray(x, np.float32) for x in (begin, row_end, end)]
            for b, i in enumerate(group):
                rows, cols = grids[i]
                out[i] = layout(np.asarray(cells_bce[b], np.float32)[:rows * cols], rows, cols, *frame)
    return out
