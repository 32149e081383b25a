"""An image's span of the prompt: the embeddings the decoder reads in place of its placeholder tokens."""

from __future__ import annotations

import numpy as np


def layout(cell_ce, rows: int, cols: int, begin_e, row_end_e, end_e, xp=np):
    """The image's embeddings in prompt order: `[begin, row 0's cells, row end, row 1's cells, row end, …,
    end]` (`rows·(cols + 1) + 2` of them), from its `rows·cols` cell embeddings (row-major) and the
    learned delimiters (`xp`: numpy or jnp)."""
    e = cell_ce.shape[-1]
    grid_rce = cell_ce[:rows * cols].reshape(rows, cols, e)
    body = xp.concatenate([grid_rce, xp.broadcast_to(row_end_e, (rows, 1, e))], axis=1).reshape(rows * (cols + 1), e)
    return xp.concatenate([begin_e[None], body, end_e[None]], axis=0)
