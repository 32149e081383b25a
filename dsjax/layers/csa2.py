"""DeepSeek-V4.1's CSA2 attention: V4's attention core over the window and compressed entries shared
across layers.

A **Full** layer owns a compressor (ratio 2: disjoint softmax pooling of token pairs; ratio 1: one entry
per token) and the index keys of its entries, and selects its own top-k; a **Reindex** layer scores the
source's index keys with queries of its own (inside the candidate pool when a candidate source precedes
it); a **Reuse** layer attends the source's entries with the selection of the layer before it. What a
layer shares travels to the next as `Shared`. Queries have no per-head RMSNorm; compressed entries and
index keys are rotated at position `j·m`; the release stores the window in MXFP8, entries in NVFP4 and
index queries and keys in MXFP4, which the full forward reproduces as a round trip (`cache_rounding`) and
a cache of `kv_dtype` "fp4" stores as packed records (`dsjax.cache.v41_layer_cache`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import CompressorState, LayerCache, extend_window, gather_windows, is_packed, num_entries, \
    overwritten_rows, store_windows, write_entries
from dsjax.cache_formats import quantize_dequantize
from dsjax.config_v41 import FULL, REINDEX, LayerRole, V41Config
from dsjax.kernels.indexer.op import index_scores
from dsjax.kernels.sparse_attention.op import sparse_decode, sparse_prefill
from dsjax.layers.attention import Attention, attend_with_sinks, window_visible
from dsjax.layers.compression import entry_visible
from dsjax.layers.indexer import IndexerScorer, distillation_kl
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.layers.rope import apply_rope, rope_table
from dsjax.layers.topk import score_blocks, top_picks


@dataclasses.dataclass(frozen=True)
class Shared:
    """What CSA2 layers hand to the layers after them within one forward."""

    entries_btd: jax.Array | None = None  # the KV source's rotated compressed entries
    keys_btc: jax.Array | None = None  # its index keys
    picks_bsk: jax.Array | None = None  # the latest selection: entry indices in increasing order, −1 none
    # The candidate pool of each query: the blocks of `candidate_block_size` entries it holds, in
    # increasing order, −1 for none (a list, not a [B,S,T] mask: at 1M context that is 1 GiB a chunk).
    candidates_bsn: jax.Array | None = None


def _round(x: jax.Array, fmt: str, on: bool) -> jax.Array:
    return quantize_dequantize(x, fmt) if on else x


class CSA2Compressor(nnx.Module):
    """Compressed latents `[B, ⌊S/m⌋, D]` before RoPE: `norm(wkv(x))` per token (m = 1) or, for m = 2,
    `norm(Σ softmax(wgate(x))·wkv(x))` over each complete pair, pooled in fp32 without a position bias."""

    def __init__(self, cfg: V41Config, ratio: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.ratio = ratio
        self.kv_proj = Linear(cfg.hidden_size, cfg.head_dim, rngs=rngs, dtype=dtype)
        self.gate_proj = Linear(cfg.hidden_size, cfg.head_dim, rngs=rngs, dtype=dtype) if ratio > 1 else None
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def __call__(self, x_bsh: jax.Array) -> jax.Array:
        if self.ratio == 1:
            return self.kv_norm(self.kv_proj(x_bsh))
        return self.kv_norm(self.pool(x_bsh[:, : x_bsh.shape[1] // self.ratio * self.ratio]).astype(x_bsh.dtype))

    def extend(self, x_bch: jax.Array, start_b: jax.Array, n_valid_b: jax.Array, state: CompressorState,
               finish, undo: dict | None = None) -> tuple[CompressorState, jax.Array, jax.Array, jax.Array]:
        """Cached form for C new tokens per row (the first n_valid real, from position start): the latents of
        the entries this chunk completes, `[B, K, D]` pre-RoPE, the first entry's index `[B]` and how many
        are complete `[B]`; `finish(latent, first_b)` turns them into the stored rows (`(entries, keys)`),
        written here. Ratio 2 keeps an unpaired token's raw fp32 projections in the state's buffer; `undo`, if given,
        receives the chunk's `windows`, from which `cache.buffer_at` rewinds the buffer to an earlier end."""
        m = self.ratio
        end_b = start_b + n_valid_b
        if m == 1:
            latent = self(x_bch)
            entries, keys = finish(latent, start_b)
            state = dataclasses.replace(state, entries=write_entries(state.entries, entries, start_b, n_valid_b))
            return state, keys, start_b, n_valid_b
        xf = x_bch.astype(jnp.float32)
        windows = gather_windows(state, self.kv_proj(xf), self.gate_proj(xf), start_b)
        if undo is not None:
            undo["windows"] = windows
        entries, keys = finish(self.kv_norm(_pool(windows.kv_bkmn, windows.gate_bkmn).astype(x_bch.dtype)),
                               windows.first_b)
        new = store_windows(state, windows, entries, end_b)
        # A row without tokens keeps its buffer bit for bit (store_windows refills its free slots with filler).
        idle = (n_valid_b == 0)[:, None, None]
        new = dataclasses.replace(new, buffer_kv=jnp.where(idle, state.buffer_kv, new.buffer_kv),
                                  buffer_gate=jnp.where(idle, state.buffer_gate, new.buffer_gate))
        return new, keys, windows.first_b, num_entries(end_b, m) - windows.first_b

    def pool(self, x_bsh: jax.Array) -> jax.Array:
        """fp32 pooled latents of the whole groups of x (its length a multiple of the ratio)."""
        b, s, _ = x_bsh.shape
        xf = x_bsh.astype(jnp.float32)
        width = self.kv_proj.weight.shape[0]  # explicit: a sequence with no complete group has zero groups
        kv = self.kv_proj(xf).reshape(b, s // self.ratio, self.ratio, width)
        gate = self.gate_proj(xf).reshape(b, s // self.ratio, self.ratio, width)
        return _pool(kv, gate)


def _pool(kv_bkmn: jax.Array, gate_bkmn: jax.Array) -> jax.Array:
    """Each group's channel-wise softmax-weighted sum over its m tokens (fp32)."""
    return jnp.sum(kv_bkmn * jax.nn.softmax(gate_bkmn, axis=2), axis=2)


def candidate_blocks(score_bst: jax.Array, visible_len_bs: jax.Array, top_blocks: int, block: int) -> jax.Array:
    """Each query's candidate pool `[B,S,min(top_blocks, ⌈T/block⌉)]`: its `top_blocks` best blocks of
    `block` entries (a block scores its best entry; the block holding the newest visible entry always counts)
    in increasing order, −1 for the places of blocks with no finite score. Picked as one `lax.top_k` over the
    block scores would pick them (`layers.topk.top_picks`)."""
    block_bsn = jnp.max(score_blocks(score_bst, block), axis=-1)
    n_blocks = block_bsn.shape[-1]
    newest_bs = jnp.floor_divide(visible_len_bs - 1, block)
    block_bsn = jnp.where(jnp.arange(n_blocks) == newest_bs[..., None], jnp.inf, block_bsn)
    return top_picks(block_bsn, top_blocks)


def candidate_mask(blocks_bsn: jax.Array, n_entries: int, block: int) -> jax.Array:
    """`[B,S,T]` bool of the entries in each query's candidate blocks."""
    return jnp.any(blocks_bsn[..., None] == (jnp.arange(n_entries) // block), axis=-2)


def picks_in_pool(score_bst: jax.Array, blocks_bsn: jax.Array, block: int, k: int) -> jax.Array:
    """The top-k picks `[B,S,k]` (increasing, −1 at the end) among the entries of each query's candidate
    blocks only, as one `lax.top_k` over the scores with every other entry at −inf picks them: the pool's
    k·block scores are gathered in increasing entry order, so ties still go to the lower index."""
    b, s, t = score_bst.shape
    pool = jnp.take_along_axis(score_blocks(score_bst, block), jnp.maximum(blocks_bsn, 0)[..., None], axis=2)
    pool = jnp.where(blocks_bsn[..., None] >= 0, pool, -jnp.inf).reshape(b, s, -1)
    pos = top_picks(pool, k)
    entry = jnp.take_along_axis(blocks_bsn, jnp.maximum(pos, 0) // block, axis=-1) * block + pos % block
    picks = jnp.where(pos >= 0, entry, -1).astype(jnp.int32)[..., :min(k, t)]  # at most min(k, t) are valid
    # The same width as a pick over every entry, whatever the pool's size.
    return jnp.pad(picks, ((0, 0), (0, 0), (0, min(k, t) - picks.shape[-1])), constant_values=-1)


def picked_mask(picks_bsk: jax.Array, n_entries: int) -> jax.Array:
    """`[B,S,T]` bool of the picked entries."""
    hit = picks_bsk[..., None] == jnp.arange(n_entries)
    return jnp.any(hit, axis=-2)


class CSA2Indexer(nnx.Module):
    """Index queries from the attention's `q_res`, head weights from x; keys (Full layers only) from the
    pre-RoPE compressed latent: `k_norm(wk(latent))`, rotated at `j·m`."""

    def __init__(self, cfg: V41Config, role: LayerRole, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.role = role
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype,
                               quant=cfg.quantization)
        self.scorer = IndexerScorer(cfg, rngs=rngs, dtype=dtype)
        if role.mode == FULL:
            self.k_proj = Linear(cfg.head_dim, cfg.index_head_dim, rngs=rngs, dtype=dtype)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        else:
            self.k_proj = self.k_norm = None

    def keys(self, latent_btd: jax.Array, entry_pos_bt: jax.Array, rounding: bool) -> jax.Array:
        cos, sin = rope_table(self.cfg.rope_compress, self.cfg.head_dim, entry_pos_bt, latent_btd.dtype)
        return _round(apply_rope(self.k_norm(self.k_proj(latent_btd)), cos, sin), "mxfp4", rounding)

    def queries(self, q_res_bsr, positions_bs, rounding: bool) -> jax.Array:
        """Index queries `[B,S,heads,c]`, rotated at the token position (and rounded as released)."""
        cfg = self.cfg
        b, s, _ = q_res_bsr.shape
        q_bshc = self.q_b_proj(q_res_bsr).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
        cos, sin = rope_table(cfg.rope_compress, cfg.head_dim, positions_bs, q_bshc.dtype)
        return _round(apply_rope(q_bshc, cos[:, :, None], sin[:, :, None]), "mxfp4", rounding)

    def scores(self, x_bsh, q_res_bsr, positions_bs, keys_btc, rounding: bool) -> jax.Array:
        """Index scores `[B,S,T]`, −inf where an entry is not yet visible to the query."""
        score_bst = self.scorer(self.queries(q_res_bsr, positions_bs, rounding), keys_btc, x_bsh)
        return jnp.where(entry_visible(positions_bs, keys_btc.shape[1], self.role.ratio), score_bst, -jnp.inf)

    def cached_scores(self, x_bch, q_res_bcr, positions_bc, keys: jax.Array, rounding: bool) -> jax.Array:
        """`scores` over a cache's keys store `[B, T, c]` (rows past a slot's entries are masked as not yet
        visible), through the indexer's kernel op (`kernels.indexer`): decode and prefill chunks alike."""
        cfg = self.cfg
        q_bchc = self.queries(q_res_bcr, positions_bc, rounding)
        n_bc = num_entries(positions_bc + 1, self.role.ratio)
        return index_scores(q_bchc, self.scorer.head_weights(x_bch), keys, n_bc, cfg.index_head_dim ** -0.5,
                            kernels=self.kernels)

    def select(self, score_bst: jax.Array, positions_bs: jax.Array, shared: Shared) -> Shared:
        """The new selection (and, at the candidate source, the candidate pool) from the scores (a Reindex
        layer's restricted to the candidate pool)."""
        cfg, role = self.cfg, self.role
        candidates = shared.candidates_bsn
        with jax.named_scope("topk"):
            if role.candidate_source:
                candidates = candidate_blocks(score_bst, (positions_bs + 1) // role.ratio, cfg.candidate_topk_blocks,
                                              cfg.candidate_block_size)
            if role.uses_candidates:
                picks = picks_in_pool(score_bst, candidates, cfg.candidate_block_size, cfg.index_topk)
            else:
                picks = top_picks(score_bst, cfg.index_topk)
        return dataclasses.replace(shared, picks_bsk=picks, candidates_bsn=candidates)


class CSA2Attention(Attention):
    """One V4.1 layer's attention (`LayerRole` says which parts it owns). Shares V4's projections, sinks,
    core and output path (`layers/attention.py`)."""

    def __init__(self, cfg: V41Config, role: LayerRole, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, "csa2", rngs=rngs, dtype=dtype)
        self.role = role
        self.rope = cfg.rope_for_ratio(role.ratio)
        self.cache_rounding = True  # a numerics option (`dsjax.model_v41.with_cache_rounding`)
        # nnx.data: the V4 constructor left `compressor` a static None.
        self.compressor = nnx.data(CSA2Compressor(cfg, role.ratio, rngs=rngs, dtype=dtype) if role.mode == FULL
                                   else None)
        self.indexer = nnx.data(CSA2Indexer(cfg, role, rngs=rngs, dtype=dtype) if role.mode in (FULL, REINDEX)
                                else None)

    def __call__(self, x_bsh: jax.Array, positions_bs: jax.Array, shared: Shared,
                 record: dict | None = None) -> tuple[jax.Array, Shared]:
        """Attention over whole sequences (positions 0 … S−1); returns the output and what the layers
        after it share. `record` receives `picks`, `index_scores` and `candidates` where they exist."""
        cfg, role, rounding = self.cfg, self.role, self.cache_rounding
        cos_h, sin_h, q_res_bsr, q_bshd, kv_bsd = self._project_in(x_bsh, positions_bs)
        kv_bsd = _round(kv_bsd, "mxfp8", rounding)
        visible_bsk = window_visible(positions_bs, positions_bs, cfg.sliding_window)
        if role.ratio:
            latent = None
            if self.compressor is not None:
                latent = self.compressor(x_bsh)
                entries, keys = self._entry_rows(latent, jnp.zeros((x_bsh.shape[0],), jnp.int32))
                shared = Shared(entries_btd=entries, keys_btc=keys)
            if self.indexer is not None:
                score_bst = self.indexer.scores(x_bsh, q_res_bsr, positions_bs, shared.keys_btc, rounding)
                if record is not None:
                    record["indexer_kl"] = self._indexer_kl(x_bsh, q_res_bsr, positions_bs, q_bshd, latent, shared)
                shared = self.indexer.select(score_bst, positions_bs, shared)
                if record is not None and (role.candidate_source or role.uses_candidates):
                    pool_bst = candidate_mask(shared.candidates_bsn, score_bst.shape[-1], cfg.candidate_block_size)
                    pool_bst &= score_bst > -jnp.inf
                    if role.candidate_source:
                        record["candidates"] = pool_bst
                    else:  # the scores its top-k was taken of: inside the pool
                        score_bst = jnp.where(pool_bst, score_bst, -jnp.inf)
                if record is not None:
                    record["index_scores"] = score_bst
            if record is not None:
                record["picks"] = shared.picks_bsk
            entries = shared.entries_btd
            kv_bsd = jnp.concatenate([kv_bsd, entries.astype(kv_bsd.dtype)], axis=1)
            visible_bsk = jnp.concatenate([visible_bsk, picked_mask(shared.picks_bsk, entries.shape[1])], axis=-1)
        o_bshd = attend_with_sinks(q_bshd, kv_bsd, visible_bsk, self.sinks[...], cfg.head_dim ** -0.5)
        return self.project_out(o_bshd, cos_h, sin_h), shared

    def _indexer_kl(self, x_bsh, q_res_bsr, positions_bs, q_bshd, latent_btd, shared: Shared) -> jax.Array:
        """The indexer's distillation loss (`indexer.distillation_kl`) over the entries its picks come from (the
        candidate pool, where the layer picks inside one), on detached inputs: only the indexer learns, and a
        Full layer's own key projection with it (another layer's keys arrive detached)."""
        sg, role = jax.lax.stop_gradient, self.role
        if latent_btd is not None:
            pos_bt = jnp.arange(latent_btd.shape[1])[None, :] * role.ratio
            keys_btc = self.indexer.keys(sg(latent_btd), pos_bt, self.cache_rounding)
        else:
            keys_btc = sg(shared.keys_btc)
        score_bst = self.indexer.scores(sg(x_bsh), sg(q_res_bsr), positions_bs, keys_btc, self.cache_rounding)
        visible_bst = score_bst > -jnp.inf
        if role.uses_candidates:
            visible_bst &= candidate_mask(shared.candidates_bsn, score_bst.shape[-1], self.cfg.candidate_block_size)
        return distillation_kl(score_bst, visible_bst, q_bshd, shared.entries_btd, self.cfg.head_dim ** -0.5)

    def write_source(self, x_bch: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
                     cache: LayerCache) -> LayerCache:
        """A Full layer's compressed entries and index keys for the chunk written, nothing else computed:
        what an encoder-only prefill chunk runs of the first decoder layer (`DeepseekV41.extend`)."""
        cache, _ = self._write_source(x_bch, start_b, n_valid_b, cache)
        return cache

    def _entry_rows(self, latent_bkd: jax.Array, first_b: jax.Array, cache: LayerCache | None = None
                    ) -> tuple[jax.Array, jax.Array]:
        """(entries, index keys) of latents `[B,K,D]` for entries first … first + K − 1: rotated at `j·m` and
        rounded as released, unless they go into a `cache` whose packed storage rounds them."""
        cfg, rounding = self.cfg, self.cache_rounding
        pos_bk = (first_b[:, None] + jnp.arange(latent_bkd.shape[1])[None, :]) * self.role.ratio
        cos, sin = rope_table(cfg.rope_compress, cfg.head_dim, pos_bk, latent_bkd.dtype)
        stored, stored_keys = (False, False) if cache is None else (is_packed(cache.compressor.entries),
                                                                    is_packed(cache.keys))
        rows = _round(apply_rope(latent_bkd, cos, sin), "nvfp4", rounding and not stored)
        return rows, self.indexer.keys(latent_bkd, pos_bk, rounding and not stored_keys)

    def _write_source(self, x_bch, start_b, n_valid_b, cache: LayerCache,
                      undo: dict | None = None) -> tuple[LayerCache, Shared]:
        finish = lambda latent, first_b: self._entry_rows(latent, first_b, cache)  # noqa: E731
        state, new_keys, first_b, count_b = self.compressor.extend(x_bch, start_b, n_valid_b, cache.compressor,
                                                                   finish, undo)
        cache = dataclasses.replace(cache, compressor=state, keys=write_entries(cache.keys, new_keys, first_b, count_b))
        return cache, Shared(entries_btd=state.entries, keys_btc=cache.keys)

    def extend(self, x_bch: jax.Array, start_b: jax.Array, n_valid_b: jax.Array, shared: Shared,
               cache: LayerCache, floor_b: jax.Array | None = None,
               undo: dict | None = None) -> tuple[jax.Array, Shared, LayerCache]:
        """Cached attention for C new tokens per row at positions start … start + C − 1 (the first n_valid
        real; n_valid = 0 leaves the row's cache unchanged), through the sparse attention operations
        (`kernels.sparse_attention`): keys are the window ring and the chunk, and the picked entries of
        the KV source's store, which a Full layer writes here and `Shared` carries to the layers after it.
        `floor_b` hides window positions below it from the chunk's queries (bounded replay). `undo`, if given,
        receives what taking back the chunk's later rows needs (`DeepseekV41.rewind`): the ring rows it overwrites
        (`ring`) and the compressor's `windows`."""
        cfg, role, rounding = self.cfg, self.role, self.cache_rounding
        c_len = x_bch.shape[1]
        if undo is not None:
            undo["ring"] = overwritten_rows(cache.window, start_b, c_len)
        positions_bc = start_b[:, None] + jnp.arange(c_len)[None, :]
        cos_h, sin_h, q_res_bcr, q_bchd, kv_bcd = self._project_in(x_bch, positions_bc)
        kv_bcd = _round(kv_bcd, "mxfp8", rounding and not is_packed(cache.window))  # packing rounds them alike
        keys, window = extend_window(cache.window, kv_bcd, start_b, n_valid_b, floor_b)
        cache = dataclasses.replace(cache, window=window)
        entries, picks = None, None
        if role.ratio:
            if self.compressor is not None:
                cache, shared = self._write_source(x_bch, start_b, n_valid_b, cache, undo)
            if self.indexer is not None:
                with jax.named_scope("indexer"):
                    score_bct = self.indexer.cached_scores(x_bch, q_res_bcr, positions_bc, shared.keys_btc,
                                                           rounding)
                    shared = self.indexer.select(score_bct, positions_bc, shared)
            entries, picks = shared.entries_btd, shared.picks_bsk
        scale = cfg.head_dim ** -0.5
        if c_len == 1:
            o_bhd = sparse_decode(q_bchd[:, 0], keys.rows, keys.end_bc[:, 0], entries, self.sinks[...], scale,
                                  idx_bk=None if picks is None else picks[:, 0], kernels=self.kernels)
            o_bchd = o_bhd[:, None]
        else:
            o_bchd = sparse_prefill(q_bchd, keys.rows, keys.start_bc, keys.end_bc, entries, self.sinks[...], scale,
                                    idx_bck=picks, kernels=self.kernels)
        return self.project_out(o_bchd, cos_h, sin_h), shared, cache
