"""The V4.1 reference harness (run_v41_reference.py: NeMo AutoModel's deepseek_v41 on CPU) ran, and its outputs
agree with the tiny V4.1 preset and with each other: what the dsjax V4.1 parity tests rely on."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from dsjax.presets import PRESETS, tiny_v41_vocabulary
from tests.reference.spec_v41 import CASES, QUANT_CASES

CASE = CASES[0]
RAW = CASE["config"]
TEXT = RAW["text_config"]
LENS = sorted(CASE["seq_lens"])
LONGEST = LENS[-1]
SPAN = CASE["image_span"]


@pytest.fixture(scope="module")
def case(reference_v41):
    return reference_v41 / CASE["name"]


def _load(folder, name):
    return np.load(folder / name)


def _rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_the_checkpoint_is_in_the_release_format(case):
    ckpt = case / "ckpt"
    assert json.loads((ckpt / "config.json").read_text()) == PRESETS["tiny-v4.1"]  # rope_scaling, not rope_parameters
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel"
    assert tok["model"]["vocab"] == {t: i for i, t in enumerate(tiny_v41_vocabulary())}

    w = load_file(ckpt / "model.safetensors")
    assert {t.dtype for t in w.values()} == {np.dtype(np.float32)}
    h, n = TEXT["hidden_size"], TEXT["hc_mult"]
    shapes = {"embed.weight": (256, h), "head.weight": (256, h), "norm.weight": (h,),
              "layers.0.attn_norm.weight": (h,), "layers.0.hc_attn_fn": (n * (n + 2), n * h),
              "layers.7.hc_ffn_scale": (3,), "layers.0.attn.attn_sink": (TEXT["num_attention_heads"],),
              "layers.0.attn.wq_a.weight": (TEXT["q_lora_rank"], h),
              "layers.2.attn.compressor.wkv.weight": (TEXT["head_dim"], h),
              "layers.2.attn.compressor.wgate.weight": (TEXT["head_dim"], h),
              "layers.4.attn.compressor.wkv.weight": (TEXT["head_dim"], h),
              "layers.2.attn.indexer.wk.weight": (TEXT["index_head_dim"], TEXT["head_dim"]),
              "layers.6.attn.indexer.wq_b.weight": (TEXT["index_n_heads"] * TEXT["index_head_dim"],
                                                    TEXT["q_lora_rank"]),
              "layers.0.ffn.gate.bias": (8,), "layers.0.ffn.gate.bias_vl": (8,),
              "layers.0.ffn.experts.7.w1.weight": (TEXT["moe_intermediate_size"], h),
              "layers.0.ffn.shared_experts.w2.weight": (h, TEXT["moe_intermediate_size"]),
              "layers.1.engram.embed.weight": (TEXT["engram_num_embeddings"][0], TEXT["engram_head_dim"]),
              "layers.3.engram.embed.weight": (TEXT["engram_num_embeddings"][1], TEXT["engram_head_dim"]),
              "layers.1.engram.wkv.weight": ((n + 1) * h, 6 * TEXT["engram_head_dim"]),
              "layers.1.engram.q_weight": (n, h)}
    assert {k: w[k].shape for k in shapes} == shapes
    # Only the sources own compressed state: no wgate on the ratio-1 source, no indexer on Reuse layers.
    assert "layers.4.attn.compressor.wgate.weight" not in w and "layers.3.attn.indexer.wk.weight" not in w
    assert not any(k.startswith(("layers.5.attn.indexer", "layers.3.attn.compressor", "model.")) for k in w)
    assert sorted({k.split(".engram.")[0] for k in w if ".engram." in k}) == ["layers.1", "layers.3"]
    for name, t in w.items():  # every tensor random: nothing at 0, 1 or a constant
        assert t.size == 1 or t.std() > 0, name
    assert not np.allclose(w["layers.0.ffn.gate.bias"], w["layers.0.ffn.gate.bias_vl"])


def test_inputs_and_logits(case):
    bos, image = RAW["bos_token_id"], RAW["image_token_id"]
    for t in LENS:
        ids, mask = _load(case, f"input_ids_{t}.npy"), _load(case, f"image_mask_{t}.npy")
        assert ids.shape == mask.shape == (CASE["batch"], t) and ids.dtype == np.int64 and mask.dtype == bool
        assert (ids[:, 0] == bos).all() and (ids[:, 1:] > 2).all()
        assert ((ids == image) == mask).all()
        assert (ids[0] == _load(case, f"input_ids_{LONGEST}.npy")[0, :t]).all()  # row 0 is nested
        for variant in ("identity", "quantized"):
            logits = _load(case, f"logits_{variant}_{t}.npy")
            assert logits.shape == (CASE["batch"], t, TEXT["vocab_size"]) and logits.dtype == np.float32
            assert np.isfinite(logits).all() and 0.3 < logits.std() < 10
    expected = np.zeros((CASE["batch"], LONGEST), bool)
    expected[SPAN["row"], SPAN["start"]:SPAN["stop"]] = True
    assert (_load(case, f"image_mask_{LONGEST}.npy") == expected).all()


def test_cache_quantization_changes_the_logits(case):
    """The identity variant really replaced NeMo's cache quantization (about 2-3 logits apart at this size)."""
    for t in LENS:
        ident, quant = _load(case, f"logits_identity_{t}.npy"), _load(case, f"logits_quantized_{t}.npy")
        diff = np.abs(ident - quant).max(axis=-1)
        assert diff.max() > 0.3 * ident.std(), t
        assert (ident.argmax(-1) == quant.argmax(-1)).mean() > 0.5, t  # the same model nonetheless


def test_logits_of_a_prefix_do_not_depend_on_the_length(case):
    """Row 0 is nested across lengths; with ties broken towards the lower index, top-k selection (indexer,
    candidate blocks, router) cannot depend on the sequence length."""
    full = _load(case, f"logits_identity_{LONGEST}.npy")[0]
    for t in LENS[:-1]:
        np.testing.assert_allclose(_load(case, f"logits_identity_{t}.npy")[0], full[:t], rtol=0, atol=1e-4)


def test_the_image_mask_reaches_the_model(case):
    masked, plain = _load(case, f"logits_identity_{LONGEST}.npy"), _load(case, f"logits_identity_nomask_{LONGEST}.npy")
    row, start = SPAN["row"], SPAN["start"]
    np.testing.assert_allclose(masked[1 - row], plain[1 - row], rtol=0, atol=1e-4)
    np.testing.assert_allclose(masked[row, :start], plain[row, :start], rtol=0, atol=1e-4)
    assert (np.abs(masked[row, start:] - plain[row, start:]).max(axis=-1) > 1e-2).all()


@pytest.mark.parametrize("variant", ["identity", "quantized"])
def test_captured_streams_fit_the_logits(case, variant):
    cap = _load(case, f"capture_{variant}.npz")
    w = load_file(case / "ckpt" / "model.safetensors")
    ids, mask = cap["input_ids"], cap["image_mask"]
    assert (ids == _load(case, f"input_ids_{LONGEST}.npy")).all()
    assert (mask == _load(case, f"image_mask_{LONGEST}.npy")).all()
    assert np.array_equal(cap["logits"], _load(case, f"logits_{variant}_{LONGEST}.npy"))
    n_layers, n = TEXT["num_hidden_layers"], TEXT["hc_mult"]
    # Block 0 receives the embedding in every stream and the one-hot collapse weights.
    assert np.array_equal(cap["streams_0"], np.repeat(w["embed.weight"][ids][:, :, None], n, axis=2))
    assert np.array_equal(cap["pre_mix_0"], np.broadcast_to(np.eye(n)[0], cap["pre_mix_0"].shape))
    for layer in range(1, n_layers + 1):  # later ones: sigmoid + hc_eps
        assert cap[f"streams_{layer}"].shape == cap["streams_0"].shape
        pre = cap[f"pre_mix_{layer}"]
        assert ((pre > 0) & (pre < 1 + 2 * TEXT["hc_eps"])).all() and pre.std() > 0.05
    # Final collapse with the last FFN pre, the norm, then the head.
    collapsed = np.einsum("btn,btnh->bth", cap[f"pre_mix_{n_layers}"].astype(np.float64), cap[f"streams_{n_layers}"])
    final = _rms_norm(collapsed, w["norm.weight"], TEXT["rms_norm_eps"])
    np.testing.assert_allclose(cap["final_hidden"], final, rtol=0, atol=1e-4 * np.abs(final).max())
    logits = cap["final_hidden"].astype(np.float64) @ w["head.weight"].T
    np.testing.assert_allclose(cap["logits"], logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    # Engram leaves image-span tokens unchanged and updates every other token.
    for layer in TEXT["engram_layer_ids"]:
        before, after = cap[f"streams_{layer}"], cap[f"engram_{layer}"]
        assert np.array_equal(after[mask], before[mask])
        assert (np.abs(after - before).max(axis=(-2, -1))[~mask] > 0).all()


def _selection(scores, k):
    """NeMo's selection with jax.lax.top_k's tie rule: the top k (ties to the lower index), sorted into position
    order, -1 where the picked score is -inf."""
    idx = np.sort(np.argsort(-scores, axis=-1, kind="stable")[..., :k], axis=-1)
    return np.where(np.isfinite(np.take_along_axis(scores, idx, -1)), idx, -1)


@pytest.mark.parametrize("variant", ["identity", "quantized"])
def test_sparse_selection_is_consistent_with_its_scores(case, variant):
    cap = _load(case, f"capture_{variant}.npz")
    ratios, k = TEXT["compress_ratios"], TEXT["index_topk"]
    source = TEXT["candidate_source_layer_id"]
    t = np.arange(LONGEST)
    for layer in range(TEXT["num_hidden_layers"]):
        if not ratios[layer]:
            assert f"topk_{layer}" not in cap.files
            continue
        entries = LONGEST // ratios[layer]
        topk = cap[f"topk_{layer}"]
        assert topk.shape == (CASE["batch"], LONGEST, min(k, entries))
        visible = (t + 1) // ratios[layer]  # entry j is visible to query t iff j < (t+1)//m
        assert ((topk == -1) | (topk < visible[None, :, None])).all()
        if layer in TEXT["index_source_layer_ids"]:
            scores = cap[f"index_scores_{layer}"]
            assert scores.shape == (CASE["batch"], LONGEST, entries)
            assert (np.isfinite(scores) <= (np.arange(entries) < visible[:, None])).all()  # causally masked
            assert np.array_equal(topk, _selection(scores, k)), layer
            _assert_margins(scores, k, f"layer {layer}")
            assert (scores[np.isfinite(scores)] == 0).mean() < 0.02, layer  # not mostly all-ReLU-zero
        else:  # Reuse: the selection of the nearest preceding index source
            src = max(i for i in TEXT["index_source_layer_ids"] if i < layer)
            assert np.array_equal(topk, cap[f"topk_{src}"]), layer
    # The candidate pool: at most candidate_topk_blocks blocks of visible entries, always the newest block, and the
    # Reindex layers after the source score only inside it.
    cand, block = cap["candidates"], TEXT["candidate_block_size"]
    entries = LONGEST // ratios[source]
    assert cand.shape == (CASE["batch"], LONGEST, entries) and cand.dtype == bool
    visible = (t + 1) // ratios[source]
    assert (cand <= (np.arange(entries) < visible[:, None])).all()
    blocks = cand.reshape(*cand.shape[:2], -1, block).any(-1)
    assert (blocks.sum(-1) <= TEXT["candidate_topk_blocks"]).all()
    assert blocks[:, t, (visible - 1) // block].all()
    assert cand.sum() < (np.arange(entries) < visible[:, None]).sum() * CASE["batch"]  # the pool does select
    for layer in TEXT["index_source_layer_ids"]:
        if layer > source:
            assert (np.isfinite(cap[f"index_scores_{layer}"]) <= cand).all()
    block_scores = cap["candidate_block_scores"]  # the blocks' maxima, the newest visible block at +inf
    top = np.argsort(-block_scores, axis=-1, kind="stable")[..., :TEXT["candidate_topk_blocks"]]
    keep = np.zeros(block_scores.shape, bool)
    np.put_along_axis(keep, top, np.take_along_axis(block_scores, top, -1) > -np.inf, -1)
    assert np.array_equal(blocks, keep)
    assert (block_scores[:, t, (visible - 1) // block] == np.inf).all()
    _assert_margins(block_scores, TEXT["candidate_topk_blocks"], "candidate blocks")
    # Router: top-k of sqrt(softplus) + bias (bias_vl on image tokens).
    for layer in range(TEXT["num_hidden_layers"]):
        _assert_margins(cap[f"route_scores_{layer}"], TEXT["num_experts_per_tok"], f"router {layer}")


def _assert_margins(scores, k, what):
    """Where a top-k chooses among more than k finite scores, the k-th and (k+1)-th are far apart compared with
    fp32 rounding (1e-5 of the largest score), or both exactly zero (all ReLU terms zero: a tie that any fp32
    implementation reproduces, broken towards the lower index)."""
    srt = -np.sort(-scores, axis=-1)
    srt = srt[np.isfinite(srt[..., k])]
    kth, next_ = srt[:, k - 1], srt[:, k]
    robust = (kth - next_ > 1e-5 * np.abs(srt[np.isfinite(srt)]).max()) | ((kth == 0) & (next_ == 0))
    assert robust.all(), f"{what}: {np.sum(~robust)} selections within fp32 rounding of a tie"


def test_engram_hashes_and_token_map(case):
    cap = _load(case, "capture_identity.npz")
    vocab = tiny_v41_vocabulary()
    token_map = cap["token_map"]
    assert token_map.shape == (len(vocab),)
    assert token_map.max() + 1 == len(set(token_map)) == TEXT["engram_compressed_vocab_size"]
    same = [["cat", "Cat", " cat", " CAT", "ｃａｔ"], ["the", " THE", "ＴＨＥ"], ["cafe", "café", " Café"],
            ["fire", "ﬁre"], [" ", "  ", "\n", "\t", " \n "]]
    for group in same:
        assert len({token_map[vocab.index(tok)] for tok in group}) == 1, group
    assert len({token_map[vocab.index(tok)] for tok in ["cat", "dog", "\ufffd", "a\ufffd", "a", " "]}) == 6
    hashes = cap["engram_hashes"]
    heads = (TEXT["engram_max_ngram_size"] - 1) * TEXT["engram_n_heads"]
    assert hashes.shape == (CASE["batch"], LONGEST, len(TEXT["engram_layer_ids"]), heads)
    for i, rows in enumerate(TEXT["engram_num_embeddings"]):
        h = hashes[:, :, i]
        assert h.min() >= 0 and h.max() < rows
        assert (np.diff(h, axis=-1) > 0).all()  # each head has its own bucket range, in order
        # Inside the image span every n-gram is blocked: all image tokens hash alike.
        span = h[SPAN["row"], SPAN["start"]:SPAN["stop"]]
        assert (span == span[0]).all() and len({tuple(x) for x in h[1 - SPAN["row"]]}) > LONGEST // 2


def test_greedy_generation_by_full_recompute(case):
    gen = _load(case, "generate_identity.npz")
    n_new, prompt_len = CASE["generate"]["new_tokens"], CASE["generate"]["prompt_len"]
    assert (gen["prompt"] == _load(case, f"input_ids_{LONGEST}.npy")[0, :prompt_len]).all()
    assert gen["tokens"].shape == (n_new,) and gen["logits"].shape == (n_new, TEXT["vocab_size"])
    assert np.isfinite(gen["logits"]).all()
    assert (gen["tokens"] == gen["logits"].argmax(-1)).all()
    assert len(set(gen["tokens"].tolist())) > n_new // 4  # not stuck on one token
    # The first step's logits are the prompt's last position in the (nested) row 0 of the longest input.
    first = _load(case, f"logits_identity_{LONGEST}.npy")[0, prompt_len - 1]
    np.testing.assert_allclose(gen["logits"][0], first, rtol=0, atol=1e-4)


def _pow2_ceil(x):
    """The power of two at or above each positive float32 value (as NeMo computes it: exponent, +1 if mantissa)."""
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def test_quantization_cases(reference_v41):
    q = np.load(reference_v41 / "quant_cases.npz")
    x = q["input"]
    assert x.shape == tuple(QUANT_CASES["shape"]) and x.dtype == np.float32
    assert sorted(q.files) == sorted(["input"] + [f"{f}_{b}" for f, b in QUANT_CASES["formats"]])
    zero_rows = (x == 0).all(-1)
    assert zero_rows.any()
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    for fmt, block in QUANT_CASES["formats"]:
        y = q[f"{fmt}_{block}"]
        assert y.shape == x.shape and y.dtype == np.float32 and (y[zero_rows] == 0).all()
        assert not np.array_equal(y, x)
        xb = x.reshape(-1, block).astype(np.float64)
        yb = y.reshape(-1, block).astype(np.float64)
        amax = np.abs(x.reshape(-1, block)).max(-1, keepdims=True)  # float32, as NeMo's scales are computed
        if fmt == "fp8":
            scale = _pow2_ceil(np.maximum(amax, np.float32(1e-4)) * np.float32(1 / 448))
            grid = (yb / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        else:
            if fmt == "mxfp4":
                scale = _pow2_ceil(np.maximum(amax, np.float32(6 * 2.0**-126)) * np.float32(1 / 6))
            else:  # an E4M3 scale, saturating at 448
                scale = np.minimum(np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6), np.float32(448))
                scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            grid = fp4[np.abs(np.abs(yb / scale)[..., None] - fp4).argmin(-1)] * np.sign(yb)
        np.testing.assert_array_equal(yb, grid * scale, err_msg=f"{fmt}: values off the format's grid")
        # The input puts values exactly on rounding midpoints between grid points.
        ratio = np.abs(xb / scale)
        if fmt == "fp8":
            levels = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)))
            levels = levels[np.isfinite(levels)]
        else:
            levels = fp4
        mids = (levels[1:] + levels[:-1]) / 2
        assert np.isin(ratio, mids).mean() > 0.05, fmt


def test_vision_case(reference_v41):
    """The vision case: the checkpoint carries the vision tower under the release names (§4.4), and each image's
    processor outputs, ViT features, aligner rows and span length agree with one another; the prompt's span is
    image 0's."""
    spec = next(c for c in CASES if c["name"] == "vision")
    raw, folder = spec["config"], reference_v41 / "vision"
    vc, hidden, image_id = raw["vision_config"], raw["text_config"]["hidden_size"], raw["image_token_id"]
    assert json.loads((folder / "ckpt" / "config.json").read_text()) == PRESETS["tiny-v4.1-vision"]
    w = load_file(folder / "ckpt" / "model.safetensors")
    vision = {k: t for k, t in w.items() if k.startswith(("vision.", "aligner.", "image_"))}
    assert len(vision) == 10 + 8 * vc["num_hidden_layers"] and {t.dtype for t in w.values()} == {np.dtype(np.float32)}
    assert vision["aligner.w1.weight"].shape == (hidden, 9 * vc["hidden_size"])
    assert vision["vision.blocks.1.mlp.w1.weight"].shape == (2 * vc["intermediate_size"], vc["hidden_size"])
    assert all(t.std() > 0.05 for t in vision.values())
    for i, (width, height) in enumerate(spec["vision"]["image_sizes"]):
        n_h, n_w = grid = _load(folder, f"vision_grid_{i}.npy")
        rows_h, rows_w = -(-n_h // 3), -(-n_w // 3)
        assert (_load(folder, f"vision_canvas_{i}.npy") == 14 * grid).all()
        assert _load(folder, f"vision_patches_{i}.npy").shape == (n_h * n_w, 3, 14, 14)
        features, rows = _load(folder, f"vision_features_{i}.npy"), _load(folder, f"vision_rows_{i}.npy")
        assert features.shape == (n_h * n_w, vc["hidden_size"]) and rows.shape == (rows_h * rows_w, hidden)
        assert 0.5 < features.std() < 2 and 0.5 < rows.std() < 2
        tokens = int(_load(folder, f"vision_tokens_{i}.npy"))
        assert tokens == rows_h * (rows_w + 1) + 2 <= vc["max_image_tokens"] and n_h * n_w * 196 >= vc["min_pixels"]
        if width * height > 2e6:  # shrunk to the token cap
            assert tokens > 0.9 * vc["max_image_tokens"] and n_w * 14 < width
    ids, types = _load(folder, "vision_input_ids.npy"), _load(folder, "vision_token_types.npy")
    mask = _load(folder, "vision_image_mask.npy")
    assert ids.shape == types.shape == mask.shape == (1, len(ids[0])) and (mask == (types >= 0)).all()
    assert (ids[mask] == image_id).all() and (ids[~mask] != image_id).all() and ids[0, 0] == raw["bos_token_id"]
    assert mask.sum() == int(_load(folder, "vision_tokens_0.npy"))
    for variant in ("identity", "quantized"):
        logits = _load(folder, f"vision_logits_{variant}.npy")
        assert logits.shape == (*ids.shape, 256) and np.isfinite(logits).all() and 0.3 < logits.std() < 10
