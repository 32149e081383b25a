"""The embedded tokenizer: a prefix of DeepSeek-V4's vocabulary plus every special token of V4 and V4.1."""

import json

import deepseek_recipe as dr
import pytest

from dsjax.embedded import MODEL_DIR
from dsjax.training.tokenizer import deepseek_v4_tokenizer_path, derive_tokenizer, special_token_strings

TEXT = "def quote(s):\n    \"\"\"Return a shell-escaped version of *s*.\"\"\"\n    return \"'\" + s + \"'\"  # 引号 ok\n"


@pytest.fixture(scope="module")
def source():
    with open(deepseek_v4_tokenizer_path(), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def derived(source):
    return derive_tokenizer(source, 8192)


def _spell(tok_json, ids):
    inv = {i: t for t, i in tok_json["model"]["vocab"].items()}
    return "".join(inv[i] for i in ids)


def test_ids_are_a_prefix_of_deepseeks_and_specials_are_all_there(source, derived):
    vocab = derived["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(8192))
    full = source["model"]["vocab"]
    merged = {t: i for t, i in vocab.items() if i < 8192 - 16}
    assert all(full[t] == i for t, i in merged.items())
    added = {a["content"]: a["id"] for a in derived["added_tokens"]}
    assert set(special_token_strings()) <= set(added)
    assert added["<｜begin▁of▁sentence｜>"] == 0 and added["<｜end▁of▁sentence｜>"] == 1
    assert "<｜System｜>" not in {a["content"] for a in source["added_tokens"]}  # the gap it closes


def test_same_text_same_bytes_fewer_merges(source, derived):
    """Both tokenizers segment the same bytes; the small one uses more, shorter pieces."""
    small = dr.Tokenizer.from_str(json.dumps(derived))
    full = dr.Tokenizer.from_file(deepseek_v4_tokenizer_path())
    a, b = small.encode(TEXT), full.encode(TEXT)
    assert _spell(derived, a) == _spell(source, b)
    assert len(a) >= len(b) and max(a) < 8192


def test_v41_conversation_with_system_message_encodes(derived):
    conv = dr.Conversation([dr.SystemMessage("Be brief."), dr.UserMessage("Write `dedent`.")])
    small = dr.Tokenizer.from_str(json.dumps(derived))
    ids = dr.DeepseekV41Encoding().with_tokenizer(small).encode(conv)
    added = {a["content"]: a["id"] for a in derived["added_tokens"]}
    assert added["<｜System｜>"] in ids and added["<think>"] == ids[-1]
    with pytest.raises(RuntimeError, match="System"):  # DeepSeek's V4 file cannot
        dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(deepseek_v4_tokenizer_path())).encode(conv)


def test_shipped_tokenizer_is_the_derived_one(derived):
    with open(f"{MODEL_DIR}/tokenizer.json", encoding="utf-8") as f:
        assert json.load(f) == derived


@pytest.mark.parametrize("size,match", [(270, "no room"), (10**6, "merges; the source has")])
def test_bad_sizes_are_refused(source, size, match):
    with pytest.raises(ValueError, match=match):
        derive_tokenizer(source, size)


def test_a_vocabulary_not_laid_out_like_deepseeks_is_refused(source):
    bad = json.loads(json.dumps(source))
    bad["model"]["merges"] = bad["model"]["merges"][1:]
    with pytest.raises(ValueError, match="not a DeepSeek-layout"):
        derive_tokenizer(bad, 4096)
