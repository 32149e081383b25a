"""The attention's KV compressors: HCA (disjoint windows of m' tokens, every visible entry attended) and
CSA (the overlapping two-series pool, entries picked by the lightning indexer), on the shared core of
`compression.py`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import LayerCache, Rows, num_entries
from dsjax.config import ModelConfig
from dsjax.layers.compression import Compressor, Selection, entry_visible
from dsjax.layers.indexer import Indexer


class HCACompressor(Compressor):
    """Heavily compressed attention: disjoint windows of m' tokens, every visible entry attended."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, cfg.head_dim, cfg.compress_rate_hca, overlap=False, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh, q_res_bsr, positions_bs):
        """Entries `[B,T,D]` and the `[B,S,T]` visibility mask."""
        entries = self.compress(x_bsh)
        return entries, entry_visible(positions_bs, entries.shape[1], self.rate)

    def extend(self, x_bch: jax.Array, q_res_bcr: jax.Array, positions_bc: jax.Array, start_b: jax.Array,
               n_valid_b: jax.Array, cache: LayerCache) -> tuple[Rows, Selection, LayerCache]:
        """Cached form for the sparse attention operations: the entries store (with the windows this chunk
        completes), each query's selection (every complete window so far) and the new layer cache."""
        state = self.compress_into(x_bch, cache.compressor, start_b, n_valid_b)
        selection = Selection(entries_len_bc=num_entries(positions_bc + 1, self.rate))
        return state.entries, selection, dataclasses.replace(cache, compressor=state)


class CSACompressor(Compressor):
    """Compressed sparse attention: overlapping two-series windows, entries picked by the lightning indexer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, cfg.head_dim, cfg.compress_rate_csa, overlap=True, rngs=rngs, dtype=dtype)
        self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh, q_res_bsr, positions_bs):
        """Entries `[B,T,D]` and the `[B,S,T]` mask of the entries the indexer selected per query."""
        entries = self.compress(x_bsh)
        return entries, self.indexer(x_bsh, q_res_bsr, positions_bs)

    def extend(self, x_bch: jax.Array, q_res_bcr: jax.Array, positions_bc: jax.Array, start_b: jax.Array,
               n_valid_b: jax.Array, cache: LayerCache) -> tuple[Rows, Selection, LayerCache]:
        """Cached form for the sparse attention operations: the entries store (with the windows this chunk
        completes), the indexer's picks and the new layer cache (entries and index keys)."""
        state = self.compress_into(x_bch, cache.compressor, start_b, n_valid_b)
        with jax.named_scope("indexer"):
            selection, keys = self.indexer.extend(x_bch, q_res_bcr, positions_bc, start_b, n_valid_b,
                                                  cache.indexer)
        return state.entries, selection, dataclasses.replace(cache, compressor=state, indexer=keys)
