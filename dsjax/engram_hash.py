"""Engram's host side (DeepSeek-V4.1 spec §2.8): token compression and the n-gram hash that gives each
token its Engram table rows.

Every tokenizer id is decoded alone and normalised; ids with equal keys share one compressed id
(`token_texts`, `normalize_token`, `compressed_token_map`). `EngramHasher` turns raw token ids into
table rows: per Engram layer, for n-gram orders 2..max and `engram_n_heads` heads each, the hash of
the compressed ids of the token and the ones before it, modulo a per-(order, head) prime, plus the
bucket's offset. Pure Python + NumPy: this runs on the host, before the device step.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from typing import Any, Mapping, Sequence

import numpy as np

# --------------------------------------------------------------------------------------------------
# Normalisation, as HF tokenizers' Sequence[NFKC, NFD, StripAccents, Lowercase, Replace([ \t\r\n]+ → " "),
# Replace(^ $ → sentinel), Strip, Replace(sentinel → " ")] computes it.
#
# tokenizers normalises with the crate `unicode-normalization-alignments` 0.1.12, whose tables are
# Unicode 9.0.0 (its NFKC/NFD and its `is_combining_mark`, which StripAccents uses), while Python's
# `unicodedata` is newer (15.0.0 in Python 3.12). Characters assigned after 9.0 decompose, reorder and
# count as marks in Python but are inert in tokenizers (e.g. U+A7F2 MODIFIER LETTER CAPITAL C, U+0898
# ARABIC SMALL HIGH WORD AL-JUZ), and U+1CF2/U+1CF3 were marks in 9.0 but are letters now. So the two
# tables below are the 9.0 data, taken from that crate's `src/tables.rs`, as code point ranges (hex):
# `_DECOMPOSING_9` holds every character that 9.0 decomposes or gives a non-zero combining class (plus
# the Hangul syllables), `_MARKS_9` its General_Category=Mark. Stability policy freezes the
# decomposition and combining class of an assigned character, so Python agrees with 9.0 on every
# character in `_DECOMPOSING_9`; any character outside it is, in 9.0, a starter that decomposes to
# itself, which neither reorders nor decomposes with its neighbours, so the text can be cut there.
_DECOMPOSING_9 = (
    "A0 A8 AA AF B2-B5 B8-BA BC-BE C0-C5 C7-CF D1-D6 D9-DD E0-E5 E7-EF F1-F6 F9-FD FF-10F 112-125 128-130 132-137 "
    "139-140 143-149 14C-151 154-165 168-17F 1A0-1A1 1AF-1B0 1C4-1DC 1DE-1E3 1E6-1F5 1F8-21B 21E-21F 226-233 "
    "2B0-2B8 2D8-2DD 2E0-2E4 300-34E 350-36F 374 37A 37E 384-38A 38C 38E-390 3AA-3B0 3CA-3CE 3D0-3D6 3F0-3F2 "
    "3F4-3F5 3F9 400-401 403 407 40C-40E 419 439 450-451 453 457 45C-45E 476-477 483-487 4C1-4C2 4D0-4D3 4D6-4D7 "
    "4DA-4DF 4E2-4E7 4EA-4F5 4F8-4F9 587 591-5BD 5BF 5C1-5C2 5C4-5C5 5C7 610-61A 622-626 64B-65F 670 675-678 6C0 "
    "6C2 6D3 6D6-6DC 6DF-6E4 6E7-6E8 6EA-6ED 711 730-74A 7EB-7F3 816-819 81B-823 825-827 829-82D 859-85B 8D4-8E1 "
    "8E3-8FF 929 931 934 93C 94D 951-954 958-95F 9BC 9CB-9CD 9DC-9DD 9DF A33 A36 A3C A4D A59-A5B A5E ABC ACD B3C "
    "B48 B4B-B4D B5C-B5D B94 BCA-BCD C48 C4D C55-C56 CBC CC0 CC7-CC8 CCA-CCB CCD D4A-D4D DCA DDA DDC-DDE E33 "
    "E38-E3A E48-E4B EB3 EB8-EB9 EC8-ECB EDC-EDD F0C F18-F19 F35 F37 F39 F43 F4D F52 F57 F5C F69 F71-F7D F80-F84 "
    "F86-F87 F93 F9D FA2 FA7 FAC FB9 FC6 1026 1037 1039-103A 108D 10FC 135D-135F 1714 1734 17D2 17DD 18A9 "
    "1939-193B 1A17-1A18 1A60 1A75-1A7C 1A7F 1AB0-1ABD 1B06 1B08 1B0A 1B0C 1B0E 1B12 1B34 1B3B 1B3D 1B40-1B41 "
    "1B43-1B44 1B6B-1B73 1BAA-1BAB 1BE6 1BF2-1BF3 1C37 1CD0-1CD2 1CD4-1CE0 1CE2-1CE8 1CED 1CF4 1CF8-1CF9 "
    "1D2C-1D2E 1D30-1D3A 1D3C-1D4D 1D4F-1D6A 1D78 1D9B-1DF5 1DFB-1E9B 1EA0-1EF9 1F00-1F15 1F18-1F1D 1F20-1F45 "
    "1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FC4 1FC6-1FD3 1FD6-1FDB 1FDD-1FEF 1FF2-1FF4 "
    "1FF6-1FFE 2000-200A 2011 2017 2024-2026 202F 2033-2034 2036-2037 203C 203E 2047-2049 2057 205F 2070-2071 "
    "2074-208E 2090-209C 20A8 20D0-20DC 20E1 20E5-20F0 2100-2103 2105-2107 2109-2113 2115-2116 2119-211D "
    "2120-2122 2124 2126 2128 212A-212D 212F-2131 2133-2139 213B-2140 2145-2149 2150-217F 2189 219A-219B 21AE "
    "21CD-21CF 2204 2209 220C 2224 2226 222C-222D 222F-2230 2241 2244 2247 2249 2260 2262 226D-2271 2274-2275 "
    "2278-2279 2280-2281 2284-2285 2288-2289 22AC-22AF 22E0-22E3 22EA-22ED 2329-232A 2460-24EA 2A0C 2A74-2A76 "
    "2ADC 2C7C-2C7D 2CEF-2CF1 2D6F 2D7F 2DE0-2DFF 2E9F 2EF3 2F00-2FD5 3000 302A-302F 3036 3038-303A 304C 304E "
    "3050 3052 3054 3056 3058 305A 305C 305E 3060 3062 3065 3067 3069 3070-3071 3073-3074 3076-3077 3079-307A "
    "307C-307D 3094 3099-309C 309E-309F 30AC 30AE 30B0 30B2 30B4 30B6 30B8 30BA 30BC 30BE 30C0 30C2 30C5 30C7 "
    "30C9 30D0-30D1 30D3-30D4 30D6-30D7 30D9-30DA 30DC-30DD 30F4 30F7-30FA 30FE-30FF 3131-318E 3192-319F "
    "3200-321E 3220-3247 3250-327E 3280-32FE 3300-33FF A66F A674-A67D A69C-A69F A6F0-A6F1 A770 A7F8-A7F9 A806 "
    "A8C4 A8E0-A8F1 A92B-A92D A953 A9B3 A9C0 AAB0 AAB2-AAB4 AAB7-AAB8 AABE-AABF AAC1 AAF6 AB5C-AB5F ABED "
    "AC00-D7A3 F900-FA0D FA10 FA12 FA15-FA1E FA20 FA22 FA25-FA26 FA2A-FA6D FA70-FAD9 FB00-FB06 FB13-FB17 "
    "FB1D-FB36 FB38-FB3C FB3E FB40-FB41 FB43-FB44 FB46-FBB1 FBD3-FD3D FD50-FD8F FD92-FDC7 FDF0-FDFC FE10-FE19 "
    "FE20-FE44 FE47-FE52 FE54-FE66 FE68-FE6B FE70-FE72 FE74 FE76-FEFC FF01-FFBE FFC2-FFC7 FFCA-FFCF FFD2-FFD7 "
    "FFDA-FFDC FFE0-FFE6 FFE8-FFEE 101FD 102E0 10376-1037A 10A0D 10A0F 10A38-10A3A 10A3F 10AE5-10AE6 11046 1107F "
    "1109A 1109C 110AB 110B9-110BA 11100-11102 1112E-1112F 11133-11134 11173 111C0 111CA 11235-11236 112E9-112EA "
    "1133C 1134B-1134D 11366-1136C 11370-11374 11442 11446 114BB-114BC 114BE 114C2-114C3 115BA-115BB 115BF-115C0 "
    "1163F 116B6-116B7 1172B 11C3F 16AF0-16AF4 16B30-16B36 1BC9E 1D15E-1D169 1D16D-1D172 1D17B-1D182 1D185-1D18B "
    "1D1AA-1D1AD 1D1BB-1D1C0 1D242-1D244 1D400-1D454 1D456-1D49C 1D49E-1D49F 1D4A2 1D4A5-1D4A6 1D4A9-1D4AC "
    "1D4AE-1D4B9 1D4BB 1D4BD-1D4C3 1D4C5-1D505 1D507-1D50A 1D50D-1D514 1D516-1D51C 1D51E-1D539 1D53B-1D53E "
    "1D540-1D544 1D546 1D54A-1D550 1D552-1D6A5 1D6A8-1D7CB 1D7CE-1D7FF 1E000-1E006 1E008-1E018 1E01B-1E021 "
    "1E023-1E024 1E026-1E02A 1E8D0-1E8D6 1E944-1E94A 1EE00-1EE03 1EE05-1EE1F 1EE21-1EE22 1EE24 1EE27 1EE29-1EE32 "
    "1EE34-1EE37 1EE39 1EE3B 1EE42 1EE47 1EE49 1EE4B 1EE4D-1EE4F 1EE51-1EE52 1EE54 1EE57 1EE59 1EE5B 1EE5D 1EE5F "
    "1EE61-1EE62 1EE64 1EE67-1EE6A 1EE6C-1EE72 1EE74-1EE77 1EE79-1EE7C 1EE7E 1EE80-1EE89 1EE8B-1EE9B 1EEA1-1EEA3 "
    "1EEA5-1EEA9 1EEAB-1EEBB 1F100-1F10A 1F110-1F12E 1F130-1F14F 1F16A-1F16B 1F190 1F200-1F202 1F210-1F23B "
    "1F240-1F248 1F250-1F251 2F800-2FA1D "
)
_MARKS_9 = (
    "300-36F 483-489 591-5BD 5BF 5C1-5C2 5C4-5C5 5C7 610-61A 64B-65F 670 6D6-6DC 6DF-6E4 6E7-6E8 6EA-6ED 711 "
    "730-74A 7A6-7B0 7EB-7F3 816-819 81B-823 825-827 829-82D 859-85B 8D4-8E1 8E3-903 93A-93C 93E-94F 951-957 "
    "962-963 981-983 9BC 9BE-9C4 9C7-9C8 9CB-9CD 9D7 9E2-9E3 A01-A03 A3C A3E-A42 A47-A48 A4B-A4D A51 A70-A71 A75 "
    "A81-A83 ABC ABE-AC5 AC7-AC9 ACB-ACD AE2-AE3 B01-B03 B3C B3E-B44 B47-B48 B4B-B4D B56-B57 B62-B63 B82 BBE-BC2 "
    "BC6-BC8 BCA-BCD BD7 C00-C03 C3E-C44 C46-C48 C4A-C4D C55-C56 C62-C63 C81-C83 CBC CBE-CC4 CC6-CC8 CCA-CCD "
    "CD5-CD6 CE2-CE3 D01-D03 D3E-D44 D46-D48 D4A-D4D D57 D62-D63 D82-D83 DCA DCF-DD4 DD6 DD8-DDF DF2-DF3 E31 "
    "E34-E3A E47-E4E EB1 EB4-EB9 EBB-EBC EC8-ECD F18-F19 F35 F37 F39 F3E-F3F F71-F84 F86-F87 F8D-F97 F99-FBC FC6 "
    "102B-103E 1056-1059 105E-1060 1062-1064 1067-106D 1071-1074 1082-108D 108F 109A-109D 135D-135F 1712-1714 "
    "1732-1734 1752-1753 1772-1773 17B4-17D3 17DD 180B-180D 1885-1886 18A9 1920-192B 1930-193B 1A17-1A1B "
    "1A55-1A5E 1A60-1A7C 1A7F 1AB0-1ABE 1B00-1B04 1B34-1B44 1B6B-1B73 1B80-1B82 1BA1-1BAD 1BE6-1BF3 1C24-1C37 "
    "1CD0-1CD2 1CD4-1CE8 1CED 1CF2-1CF4 1CF8-1CF9 1DC0-1DF5 1DFB-1DFF 20D0-20F0 2CEF-2CF1 2D7F 2DE0-2DFF "
    "302A-302F 3099-309A A66F-A672 A674-A67D A69E-A69F A6F0-A6F1 A802 A806 A80B A823-A827 A880-A881 A8B4-A8C5 "
    "A8E0-A8F1 A926-A92D A947-A953 A980-A983 A9B3-A9C0 A9E5 AA29-AA36 AA43 AA4C-AA4D AA7B-AA7D AAB0 AAB2-AAB4 "
    "AAB7-AAB8 AABE-AABF AAC1 AAEB-AAEF AAF5-AAF6 ABE3-ABEA ABEC-ABED FB1E FE00-FE0F FE20-FE2F 101FD 102E0 "
    "10376-1037A 10A01-10A03 10A05-10A06 10A0C-10A0F 10A38-10A3A 10A3F 10AE5-10AE6 11000-11002 11038-11046 "
    "1107F-11082 110B0-110BA 11100-11102 11127-11134 11173 11180-11182 111B3-111C0 111CA-111CC 1122C-11237 1123E "
    "112DF-112EA 11300-11303 1133C 1133E-11344 11347-11348 1134B-1134D 11357 11362-11363 11366-1136C 11370-11374 "
    "11435-11446 114B0-114C3 115AF-115B5 115B8-115C0 115DC-115DD 11630-11640 116AB-116B7 1171D-1172B 11C2F-11C36 "
    "11C38-11C3F 11C92-11CA7 11CA9-11CB6 16AF0-16AF4 16B30-16B36 16F51-16F7E 16F8F-16F92 1BC9D-1BC9E 1D165-1D169 "
    "1D16D-1D172 1D17B-1D182 1D185-1D18B 1D1AA-1D1AD 1D242-1D244 1DA00-1DA36 1DA3B-1DA6C 1DA75 1DA84 1DA9B-1DA9F "
    "1DAA1-1DAAF 1E000-1E006 1E008-1E018 1E01B-1E021 1E023-1E024 1E026-1E02A 1E8D0-1E8D6 1E944-1E94A E0100-E01EF "
)


def _ranges(table: str) -> list[tuple[int, int]]:
    out = []
    for item in table.split():
        lo, _, hi = item.partition("-")
        out.append((int(lo, 16), int(hi or lo, 16)))
    return out


def _char_class(ranges: list[tuple[int, int]]) -> str:
    return "".join(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}"
                   for lo, hi in ranges)


_DECOMPOSING_RUN = re.compile(f"[{_char_class(_ranges(_DECOMPOSING_9))}]+")
_MARK_RUN = re.compile(f"[{_char_class(_ranges(_MARKS_9))}]+")
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
# Rust's `char::is_whitespace` (Unicode White_Space), which `Strip` uses; Python's `str.strip()` also
# strips U+001C..U+001F (its `isspace` follows the bidi class) and must not.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
               "\u2028\u2029\u202f\u205f\u3000"
# Lowercase mappings of characters that Python 3.12's Unicode 15.0 does not know but tokenizers lowercases
# (tokenizers 0.23.3 was built with Rust's Unicode 17 tables): Unicode 16.0 Latin and Cyrillic letters,
# Garay and Beria Erfe capitals. A no-op where Python's own tables already map them.
_LOWER_AFTER_15 = str.maketrans({
    **{chr(c): chr(c + 1) for c in (0x1C89, 0xA7CC, 0xA7CE, 0xA7D2, 0xA7D4, 0xA7DA)},
    "\ua7cb": "\u0264", "\ua7dc": "\u019b",
    **{chr(c): chr(c + 0x20) for c in range(0x10D50, 0x10D66)},
    **{chr(c): chr(c + 0x1B) for c in range(0x16EA0, 0x16EB9)},
})
_SENTINEL = "\ue000"  # the release's private-use stand-in that lets a lone space survive Strip
_CAPITAL_SIGMA = "\u03a3"


def _decompose_9(text: str) -> str:
    """NFD(NFKC(text)) with Unicode 9.0 data. NFD∘NFKC equals NFKD (composition keeps canonical
    equivalence and NFD is unique per equivalence class), so each run of 9.0-decomposing characters
    is NFKD-normalised alone; the characters between runs stay as they are."""
    return _DECOMPOSING_RUN.sub(lambda m: unicodedata.normalize("NFKD", m.group()), text)


def normalize_token(text: str) -> str:
    """The release's key normalisation of one decoded token (NFKC, NFD, strip accents, lowercase,
    whitespace runs to one space, strip; a text that is one space after collapsing stays one space),
    equal to HF tokenizers' normalizer sequence, Unicode 9.0 tables included."""
    s = text
    if not s.isascii():  # ASCII is inert under every step before Lowercase
        s = _MARK_RUN.sub("", _decompose_9(s))
    # Lowercase maps each character alone (Rust `char::to_lowercase`); Python's `str.lower` applies
    # Final_Sigma context to U+03A3, its one context-dependent mapping.
    s = "".join(c.lower() for c in s) if _CAPITAL_SIGMA in s else s.lower()
    if not s.isascii():
        s = s.translate(_LOWER_AFTER_15)
    s = _WHITESPACE_RUN.sub(" ", s)
    if s == " ":  # `^ $`: after collapsing there is no newline left, so only the whole text matches
        s = _SENTINEL
    return s.strip(_WHITE_SPACE).replace(_SENTINEL, " ")


# --------------------------------------------------------------------------------------------------
# Decoding each id alone, as `Tokenizer.decode([id], skip_special_tokens=False)` does.


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character → the byte it stands for (GPT-2's table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
_MODEL_TYPES = ("WordLevel", "BPE")
_DECODER_TYPES = (None, "ByteLevel")


def _byte_level_decode(token: str) -> str:
    """tokenizers' ByteLevel decoder on one token: its characters' bytes, or, if any character is
    outside the alphabet (an added token such as `<｜begin▁of▁sentence｜>`), the token's own UTF-8;
    then `String::from_utf8_lossy`: U+FFFD per maximal invalid subsequence, as Python's "replace"."""
    try:
        raw = bytes(_BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        raw = token.encode("utf-8")
    return raw.decode("utf-8", errors="replace")


def token_texts(tokenizer_json: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Each id's decoded text alone and its raw token string, ids 0..n−1, for a HF `tokenizer.json` dict
    with a WordLevel or BPE model and no decoder or a ByteLevel one. Added tokens get their ids as
    tokenizers gives them on loading: the model's id for a string the model has, else the next id from
    the model's vocabulary size on, in file order (the file's `id` fields are not read; tokenizers only
    warns when they differ). Raises ValueError for any other model or decoder type, or when the ids are
    not exactly 0..n−1."""
    model = tokenizer_json.get("model") or {}
    model_type = model.get("type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"tokenizer model type {model_type!r} is not supported (supported: {list(_MODEL_TYPES)})")
    decoder = tokenizer_json.get("decoder")
    decoder_type = None if decoder is None else decoder.get("type")
    if decoder_type not in _DECODER_TYPES:
        raise ValueError(f"tokenizer decoder type {decoder_type!r} is not supported "
                         "(supported: none, 'ByteLevel')")
    vocab: Mapping[str, int] = model.get("vocab", {})
    by_id: dict[int, str] = {}
    for token, i in vocab.items():
        if i in by_id:
            raise ValueError(f"tokenizer vocabulary gives id {i} to both {by_id[i]!r} and {token!r}")
        by_id[i] = token
    added_ids: dict[str, int] = {}
    next_id = len(vocab)
    for added in tokenizer_json.get("added_tokens") or ():
        content = added["content"]
        if not content or content in added_ids:
            continue  # tokenizers skips empty added tokens and keeps a repeated one's first id
        if content in vocab:
            added_ids[content] = vocab[content]
        else:
            added_ids[content] = next_id
            next_id += 1
        by_id[added_ids[content]] = content
    n = len(by_id)
    if n == 0 or min(by_id) != 0 or max(by_id) != n - 1:
        missing = next((i for i in range(max(by_id, default=0) + 1) if i not in by_id), None)
        raise ValueError(f"tokenizer ids are not 0..{n - 1} without gaps (id {missing} has no token; "
                         f"ids span {min(by_id, default=None)}..{max(by_id, default=None)})")
    raw = [by_id[i] for i in range(n)]
    texts = [_byte_level_decode(t) for t in raw] if decoder_type == "ByteLevel" else list(raw)
    return texts, raw


def compressed_token_map(texts: Sequence[str], raw: Sequence[str]) -> tuple[np.ndarray, int]:
    """The compressed id of each token id (int32 [n]) and the number of compressed ids. A token's key is
    its raw string if its decoded text holds U+FFFD, else its normalised text, or the text itself where
    normalisation leaves nothing; keys are numbered in order of first appearance."""
    if len(texts) != len(raw):
        raise ValueError(f"texts ({len(texts)}) and raw tokens ({len(raw)}) differ in length")
    ids: dict[str, int] = {}
    out = np.empty(len(texts), np.int32)
    for i, (text, token) in enumerate(zip(texts, raw)):
        if "\ufffd" in text:
            key = token
        else:
            key = normalize_token(text) or text
        out[i] = ids.setdefault(key, len(ids))
    return out, len(ids)


def tokenizer_token_map(tokenizer_json: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """`compressed_token_map(*token_texts(tokenizer_json))`."""
    return compressed_token_map(*token_texts(tokenizer_json))


# --------------------------------------------------------------------------------------------------
# Buckets and the hash.

_BLOCK_TOKENS = 16384  # positions per block of `EngramHasher.rows`

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_LIMIT = 3_317_044_064_679_887_385_961_981  # these bases decide primality exactly below this


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n below `_MR_LIMIT`)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_LIMIT:
        raise ValueError(f"{n} is too large for the prime search (limit {_MR_LIMIT})")
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> np.ndarray:
    """int64 [n_layers, (max_ngram_size − 1)·n_heads]: per layer, per order 2..max, per head, the next
    prime above a start that resets to `vocab_size − 1` per order and skips primes used before."""
    found: list[int] = []  # ascending primes above the start, found so far
    seen: set[int] = set()
    out = np.empty((n_layers, (max_ngram_size - 1) * n_heads), np.int64)
    for layer in range(n_layers):
        for order in range(max_ngram_size - 1):
            current = vocab_size - 1
            for head in range(n_heads):
                # The next unused prime above `current`: the primes found already are reused as a
                # list, since the start is the same for every order.
                k = bisect.bisect_right(found, current)
                while True:
                    if k == len(found):
                        candidate = (found[-1] if found else vocab_size - 1) + 1
                        while not _is_prime(candidate):
                            candidate += 1
                        found.append(candidate)
                    if found[k] not in seen:
                        break
                    k += 1
                current = found[k]
                seen.add(current)
                out[layer, order * n_heads + head] = current
    return out


def _get(config: Any, name: str) -> Any:
    """A config value from a `V41Config`-like object, a `text_config` dict, or a full config dict."""
    if isinstance(config, Mapping):
        if name in config:
            return config[name]
        text = config.get("text_config")
        if isinstance(text, Mapping) and name in text:
            return text[name]
        raise KeyError(f"config has no {name!r}")
    return getattr(config, name)


class EngramHasher:
    """Table rows of every token for every Engram layer, from raw token ids (spec §2.8).

    `primes`, `offsets`: int64 [n_layers, hash_heads], hash heads ordered order 2's heads, then 3's, …;
    `multipliers`: int64 [n_layers, max_ngram_size]; `pad_id`: the compressed id of the pad token.
    """

    def __init__(self, *, layer_ids: Sequence[int], num_embeddings: Sequence[int], max_ngram_size: int,
                 vocab_size: int, n_heads: int, pad_token_id: int, compressed_vocab_size: int,
                 token_map: np.ndarray):
        layer_ids, num_embeddings = [int(i) for i in layer_ids], [int(r) for r in num_embeddings]
        if not layer_ids or max_ngram_size < 2 or n_heads < 1 or vocab_size < 2:
            raise ValueError(f"Engram hashing needs at least one layer (got {layer_ids}), "
                             f"engram_max_ngram_size ≥ 2 (got {max_ngram_size}), engram_n_heads ≥ 1 "
                             f"(got {n_heads}) and engram_vocab_size ≥ 2 (got {vocab_size})")
        if len(layer_ids) != len(num_embeddings) or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"engram_num_embeddings {num_embeddings} needs one row count for each distinct "
                             f"Engram layer {layer_ids}")
        if any(not 0 < r <= np.iinfo(np.int32).max for r in num_embeddings):
            raise ValueError(f"engram_num_embeddings {num_embeddings}: each row count must be in 1..2^31 − 1 "
                             "(rows are int32)")
        token_map = np.asarray(token_map)
        if token_map.ndim != 1 or token_map.size == 0 or not np.issubdtype(token_map.dtype, np.integer):
            raise ValueError(f"token_map must be a non-empty 1-D integer array, got {token_map.dtype} "
                             f"{token_map.shape}")
        if token_map.min() < 0:
            raise ValueError(f"token_map holds a negative compressed id ({int(token_map.min())})")
        found = int(token_map.max()) + 1
        if found != compressed_vocab_size:
            raise ValueError(f"the token map has {found} compressed ids but engram_compressed_vocab_size is "
                             f"{compressed_vocab_size}; the hash multipliers depend on this size")
        if not 0 <= pad_token_id < token_map.size:
            raise ValueError(f"engram_pad_token_id {pad_token_id} is outside the token map ({token_map.size} ids)")

        self.layer_ids = tuple(layer_ids)
        self.num_embeddings = tuple(num_embeddings)
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.history_len = self.max_ngram_size - 1  # tokens before a chunk that its first rows read
        self.hash_heads = (self.max_ngram_size - 1) * self.n_heads
        self.token_map = token_map.astype(np.int64)
        self.compressed_vocab_size = found
        self.pad_id = int(self.token_map[pad_token_id])
        self.primes = bucket_primes(len(layer_ids), self.max_ngram_size, self.n_heads, int(vocab_size))
        for layer, rows, primes in zip(layer_ids, num_embeddings, self.primes):
            if int(primes.sum()) > rows:
                raise ValueError(f"Engram layer {layer} needs {int(primes.sum())} table rows for its buckets "
                                 f"but engram_num_embeddings gives it {rows}")
        # Exclusive prefix sums: each (order, head) bucket's first row.
        self.offsets = np.concatenate([np.zeros((len(layer_ids), 1), np.int64),
                                       np.cumsum(self.primes, axis=1)[:, :-1]], axis=1)
        # Drawn below (int64 max // vocab) / 2 and made odd, a compressed id times a multiplier stays
        # below 2^63, so the products never overflow and the hash stays non-negative.
        bound = max(1, (np.iinfo(np.int64).max // found) // 2)
        self.multipliers = np.stack([
            np.random.default_rng(10007 * layer).integers(0, bound, size=self.max_ngram_size, dtype=np.int64) * 2 + 1
            for layer in layer_ids])

    @classmethod
    def from_config(cls, config: Any, token_map: np.ndarray) -> "EngramHasher":
        """From a `V41Config`, a release `config.json` dict or its `text_config` dict."""
        return cls(layer_ids=_get(config, "engram_layer_ids"),
                   num_embeddings=_get(config, "engram_num_embeddings"),
                   max_ngram_size=int(_get(config, "engram_max_ngram_size")),
                   vocab_size=int(_get(config, "engram_vocab_size")),
                   n_heads=int(_get(config, "engram_n_heads")),
                   pad_token_id=int(_get(config, "engram_pad_token_id")),
                   compressed_vocab_size=int(_get(config, "engram_compressed_vocab_size")),
                   token_map=token_map)

    # ------------------------------------------------------------------------------------- inputs
    def _check_ids(self, ids: np.ndarray, live: np.ndarray, what: str, allow_absent: bool) -> None:
        bad = live & ((ids < 0) | (ids >= self.token_map.size))
        if allow_absent:
            bad &= ids != -1
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{what}{list(where)} = {int(ids[where])} is outside the tokenizer's ids "
                             f"0..{self.token_map.size - 1}")

    def _inputs(self, token_ids, live, history, history_live):
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be an integer array [batch, seq], got {ids.dtype} {ids.shape}")
        b, k = ids.shape[0], self.history_len
        live = np.ones(ids.shape, bool) if live is None else np.asarray(live)
        if live.shape != ids.shape or live.dtype != np.bool_:
            raise ValueError(f"live must be a bool array of token_ids' shape {ids.shape}, "
                             f"got {live.dtype} {live.shape}")
        if history is None:
            if history_live is not None:
                raise ValueError("history_live was given without history")
            hist = np.full((b, k), -1, np.int64)
        else:
            hist = np.asarray(history)
            if hist.shape != (b, k) or not np.issubdtype(hist.dtype, np.integer):
                raise ValueError(f"history must be an integer array [batch, max_ngram_size − 1] = {(b, k)}, "
                                 f"got {hist.dtype} {hist.shape}")
        hist_live = hist != -1 if history_live is None else np.asarray(history_live)
        if hist_live.shape != (b, k) or hist_live.dtype != np.bool_:
            raise ValueError(f"history_live must be a bool array {(b, k)}, got {hist_live.dtype} {hist_live.shape}")
        self._check_ids(ids, live, "token_ids", allow_absent=False)
        self._check_ids(hist, hist_live, "history", allow_absent=True)
        return ids, live, hist, hist_live & (hist != -1)  # −1: before the sequence start

    # ------------------------------------------------------------------------------------- hashing
    def rows(self, token_ids: np.ndarray, history: np.ndarray | None = None, live: np.ndarray | None = None,
             history_live: np.ndarray | None = None) -> np.ndarray:
        """int32 [batch, seq, n_layers, hash_heads]: each token's table row in each Engram layer.

        token_ids: int [batch, seq], raw tokenizer ids. history: int [batch, max_ngram_size − 1], the raw
        ids of the tokens before position 0, oldest first, −1 where the sequence has none (None: every
        sequence starts at position 0); `next_history` gives it for the next chunk. live / history_live:
        bool, False for tokens that are not text (image spans, padding); None: every token live (every
        history id other than −1). Look-back slot r of position p holds the compressed id of token p − r, or the
        compressed pad id once the sequence start or a dead token lies at or before r steps back. Dead
        positions get the rows of an all-pad window (valid rows; the caller masks their write). Ids of
        dead tokens are not looked up, so padding may hold any id.
        """
        ids, live, hist, hist_live = self._inputs(token_ids, live, history, history_live)
        b, s = ids.shape
        k = self.history_len
        # The k history columns go in front, so position p's slot r is column p + k − r.
        compressed = np.concatenate([self.token_map[np.where(hist_live, hist, 0)],
                                     self.token_map[np.where(live, ids, 0)]], axis=1)
        dead = ~np.concatenate([hist_live, live], axis=1)
        out = np.empty((b, s, len(self.layer_ids), self.hash_heads), np.int32)
        # Blocks of positions keep the temporaries and the strided stores into `out` in cache.
        block = max(1, _BLOCK_TOKENS // b)
        for start in range(0, s, block):
            stop = min(s, start + block)
            self._rows_block(compressed[:, start:stop + k], dead[:, start:stop + k], out[:, start:stop])
        return out

    def _rows_block(self, compressed: np.ndarray, dead: np.ndarray, out: np.ndarray) -> None:
        k, n = self.history_len, out.shape[1]
        blocked = np.zeros(out.shape[:2], bool)
        rolling: list[np.ndarray] = []
        tmp = np.empty(out.shape[:2], np.int64)
        for r in range(self.max_ngram_size):
            blocked |= dead[:, k - r: k - r + n]  # a dead token r steps back blocks slot r and all beyond
            slot = np.where(blocked, self.pad_id, compressed[:, k - r: k - r + n])
            for layer in range(len(self.layer_ids)):
                product = slot * self.multipliers[layer, r]
                if r == 0:
                    rolling.append(product)
                    continue
                rolling[layer] ^= product
                for head in range((r - 1) * self.n_heads, r * self.n_heads):
                    # A scalar divisor on a contiguous array is several times faster than broadcasting.
                    np.remainder(rolling[layer], self.primes[layer, head], out=tmp)
                    tmp += self.offsets[layer, head]
                    out[:, :, layer, head] = tmp

    def next_history(self, token_ids: np.ndarray, history: np.ndarray | None = None,
                     live: np.ndarray | None = None, history_live: np.ndarray | None = None,
                     lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The (history, history_live) to pass with the chunk after `token_ids`: the last
        max_ngram_size − 1 tokens of history + the first `lengths[b]` tokens of each row (None: all),
        oldest first; a dead token or one before the sequence start has id −1 and live False."""
        ids, live, hist, hist_live = self._inputs(token_ids, live, history, history_live)
        b, s = ids.shape
        k = self.history_len
        n = np.full(b, s) if lengths is None else np.asarray(lengths)
        if n.shape != (b,) or (n < 0).any() or (n > s).any():
            raise ValueError(f"lengths must be [batch] = ({b},) values in 0..{s}, got {n}")
        all_live = np.concatenate([hist_live, live], axis=1)
        all_ids = np.where(all_live, np.concatenate([hist, ids], axis=1).astype(np.int64), -1)
        cols = n[:, None] + np.arange(k)  # the k columns that end at each row's length
        return (np.take_along_axis(all_ids, cols, 1), np.take_along_axis(all_live, cols, 1))
