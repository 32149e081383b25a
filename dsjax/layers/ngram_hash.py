"""Engram's n-gram hashing on the device: the table rows `dsjax.engram_hash.EngramHasher.rows` computes on
the host, from the same tables, in 32-bit integer arithmetic (jax has no int64 unless x64 is on).

The hash is `XOR_r slot_r · m_r` over 64 bits, then `mod prime + offset` per head. A slot holds a
compressed id (< 2^17), so every product `c · m_r` is precomputed per compressed id as two uint32
halves; XOR works on the halves; the remainder reads the 64 bits a byte at a time (`acc = (acc·256 +
byte) mod p` stays below 2^32 for primes up to 2^24, which the release's are: about 1.6 × 10^7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.layers.variables import Buffer

_MAX_PRIME = 1 << 24


def default_token_map(vocab_size: int, compressed_vocab_size: int) -> np.ndarray:
    """A token map for a model built without a tokenizer (random weights): id mod the compressed size."""
    return (np.arange(vocab_size) % compressed_vocab_size).astype(np.int64)


class NgramHash(nnx.Module):
    """The hash tables as (non-trainable) buffers: `token_map [V]`, the products' halves
    `[layers, max_ngram, compressed]`, `primes`/`offsets` `[layers, heads]`. Build it from an
    `EngramHasher` (the host's tables) so the two agree by construction."""

    def __init__(self, hasher):
        if int(hasher.primes.max()) >= _MAX_PRIME:
            raise ValueError(f"Engram bucket prime {int(hasher.primes.max())} is not below 2^24; the device hash "
                             "handles primes below 2^24 (the release's are about 1.6e7)")
        ids = np.arange(hasher.compressed_vocab_size, dtype=np.uint64)
        products = ids[None, None, :] * hasher.multipliers.astype(np.uint64)[:, :, None]
        self.token_map = Buffer(jnp.asarray(hasher.token_map, jnp.int32))
        self.product_hi = Buffer(jnp.asarray((products >> np.uint64(32)).astype(np.uint32)))
        self.product_lo = Buffer(jnp.asarray((products & np.uint64(0xFFFFFFFF)).astype(np.uint32)))
        self.primes = Buffer(jnp.asarray(hasher.primes, jnp.uint32))
        self.offsets = Buffer(jnp.asarray(hasher.offsets, jnp.int32))
        self.pad_id = hasher.pad_id
        self.n_heads = hasher.n_heads
        self.history_len = hasher.history_len

    def compress(self, token_ids: jax.Array, live: jax.Array) -> jax.Array:
        """Compressed ids, −1 for tokens that are not live (they block the look-back)."""
        return jnp.where(live, jnp.take(self.token_map[...], token_ids, mode="clip"), -1)

    def __call__(self, token_ids_bc: jax.Array, history_bk: jax.Array, live_bc: jax.Array) -> jax.Array:
        """int32 `[B, C, layers, heads]` table rows of a chunk; `history_bk` holds the compressed ids of the
        `max_ngram − 1` tokens before it, oldest first, −1 where none (sequence start) or dead."""
        k, c = self.history_len, token_ids_bc.shape[1]
        seq = jnp.concatenate([history_bk.astype(jnp.int32), self.compress(token_ids_bc, live_bc)], axis=1)
        blocked = jnp.zeros(token_ids_bc.shape, bool)
        hi = lo = None
        out = []
        for r in range(k + 1):
            src = seq[:, k - r: k - r + c]
            blocked = blocked | (src < 0)
            slot = jnp.where(blocked, self.pad_id, src)
            p_hi = jnp.take(self.product_hi[...][:, r], slot, axis=1)  # [layers, B, C]
            p_lo = jnp.take(self.product_lo[...][:, r], slot, axis=1)
            hi, lo = (p_hi, p_lo) if r == 0 else (hi ^ p_hi, lo ^ p_lo)
            if r == 0:
                continue
            heads = slice((r - 1) * self.n_heads, r * self.n_heads)
            primes = self.primes[...][:, heads][:, None, None, :]  # [layers, 1, 1, heads]
            rows = _mod64(hi[..., None], lo[..., None], primes).astype(jnp.int32)
            out.append(rows + self.offsets[...][:, heads][:, None, None, :])
        rows_lbch = jnp.concatenate(out, axis=-1)
        return jnp.transpose(rows_lbch, (1, 2, 0, 3))

    def next_history(self, token_ids_bc: jax.Array, history_bk: jax.Array, live_bc: jax.Array,
                     n_valid_b: jax.Array) -> jax.Array:
        """The history after each row's first `n_valid` chunk tokens (its last `max_ngram − 1` compressed ids)."""
        seq = jnp.concatenate([history_bk.astype(jnp.int32), self.compress(token_ids_bc, live_bc)], axis=1)
        cols = n_valid_b[:, None] + jnp.arange(self.history_len)[None, :]
        return jnp.take_along_axis(seq, cols, axis=1)


def _mod64(hi: jax.Array, lo: jax.Array, p: jax.Array) -> jax.Array:
    """`(hi·2^32 + lo) mod p` for uint32 halves and uint32 p < 2^24, a byte at a time from the top."""
    acc = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
    for word in (hi, lo):
        for shift in (24, 16, 8, 0):
            byte = (word >> shift) & 0xFF
            acc = (acc * 256 + byte) % p
    return acc
