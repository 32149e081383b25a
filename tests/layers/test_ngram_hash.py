"""Engram's hash on the device (`layers/ngram_hash.py`) equals the host's `EngramHasher.rows` bit for bit, whole
and chunk by chunk (the look-back carried in `next_history`), with dead tokens, for the tiny preset's
tokenizer and the release's sizes; primes it cannot handle are refused; `_mod64` is exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config_v41 import V41Config
from dsjax.engram_hash import EngramHasher, compressed_token_map
from dsjax.layers.ngram_hash import NgramHash, _mod64, default_token_map
from dsjax.presets import tiny_v41_vocabulary


def _tiny_hasher() -> EngramHasher:
    vocab = tiny_v41_vocabulary()
    token_map, size = compressed_token_map(vocab, vocab)  # a WordLevel vocabulary decodes to itself
    cfg = V41Config.preset("tiny-v4.1")
    assert size == cfg.engram_compressed_vocab_size
    return EngramHasher.from_config(cfg, token_map)


def _release_hasher() -> EngramHasher:
    cfg = V41Config.preset("v4.1-flash")
    return EngramHasher.from_config(cfg, default_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size))


HASHERS = {"tiny": _tiny_hasher, "release": _release_hasher}
_BUILT: dict = {}


def _get(name) -> tuple[EngramHasher, NgramHash]:
    if name not in _BUILT:
        hasher = HASHERS[name]()
        _BUILT[name] = hasher, NgramHash(hasher)
    return _BUILT[name]


_hash = jax.jit(lambda h, ids, hist, live: h(ids, hist, live))
_next = jax.jit(lambda h, ids, hist, live, n: h.next_history(ids, hist, live, n))


def _inputs(hasher, rng, b, s):
    """Random ids and liveness: about one token in eight dead, plus a dead run (an image span) in row 0."""
    ids = rng.integers(0, hasher.token_map.size, (b, s))
    live = rng.random((b, s)) > 0.125
    live[0, 5:11] = False
    return ids, live


def _start(ngram, b):
    return jnp.full((b, ngram.history_len), -1, jnp.int32)


@pytest.mark.parametrize("name", list(HASHERS))
def test_whole_sequence_equals_host(name):
    hasher, ngram = _get(name)
    rng = np.random.default_rng(0)
    ids, live = _inputs(hasher, rng, 3, 40)
    want = hasher.rows(ids, live=live)
    got = np.asarray(_hash(ngram, jnp.asarray(ids, jnp.int32), _start(ngram, 3), jnp.asarray(live)))
    assert got.dtype == np.int32 and got.shape == want.shape == (3, 40, len(hasher.layer_ids), hasher.hash_heads)
    np.testing.assert_array_equal(got, want)
    # Every row lies in its own (order, head) bucket.
    lo = hasher.offsets[None, None]
    assert ((got >= lo) & (got < lo + hasher.primes[None, None])).all()


@pytest.mark.parametrize("name", list(HASHERS))
def test_all_live_and_all_dead(name):
    """No dead tokens at all, and a row of only dead tokens (every slot the pad id: one row per head)."""
    hasher, ngram = _get(name)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, hasher.token_map.size, (2, 12))
    live = np.ones((2, 12), bool)
    live[1] = False
    got = np.asarray(_hash(ngram, jnp.asarray(ids, jnp.int32), _start(ngram, 2), jnp.asarray(live)))
    np.testing.assert_array_equal(got, hasher.rows(ids, live=live))
    assert (got[1] == got[1, :1]).all()  # dead everywhere: the all-pad window at every position
    np.testing.assert_array_equal(got[1, 0], hasher.rows(np.full((1, 1), 2))[0, 0])  # = a lone pad token (raw 2)


@pytest.mark.parametrize("name", list(HASHERS))
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_equals_whole(name, chunk):
    """Rows advance independently through chunks of `chunk` tokens: some steps a row takes fewer (or none),
    its unused chunk columns holding junk ids and junk liveness; `next_history` carries each row's look-back.
    Every real token's rows equal the host's rows of the whole sequence, and the carried history is the host's
    `next_history` (raw ids) compressed."""
    hasher, ngram = _get(name)
    rng = np.random.default_rng(10 + chunk)
    b, s = 3, 23
    ids, live = _inputs(hasher, rng, b, s)
    want = hasher.rows(ids, live=live)
    got = np.full(want.shape, -1, np.int64)
    hist = _start(ngram, b)
    pos = np.zeros(b, int)
    steps = 0
    while (pos < s).any():
        n = np.minimum(rng.integers(0, chunk + 1, b), s - pos)
        if steps % 3 == 0:  # the first row takes whole chunks while it can
            n[0] = min(chunk, s - pos[0])
        if not n.any():
            continue
        junk_ids = rng.integers(0, hasher.token_map.size, (b, chunk))
        junk_live = rng.random((b, chunk)) > 0.5
        for r in range(b):
            junk_ids[r, :n[r]] = ids[r, pos[r]:pos[r] + n[r]]
            junk_live[r, :n[r]] = live[r, pos[r]:pos[r] + n[r]]
        c_ids, c_live = jnp.asarray(junk_ids, jnp.int32), jnp.asarray(junk_live)
        rows = np.asarray(_hash(ngram, c_ids, hist, c_live))
        hist = _next(ngram, c_ids, hist, c_live, jnp.asarray(n, jnp.int32))
        for r in range(b):
            got[r, pos[r]:pos[r] + n[r]] = rows[r, :n[r]]
        pos += n
        steps += 1
        # The carried look-back is the host's, as compressed ids (−1: before the start, or dead).
        host_ids, host_live = hasher.next_history(ids, live=live, lengths=pos)
        want_hist = np.where(host_live, hasher.token_map[np.where(host_live, host_ids, 0)], -1)
        np.testing.assert_array_equal(np.asarray(hist), want_hist, err_msg=f"history after step {steps}")
    assert steps > s // chunk  # some steps were partial
    np.testing.assert_array_equal(got, want)


def test_history_blocks_the_look_back():
    """A dead token in the carried history blocks the slots behind it exactly as inside a chunk: hashing a
    chunk after a history equals hashing history + chunk whole."""
    hasher, ngram = _get("tiny")
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 256, (4, 9))
    live = np.ones((4, 9), bool)
    live[1, 2] = False  # dead inside the history (oldest slot but one)
    live[2, 1] = False  # dead as the history's oldest real token
    live[3, 0] = False
    k = ngram.history_len
    head = ids[:, :3 + k][:, -k:]
    hist = np.where(live[:, 3:3 + k], hasher.token_map[head], -1)
    got = np.asarray(_hash(ngram, jnp.asarray(ids[:, 3 + k:], jnp.int32), jnp.asarray(hist, jnp.int32),
                           jnp.asarray(live[:, 3 + k:])))
    np.testing.assert_array_equal(got, hasher.rows(ids[:, 3:], live=live[:, 3:])[:, k:])


# ------------------------------------------------------------------------------------------- primes

def _one_prime_hasher(vocab_size: int) -> EngramHasher:
    return EngramHasher(layer_ids=[0], num_embeddings=[vocab_size + 1000], max_ngram_size=2, vocab_size=vocab_size,
                        n_heads=1, pad_token_id=2, compressed_vocab_size=5, token_map=np.array([0, 1, 2, 3, 4, 3]))


def test_a_prime_of_2_24_or_more_is_refused():
    hasher = _one_prime_hasher(1 << 24)
    assert int(hasher.primes.max()) == 16777259  # the first prime above 2^24 − 1
    with pytest.raises(ValueError, match=r"Engram bucket prime 16777259 is not below 2\^24"):
        NgramHash(hasher)


def test_the_largest_prime_below_2_24_is_exact():
    """16777213 = 2^24 − 3, the largest prime below 2^24, is accepted, and rows near the top of its range are
    the host's."""
    hasher = _one_prime_hasher(16777213)
    assert hasher.primes.tolist() == [[16777213]]
    ngram = NgramHash(hasher)
    ids = np.random.default_rng(2).integers(0, 6, (2, 50))
    live = np.random.default_rng(3).random((2, 50)) > 0.2
    got = np.asarray(ngram(jnp.asarray(ids, jnp.int32), _start(ngram, 2), jnp.asarray(live)))
    np.testing.assert_array_equal(got, hasher.rows(ids, live=live))


# ------------------------------------------------------------------------------------------- _mod64

def test_mod64_against_python_integers():
    rng = np.random.default_rng(7)
    n = 4000
    hi = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    lo = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    hi[:4] = [0, 0xFFFFFFFF, 0xFFFFFFFF, 0]  # edges: 0..2^32, 2^64 − 1
    lo[:4] = [0, 0xFFFFFFFF, 0, 0xFFFFFFFF]
    primes = np.array([2, 3, 53, 65521, 9999991, 16000057, 16777199, 16777213], np.uint32)
    p = np.concatenate([primes, rng.choice(primes, n - len(primes))])
    got = np.asarray(jax.jit(_mod64)(jnp.asarray(hi), jnp.asarray(lo), jnp.asarray(p)))
    want = [((int(h) << 32) | int(w)) % int(q) for h, w, q in zip(hi, lo, p)]
    assert got.dtype == np.uint32
    assert got.tolist() == want


def test_mod64_broadcasts_over_primes():
    hi = jnp.asarray([[0x12345678], [0xDEADBEEF]], jnp.uint32)
    lo = jnp.asarray([[0x9ABCDEF0], [0x0BADF00D]], jnp.uint32)
    p = jnp.asarray([[16777213, 53, 7]], jnp.uint32)
    got = np.asarray(_mod64(hi, lo, p))
    want = [[((h << 32) | w) % q for q in (16777213, 53, 7)]
            for h, w in ((0x12345678, 0x9ABCDEF0), (0xDEADBEEF, 0x0BADF00D))]
    assert got.tolist() == want
