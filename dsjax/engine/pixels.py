"""Host-side image preparation for the encoder (numpy): an image's bytes decoded to pixels, the pixels
cut into the encoder's patches cell by cell, and the patches padded to a few bucket sizes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from dsjax.config import VisionConfig

# Pixel values map to [-1, 1].
PIXEL_SCALE = 2.0 / 255.0


class ImageError(ValueError):
    """An image the encoder cannot read: undecodable, or not the size the recipe's preprocessing gives."""


def decode_image(data: bytes, vision: VisionConfig) -> np.ndarray:
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


def patchify(pixels_hwc: np.ndarray, vision: VisionConfig) -> dict[str, np.ndarray]:
    """Cut `[H, W, 3]` uint8 pixels into the encoder's input, cell by cell.

    Returns `patches` `[N, p·p·3]` float32 (N = rows·cols·m², m the merge size; rows of pixels, then
    columns, then channels within a patch), the patch-grid `row` and `col` of each `[N]` int32, and
    `valid` `[N]` bool (False for the padding that completes the last row and column of cells)."""
    p, m = vision.patch_size, vision.merge_size
    h, w = pixels_hwc.shape[:2]
    rows, cols = vision.grid(w, h)
    grid_h, grid_w = rows * m, cols * m
    padded = np.zeros((grid_h * p, grid_w * p, 3), np.float32)
    padded[:h, :w] = pixels_hwc.astype(np.float32) * PIXEL_SCALE - 1.0
    # [rows, m, p, cols, m, p, 3] -> [rows, cols, m(i), m(j), p, p, 3]: a cell's patches adjacent
    cells = padded.reshape(rows, m, p, cols, m, p, 3).transpose(0, 3, 1, 4, 2, 5, 6)
    patches = cells.reshape(rows * cols * m * m, p * p * 3)
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


def pad_cells(arrays: dict[str, np.ndarray], cells: int, vision: VisionConfig) -> dict[str, np.ndarray]:
    """`patchify`'s arrays padded with whole invalid cells up to `cells` cells."""
    extra = cells * vision.merge_size ** 2 - len(arrays["valid"])
    if extra < 0:
        raise ValueError(f"{len(arrays['valid'])} patches do not fit {cells} cells")
    return {k: np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)]) for k, a in arrays.items()}
