"""Host-side image preparation for the encoder (numpy): an image's bytes decoded to pixels, the pixels
cut into the encoder's patches cell by cell, and the patches padded to a few bucket sizes."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
from PIL import Image, UnidentifiedImageError

# Pixel values map to [-1, 1].
PIXEL_SCALE = 2.0 / 255.0


class ImageError(ValueError):
    """An image the encoder cannot read: undecodable, or not the size the recipe's preprocessing gives."""


def decode_image(data: bytes, vision) -> np.ndarray:
    """The RGB pixels `[H, W, 3]` uint8 of one preprocessed image (the recipe's WebP bytes, or any
    format Pillow reads). Raises ImageError when it cannot be decoded or its sides are not multiples
    of the patch size (an image that did not go through the recipe's preprocessing)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            pixels = np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"cannot decode the image ({len(data)} bytes): {e}") from None
    h, w = pixels.shape[:2]
    p = vision.patch_size
    if h % p or w % p or not h or not w:
        raise ImageError(f"image is {w}x{h} pixels; the encoder takes sides that are positive multiples of "
                         f"{p} (preprocess it with deepseek-recipe's ImageResolver)")
    return pixels


# The release's normalisation of a uint8 pixel x: bf16((x/255 − 0.5)/0.5) with the fp32 arithmetic done in
# that order (DeepInfer's lookup table), held as fp32.
_V41_PIXELS = ((np.arange(256, dtype=np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)).astype(
    ml_dtypes.bfloat16).astype(np.float32)


def normalize(pixels_hwc: np.ndarray, vision) -> np.ndarray:
    """uint8 pixels → the encoder's float32 inputs, as the config's `pixel_format` says."""
    if vision.pixel_format == "v4.1":
        return _V41_PIXELS[pixels_hwc]
    return pixels_hwc.astype(np.float32) * PIXEL_SCALE - 1.0


def patchify(pixels_hwc: np.ndarray, vision) -> dict[str, np.ndarray]:
    """Cut `[H, W, 3]` uint8 pixels into the encoder's input, cell by cell.

    Returns `patches` `[N, p·p·3]` float32 (N = rows·cols·m², m the merge size; a patch's pixels in the
    config's `pixel_format` order: (y, x, channel) for the demo encoder, (channel, y, x) for V4.1's), the
    patch-grid `row` and `col` of each `[N]` int32, and `valid` `[N]` bool (False for the padding that
    completes the last row and column of cells). `vision`: a `VisionConfig` or `V41VisionConfig`."""
    p, m = vision.patch_size, vision.merge_size
    h, w = pixels_hwc.shape[:2]
    rows, cols = vision.grid(w, h)
    grid_h, grid_w = rows * m, cols * m
    padded = np.zeros((grid_h * p, grid_w * p, 3), np.float32)
    padded[:h, :w] = normalize(pixels_hwc, vision)
    # [rows, m, p, cols, m, p, 3] -> [rows, cols, m(i), m(j), …]: a cell's patches adjacent
    cells = padded.reshape(rows, m, p, cols, m, p, 3)
    order = (0, 3, 1, 4, 6, 2, 5) if vision.pixel_format == "v4.1" else (0, 3, 1, 4, 2, 5, 6)
    patches = cells.transpose(order).reshape(rows * cols * m * m, p * p * 3)
    r, c, i, j = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(m), np.arange(m), indexing="ij")
    row, col = (r * m + i).reshape(-1).astype(np.int32), (c * m + j).reshape(-1).astype(np.int32)
    valid = (row < h // p) & (col < w // p)
    return {"patches": patches, "row": row, "col": col, "valid": valid}


def cell_bucket(cells: int) -> int:
    """The number of cells an image is padded to before encoding: the least m·2^k ≥ `cells` with
    8 ≤ m < 16 (at most 1/8 padding), so images of many sizes share few compiled programs."""
    if cells <= 8:
        return cells
    k = max(cells.bit_length() - 4, 0)
    return -(-cells // (1 << k)) * (1 << k)


def pad_cells(arrays: dict[str, np.ndarray], cells: int, vision) -> dict[str, np.ndarray]:
    """`patchify`'s arrays padded with whole invalid cells up to `cells` cells."""
    extra = cells * vision.merge_size ** 2 - len(arrays["valid"])
    if extra < 0:
        raise ValueError(f"{len(arrays['valid'])} patches do not fit {cells} cells")
    return {k: np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)]) for k, a in arrays.items()}
