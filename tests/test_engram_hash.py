"""Engram's host side (`dsjax.engram_hash`): normalisation, per-id decoding, token compression, bucket
primes, multipliers and the n-gram rows, against hand-derived cases, a literal scalar reading of spec
§2.8, the release's table sizes and the tiny V4.1 preset."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsjax import engram_hash as eh
from dsjax.presets import PRESETS, tiny_v41_vocabulary

INT64_MAX = 2**63 - 1

RELEASE = {  # the release's text_config Engram keys (spec §1.4)
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
}


def _is_prime_by_trial(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _primes_above(start: int, count: int) -> list[int]:
    out, n = [], start + 1
    while len(out) < count:
        if _is_prime_by_trial(n):
            out.append(n)
        n += 1
    return out


# ---------------------------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("text, key", [
    ("the", "the"),
    (" The", "the"),
    (" THE", "the"),
    (" Résumé", "resume"),  # precomposed é: decomposed, accent dropped
    ("cafe\u0301", "cafe"),  # already decomposed
    ("ｃａｔ", "cat"),  # full-width letters: NFKC
    ("ﬁre", "fire"),  # ligature: NFKC
    ("x²", "x2"),
    ("한", "\u1112\u1161\u11ab"),  # Hangul syllable → conjoining jamo (letters, not marks)
    ("İ", "i"),  # decomposes to I + U+0307, the dot is stripped before lowercasing
    ("\u1e9e", "ß"),  # capital sharp s: no decomposition, lowercases to ß
    ("ΟΔΟΣ", "οδοσ"),  # per-character lowercase: no final-sigma rule
    ("a  b\t\tc\r\n", "a b c"),  # runs of [ \t\r\n] → one space, then strip
    (" ", " "), ("  ", " "), ("\n", " "), ("\t", " "), (" \n ", " "),  # a lone space survives
    ("\u00a0", " "),  # NBSP → space under NFKC, then the lone-space rule
    ("\u3000a\u2002", "a"),  # ideographic / en space → space, stripped
    ("\x0b", ""), ("\x0ca\x0c", "a"), ("\u2028", ""),  # White_Space but not [ \t\r\n]: stripped only at the ends
    ("a\u2028\u2028b", "a\u2028\u2028b"),  # … and not collapsed inside
    ("\x1c", "\x1c"), ("\x1fa\x1f", "\x1fa\x1f"),  # Python's isspace() says yes, Unicode White_Space no
    ("\u200b", "\u200b"),  # zero-width space is not White_Space
    ("\ue000", " "), ("x\ue000", "x "),  # the sentinel itself turns into a space, after Strip
    ("\u0301", ""),  # a lone combining mark vanishes
    ("", ""),
])
def test_normalize_token_cases(text, key):
    assert eh.normalize_token(text) == key


@pytest.mark.parametrize("text, key", [
    # tokenizers' NFKC/NFD/StripAccents use Unicode 9.0.0 tables: later characters are inert there.
    ("\ua7f2", "\ua7f2"),  # MODIFIER LETTER CAPITAL C (Unicode 14; <super> C in newer tables)
    ("\U0001e030", "\U0001e030"),  # MODIFIER LETTER CYRILLIC SMALL A (Unicode 15; <super> а)
    ("\u32ff", "\u32ff"),  # SQUARE ERA NAME REIWA (Unicode 12; <square> 令和)
    ("a\u0898", "a\u0898"),  # an Arabic mark of Unicode 14 is not stripped
    ("a\u1ac1", "a\u1ac1"),  # a combining mark of Unicode 14 is not stripped
    ("\u1cf2x", "x"),  # U+1CF2 was a mark (Mc) in 9.0, a letter (Lo) since: stripped
    ("\u0301\u1ac1\u0300", "\u1ac1"),  # marks around a post-9.0 one: 9.0 marks go, it stays
    # Lowercase follows tokenizers' Rust tables, which know letters newer than Python 3.12's Unicode 15.
    ("\ua7dc", "\u019b"),  # LATIN CAPITAL LETTER LAMBDA WITH STROKE (Unicode 16)
    ("\U00010d50", "\U00010d70"),  # GARAY CAPITAL LETTER A (Unicode 16)
])
def test_normalize_token_follows_tokenizers_unicode_tables(text, key):
    assert eh.normalize_token(text) == key


def test_normalize_token_is_idempotent_on_ascii():
    for text in ["Hello World", "  MiXeD\tcase \n", "x", "--", "A.B"]:
        once = eh.normalize_token(text)
        assert once == " ".join(text.lower().split())
        assert eh.normalize_token(once) == once


# ---------------------------------------------------------------------------------------------- decoding

def _byte_level_tokenizer(vocab: dict[str, int], added: list[tuple[int, str]] = ()) -> dict:
    return {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "added_tokens": [{"id": i, "content": c, "special": True} for i, c in added]}


def test_token_texts_byte_level():
    # GPT-2's byte alphabet, by hand: space 0x20 → 'Ġ' U+0120, '\n' 0x0A → 'Ċ' U+010A; 0xC3 'Ã' and 0xA9 '©'
    # stand for themselves; 0x80 → 'Ģ' U+0122, 0x98 → 'ĺ' U+013A, 0x9F → 'Ł' U+0141, 0xA0 → 'ł' U+0142.
    vocab = {"<s>": 0, "Ġthe": 1, "Ċ": 2, "Ã©": 3, "Ã": 4, "ðŁĺ": 5, "íłĢ": 6, "À¯": 7, "<think>": 8}
    # Added tokens: one the model has (its model id stands), new ones numbered from the vocabulary's
    # size on in file order (their stated ids are not what tokenizers uses), an empty one skipped.
    added = [(9, "<｜begin▁of▁sentence｜>"), (0, "<s>"), (3, "a b"), (11, ""), (12, "<｜pad｜>")]
    texts, raw = eh.token_texts(_byte_level_tokenizer(vocab, added))
    assert raw == ["<s>", "Ġthe", "Ċ", "Ã©", "Ã", "ðŁĺ", "íłĢ", "À¯", "<think>",
                   "<｜begin▁of▁sentence｜>", "a b", "<｜pad｜>"]
    assert texts == [
        "<s>",  # printable ASCII stands for itself
        " the", "\n", "é",
        "\ufffd",  # C3 alone: truncated sequence
        "\ufffd",  # F0 9F 98: one maximal invalid subsequence, one U+FFFD
        "\ufffd\ufffd\ufffd",  # ED A0 80 (a surrogate): ED cannot take A0, so three
        "\ufffd\ufffd",  # C0 AF (overlong): C0 is never valid, then a stray continuation byte
        "<think>",
        "<｜begin▁of▁sentence｜>",  # characters outside the alphabet: the token's own text
        "a b",  # ' ' is not in the alphabet (it is spelt 'Ġ'): the token's own text
        "<｜pad｜>",
    ]


def test_token_texts_word_level_and_refusals():
    vocab = {"<pad>": 0, "Hello": 1, " x": 2}
    tok = {"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"}, "decoder": None,
           "added_tokens": [{"id": 3, "content": "<img>", "special": True}]}
    assert eh.token_texts(tok) == (["<pad>", "Hello", " x", "<img>"], ["<pad>", "Hello", " x", "<img>"])
    with pytest.raises(ValueError, match="Unigram"):
        eh.token_texts({"model": {"type": "Unigram", "vocab": []}})
    with pytest.raises(ValueError, match="Metaspace"):
        eh.token_texts({**tok, "decoder": {"type": "Metaspace"}})
    with pytest.raises(ValueError, match="id 1 has no token"):
        eh.token_texts({**tok, "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 2}}, "added_tokens": []})


# ---------------------------------------------------------------------------------------------- compression

def test_compressed_token_map_by_hand():
    texts = ["The", " the", "\ufffd", "\ufffd", "  ", "\n", "", "\u0301", "\x0b", "b", "x\ufffd", "THE"]
    raw = ["The", "Ġthe", "Ã", "Ä", "ĠĠ", "Ċ", "", "Ì\u0081", "\x0b", "b", "xÃ", "THE"]
    # keys: the, the, Ã (raw), Ä (raw), " ", " ", "" (nothing to normalise), U+0301 and \x0b (normalise to
    # nothing, keyed by their text), b, xÃ (raw), the
    token_map, size = eh.compressed_token_map(texts, raw)
    assert token_map.tolist() == [0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 0]
    assert size == 9
    with pytest.raises(ValueError, match="differ in length"):
        eh.compressed_token_map(texts, raw[:-1])


def _tiny_tokenizer() -> dict:
    vocab = tiny_v41_vocabulary()
    return {"model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": vocab[2]},
            "decoder": None, "added_tokens": [{"id": i, "content": vocab[i], "special": True} for i in (0, 1, 2, 255)]}


def test_tiny_preset_vocabulary_compresses_to_its_stated_size():
    # By hand: 3 specials, 40 words (each word's 4-6 spellings and the full-width / ligature forms share
    # its key), 1 whitespace key, 8 punctuation marks, "\ufffd" and "a\ufffd", 3 quote/dash, 10 digits,
    # 55 <tokN> fillers, the image token: 123.
    token_map, size = eh.tokenizer_token_map(_tiny_tokenizer())
    assert size == 123 == PRESETS["tiny-v4.1"]["text_config"]["engram_compressed_vocab_size"]
    vocab = tiny_v41_vocabulary()
    same = lambda a, b: token_map[vocab.index(a)] == token_map[vocab.index(b)]  # noqa: E731
    assert same("cat", "ｃａｔ") and same("the", "ＴＨＥ") and same("fire", "ﬁre") and same("cafe", " Café")
    assert same(" ", "\n") and same(" ", " \n ") and not same("\ufffd", "a\ufffd") and not same("a", "a\ufffd")


def test_deepseek_tokenizer_compressed_size():
    from dsjax.training.tokenizer import deepseek_v4_tokenizer_path

    with open(deepseek_v4_tokenizer_path(), encoding="utf-8") as f:
        tok = json.load(f)
    texts, raw = eh.token_texts(tok)
    assert len(texts) == 129280
    assert texts[0] == "<｜begin▁of▁sentence｜>" and raw[2] == "<｜▁pad▁｜>"
    token_map, size = eh.compressed_token_map(texts, raw)
    # The package ships V4's tokenizer.json; it compresses to the release's V4.1 figure all the same.
    assert size == 99092
    assert token_map.shape == (129280,) and token_map.max() == size - 1


# ---------------------------------------------------------------------------------------------- buckets

def test_tiny_preset_primes_and_table_sizes():
    cfg = PRESETS["tiny-v4.1"]["text_config"]
    hasher = eh.EngramHasher.from_config(PRESETS["tiny-v4.1"], eh.tokenizer_token_map(_tiny_tokenizer())[0])
    # Primes above 49, 2 per order, orders 2-4, each used once: layer 1 takes the first six, layer 3 the next.
    assert hasher.primes.tolist() == [[53, 59, 61, 67, 71, 73], [79, 83, 89, 97, 101, 103]]
    assert hasher.primes.sum(axis=1).tolist() == cfg["engram_num_embeddings"] == [384, 552]
    assert hasher.offsets.tolist() == [[0, 53, 112, 173, 240, 311], [0, 79, 162, 251, 348, 449]]
    assert hasher.pad_id == 2  # the pad token's key is new when it is met


def test_release_primes():
    hasher = eh.EngramHasher.from_config(RELEASE, np.arange(99092))
    assert hasher.primes.shape == (2, 24)
    assert hasher.primes.sum(axis=1).tolist() == [384006168, 384016682]
    # Each order restarts at 15999999 and takes the next unused primes, so the layers' orders take
    # consecutive runs of 8 from the ascending primes above it.
    expected = np.array(_primes_above(15999999, 48)).reshape(2, 24)
    assert (hasher.primes == expected).all()
    assert (hasher.offsets[:, 0] == 0).all() and (hasher.offsets[:, 1:] == np.cumsum(expected, 1)[:, :-1]).all()


def test_release_multipliers():
    hasher = eh.EngramHasher.from_config({"text_config": RELEASE}, np.arange(99092))
    bound = (INT64_MAX // 99092) // 2
    for row, layer in zip(hasher.multipliers, [1, 14]):
        drawn = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert row.tolist() == [2 * int(v) + 1 for v in drawn]
        # odd, and a product with any compressed id fits in int64
        assert all(m % 2 == 1 and m * 99091 <= INT64_MAX for m in row.tolist())


def test_bad_configs_name_the_problem():
    small = {**RELEASE, "engram_num_embeddings": [384006168, 384016681]}
    with pytest.raises(ValueError, match=r"layer 14 needs 384016682 table rows .* gives it 384016681"):
        eh.EngramHasher.from_config(small, np.arange(99092))
    with pytest.raises(ValueError, match=r"99091 compressed ids but engram_compressed_vocab_size is 99092"):
        eh.EngramHasher.from_config(RELEASE, np.arange(99091))
    with pytest.raises(ValueError, match="one row count for each"):
        eh.EngramHasher.from_config({**RELEASE, "engram_num_embeddings": [384006168]}, np.arange(99092))
    with pytest.raises(ValueError, match="engram_pad_token_id 5"):
        eh.EngramHasher.from_config({**RELEASE, "engram_pad_token_id": 5, "engram_compressed_vocab_size": 3},
                                    np.array([0, 1, 2]))


# ---------------------------------------------------------------------------------------------- rows

def _small_hasher(**overrides) -> eh.EngramHasher:
    # 7 raw ids onto 5 compressed ids; pad (raw 2) compresses to 2; buckets: primes above 9.
    args = dict(layer_ids=[1, 3], num_embeddings=[100, 150], max_ngram_size=3, vocab_size=10, n_heads=2,
                pad_token_id=2, compressed_vocab_size=5, token_map=np.array([0, 1, 2, 3, 4, 3, 0]))
    return eh.EngramHasher(**{**args, **overrides})


def _reference_rows(hasher, seq, live) -> np.ndarray:
    """Spec §2.8 read literally, one token at a time, in Python integers: slot r of position p is the
    compressed id of token p − r unless the sequence start or a dead token lies within r steps back."""
    out = np.zeros((len(seq), len(hasher.layer_ids), hasher.hash_heads), np.int64)
    for p in range(len(seq)):
        slots, blocked = [], False
        for r in range(hasher.max_ngram_size):
            blocked = blocked or p - r < 0 or not live[p - r]
            slots.append(hasher.pad_id if blocked else int(hasher.token_map[seq[p - r]]))
        for li in range(len(hasher.layer_ids)):
            m = [int(x) for x in hasher.multipliers[li]]
            h = slots[0] * m[0]
            for n in range(2, hasher.max_ngram_size + 1):
                h ^= slots[n - 1] * m[n - 1]
                for head in range(hasher.n_heads):
                    j = (n - 2) * hasher.n_heads + head
                    out[p, li, j] = h % int(hasher.primes[li, j]) + int(hasher.offsets[li, j])
    return out


def test_small_hasher_buckets():
    hasher = _small_hasher()
    assert hasher.primes.tolist() == [[11, 13, 17, 19], [23, 29, 31, 37]]
    assert hasher.offsets.tolist() == [[0, 11, 24, 41], [0, 23, 52, 83]]
    assert hasher.pad_id == 2 and hasher.history_len == 2


def test_rows_by_hand():
    hasher = _small_hasher()
    (m0, m1, m2), _ = hasher.multipliers.tolist()
    pad = 2
    # raw [5, 1, 4, 6] compress to [3, 1, 4, 0]; token 2 is dead (an image token, say)
    rows = hasher.rows(np.array([[5, 1, 4, 6]]), live=np.array([[True, True, False, True]]))
    assert rows.shape == (1, 4, 2, 4) and rows.dtype == np.int32
    windows = [(3, pad, pad), (1, 3, pad), (pad, pad, pad), (0, pad, pad)]  # (slot 0, slot 1, slot 2)
    for p, (s0, s1, s2) in enumerate(windows):
        h2 = (s0 * m0) ^ (s1 * m1)
        h3 = h2 ^ (s2 * m2)
        assert rows[0, p, 0].tolist() == [h2 % 11, h2 % 13 + 11, h3 % 17 + 24, h3 % 19 + 41]


def test_rows_match_the_literal_reading():
    rng = np.random.default_rng(0)
    for hasher in (_small_hasher(), _small_hasher(max_ngram_size=4, num_embeddings=[200, 300]),
                   _small_hasher(max_ngram_size=2, n_heads=3, layer_ids=[0], num_embeddings=[100])):
        for _ in range(20):
            s = int(rng.integers(1, 30))
            seq = rng.integers(0, 7, s)
            live = rng.random(s) > 0.2
            got = hasher.rows(seq[None], live=live[None])[0]
            assert (got == _reference_rows(hasher, seq, live)).all()
            assert (got >= 0).all() and (got < np.array(hasher.num_embeddings)[:, None]).all()


def test_release_rows_stay_in_range():
    hasher = eh.EngramHasher.from_config(RELEASE, np.arange(129280) % 99092)
    rng = np.random.default_rng(1)
    seq = np.concatenate([rng.integers(0, 129280, 500), [99091 + 0, 129279] * 10])  # high compressed ids too
    rows = hasher.rows(seq[None])[0]
    assert (rows == _reference_rows(hasher, seq, np.ones(seq.size, bool))).all()
    for li, n_rows in enumerate(RELEASE["engram_num_embeddings"]):
        bucket = rows[:, li]
        assert (bucket >= hasher.offsets[li]).all() and (bucket < hasher.offsets[li] + hasher.primes[li]).all()
        assert bucket.max() < n_rows


def test_chunked_rows_equal_whole_rows():
    hasher = _small_hasher(max_ngram_size=4, num_embeddings=[200, 300])
    rng = np.random.default_rng(2)
    b, s = 3, 41
    seq = rng.integers(0, 7, (b, s))
    live = rng.random((b, s)) > 0.15
    whole = hasher.rows(seq, live=live)
    for cuts in ([1, 2, 3, 10, 40], [20], [5, 6, 7, 8, 9], list(range(1, s))):  # chunks down to one token
        history = history_live = None
        parts = []
        for lo, hi in zip([0, *cuts], [*cuts, s]):
            parts.append(hasher.rows(seq[:, lo:hi], history, live[:, lo:hi], history_live))
            history, history_live = hasher.next_history(seq[:, lo:hi], history, live[:, lo:hi], history_live)
        assert (np.concatenate(parts, axis=1) == whole).all()


def test_chunked_rows_with_ragged_rows():
    # An engine's batch: each row's chunk holds `lengths[b]` tokens, then padding (dead, any id).
    hasher = _small_hasher(max_ngram_size=4, num_embeddings=[200, 300])
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 7, n) for n in (9, 1, 14)]
    lives = [rng.random(len(q)) > 0.1 for q in seqs]
    history, history_live = None, None
    got = [[] for _ in seqs]
    pos = [0, 0, 0]
    while any(p < len(q) for p, q in zip(pos, seqs)):
        take = [min(int(rng.integers(1, 5)), len(q) - p) for p, q in zip(pos, seqs)]
        width = max(max(take), 1)
        ids = np.full((3, width), -7)  # padding ids are never looked up
        live = np.zeros((3, width), bool)
        for i, (p, t) in enumerate(zip(pos, take)):
            ids[i, :t], live[i, :t] = seqs[i][p:p + t], lives[i][p:p + t]
        rows = hasher.rows(ids, history, live, history_live)
        for i, t in enumerate(take):
            got[i].append(rows[i, :t])
        history, history_live = hasher.next_history(ids, history, live, history_live, lengths=np.array(take))
        pos = [p + t for p, t in zip(pos, take)]
    for q, lv, g in zip(seqs, lives, got):
        assert (np.concatenate(g) == hasher.rows(q[None], live=lv[None])[0]).all()


def test_history_carries_liveness_and_sequence_start():
    hasher = _small_hasher()
    tail = hasher.rows(np.array([[4]]))
    # no history, -1s, and dead history entries are all "nothing before"
    assert (hasher.rows(np.array([[4]]), np.array([[-1, -1]])) == tail).all()
    assert (hasher.rows(np.array([[4]]), np.array([[3, 1]]), history_live=np.array([[True, False]])) == tail).all()
    # a dead entry (its id unread) blocks the live one before it: nothing before
    assert (hasher.rows(np.array([[4]]), np.array([[3, 99]]), history_live=np.array([[True, False]])) == tail).all()
    with_one = hasher.rows(np.array([[4]]), np.array([[-1, 1]]))
    assert (with_one == hasher.rows(np.array([[1, 4]]))[:, 1:]).all()
    history, history_live = hasher.next_history(np.array([[6, 4]]), np.array([[-1, 1]]))
    assert history.tolist() == [[6, 4]] and history_live.tolist() == [[True, True]]
    history, history_live = hasher.next_history(np.array([[6, 4]]), np.array([[-1, 1]]), lengths=np.array([1]))
    assert history.tolist() == [[1, 6]] and history_live.tolist() == [[True, True]]
    history, history_live = hasher.next_history(np.array([[6]]))
    assert history.tolist() == [[-1, 6]] and history_live.tolist() == [[False, True]]


def test_rows_bad_input_names_the_problem():
    hasher = _small_hasher()
    with pytest.raises(ValueError, match=r"token_ids\[0, 2\] = 7 is outside the tokenizer's ids 0..6"):
        hasher.rows(np.array([[1, 2, 7]]))
    with pytest.raises(ValueError, match=r"token_ids\[1, 0\] = -1"):
        hasher.rows(np.array([[1], [-1]]))
    assert hasher.rows(np.array([[1, 99]]), live=np.array([[True, False]])).shape == (1, 2, 2, 4)  # dead: unread
    with pytest.raises(ValueError, match=r"token_ids must be an integer array \[batch, seq\]"):
        hasher.rows(np.array([1, 2]))
    with pytest.raises(ValueError, match="token_ids must be an integer"):
        hasher.rows(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"live must be a bool array of token_ids' shape \(1, 2\)"):
        hasher.rows(np.array([[1, 2]]), live=np.array([[1, 0]]))
    with pytest.raises(ValueError, match=r"history must be an integer array \[batch, max_ngram_size − 1\] = \(1, 2"):
        hasher.rows(np.array([[1, 2]]), np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"history\[0, 1\] = 9"):
        hasher.rows(np.array([[1, 2]]), np.array([[1, 9]]))
    with pytest.raises(ValueError, match=r"history\[0, 0\] = -2"):
        hasher.rows(np.array([[1, 2]]), np.array([[-2, 1]]))
    with pytest.raises(ValueError, match="history_live was given without history"):
        hasher.rows(np.array([[1, 2]]), history_live=np.array([[True, True]]))
    with pytest.raises(ValueError, match="lengths must be"):
        hasher.next_history(np.array([[1, 2]]), lengths=np.array([3]))
    with pytest.raises(ValueError, match=r"layer 3 needs 120 table rows .* gives it 119"):
        _small_hasher(num_embeddings=[100, 119])


def test_empty_sequence():
    hasher = _small_hasher()
    assert hasher.rows(np.zeros((2, 0), np.int64)).shape == (2, 0, 2, 4)
    history, live = hasher.next_history(np.zeros((1, 0), np.int64), np.array([[3, 1]]))
    assert history.tolist() == [[3, 1]] and live.tolist() == [[True, True]]
