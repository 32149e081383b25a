"""Named model presets, as data: each is a transformers-style `config.json` dict for `ModelConfig.from_hf`."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CPU tests and demos, yet every layer type (sliding, CSA, HCA), both MLP types,
    # YaRN on the compress rope, and windows that close within a few dozen tokens.
    "tiny": {
        "model_type": "deepseek_v4",
        "vocab_size": 512,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "num_experts_per_tok": 2,
        "n_routed_experts": 8,
        "layer_types": ["sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 256,
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
    },
    # The embedded default model (`dsjax/embedded/`), trained by `scripts/train_tiny.py`: every V4
    # component at a size whose bf16 weights fit the 25 MB package budget. Its 8,192-token vocabulary
    # is DeepSeek-V4's own, cut to the first merges (`dsjax/training/tokenizer.py`). Training rows of
    # 512 tokens see up to 128 CSA entries (32 picked) and 32 HCA entries past the 64-token window.
    "demo": {
        "model_type": "deepseek_v4",
        "vocab_size": 8192,
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 128,
        "num_experts_per_tok": 2,
        "n_routed_experts": 8,
        "layer_types": ["sliding_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 2048,
        "sliding_window": 64,
        "o_groups": 2,
        "o_lora_rank": 64,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 32,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    # DeepSeek-V4-Flash: the reference's default dimensions (DeepseekV4Config()), 43 layers.
    "v4-flash": {"model_type": "deepseek_v4"},
    # DeepSeek-V4.1-Flash as released (deepseek-ai/DeepSeek-V4.1-Flash, 2026-09-10): the text of its nested
    # config.json (../shared/reference/deepseek_v41_spec.md §1). A 40-layer causal encoder-decoder with CSA2,
    # Engram and single-pass mHC, a 32-layer image encoder, three DSpark draft stages; FP8 weights in 32×32
    # blocks with UE8M0 scales, FP4 routed experts.
    "v4.1-flash": {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "image_token_id": 129264,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 129280,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": 1048576,
            "rope_theta": 10000,
            "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 65536},
            "compress_rope_theta": 160000,
            "n_routed_experts": 384,
            "num_experts_per_tok": 6,
            "n_shared_experts": 1,
            "moe_intermediate_size": 2304,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "sliding_window": 128,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 16000000,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "num_nextn_predict_layers": 3,
            "dspark_block_size": 5,
            "dspark_noise_token_id": 128799,
            "dspark_target_layer_ids": [37, 38, 39],
            "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128,
            "dspark_num_experts_per_tok": 3,
            "initializer_range": 0.02,
            "use_cache": True,
        },
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
    },
    # V4.1 at CPU-test size, with everything the release schedules: sliding-only layers 0-1, ratio-2 layers
    # 2-3 (2 a Full KV source, 3 a Reindex layer on 2's keys), ratio-1 layers 4-7 (4 the Full candidate
    # source and first decoder layer, 5 a Reuse layer, 6 a Reindex layer inside 4's candidate pool, 7 a
    # Reuse of 6); Engram before layers 1 and 3 over the 256-token vocabulary of `tiny_v41_vocabulary`
    # (123 compressed ids; bucket primes above 49, tables of exactly their sums); candidate blocks of 8
    # (DeepInfer's kernels allow 8 or 16, a multiple of 4 blocks). No image encoder, no DSpark stages.
    "tiny-v4.1": {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "image_token_id": 255,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 256,
            "hidden_size": 64,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "max_position_embeddings": 4096,
            "rope_theta": 10000,
            "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 256},
            "compress_rope_theta": 160000,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "sliding_window": 8,
            "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1],
            "kv_source_layer_ids": [2, 4],
            "index_source_layer_ids": [2, 3, 4, 6],
            "index_n_heads": 8,
            "index_head_dim": 32,
            "index_topk": 8,
            "candidate_source_layer_id": 4,
            "candidate_topk_blocks": 4,
            "candidate_block_size": 8,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 3],
            "engram_num_embeddings": [384, 552],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 50,
            "engram_n_heads": 2,
            "engram_head_dim": 16,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 123,
            "num_nextn_predict_layers": 0,
            "initializer_range": 0.02,
        },
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0},
    },
}

# The trained small V4.1 (`dsjax/embedded/model_v41/`, `scripts/train_tiny_v41.py`): tiny-v4.1's layer
# schedule (4 encoder layers, 4 decoder layers) at the embedded V4 model's width and vocabulary, with three
# DSpark stages on decoder layers 5-7. Rows of 512 tokens give the ratio-1 layers 512 entries, of which the
# candidate pool keeps 8 blocks of 8 and the indexer 32. Engram's vocabulary is the embedded tokenizer's (6,767
# compressed ids) and its pad the EOS. The noise token (id 2, a byte that never occurs in the corpus)
# only ever enters DSpark's draft blocks.
PRESETS["demo-v4.1"] = {
    **PRESETS["tiny-v4.1"],
    "image_token_id": 8183,
    "text_config": {
        **PRESETS["tiny-v4.1"]["text_config"],
        "vocab_size": 8192,
        "hidden_size": 192,
        "q_lora_rank": 96,
        "o_lora_rank": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 512},
        "moe_intermediate_size": 128,
        "sliding_window": 64,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "index_topk": 32,
        "candidate_topk_blocks": 8,
        "engram_num_embeddings": [8058, 8184],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 2000,
        "engram_head_dim": 32,
        "engram_pad_token_id": 1,
        "engram_compressed_vocab_size": 6767,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 2,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
}

# The tiny preset at the shapes the decode kernels tile (16 query heads, 128-wide K=V rows with a 64-wide
# rotary slice, 16 index heads of 64): for tests and exports that must run through the kernels.
PRESETS["tiny-kernels"] = {**PRESETS["tiny"], "num_attention_heads": 16, "head_dim": 128,
                           "partial_rotary_factor": 0.5, "index_head_dim": 64, "sliding_window": 16,
                           "index_topk": 8}

# The tiny preset reading images: a 2-layer image encoder of width 32, for tests of the image path.
PRESETS["tiny-vision"] = {**PRESETS["tiny"], "vision_config": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                               "intermediate_size": 64}}

# The embedded default model as shipped (`dsjax/embedded/model/`): the demo decoder and a 2-layer image
# encoder of width 32, trained by `scripts/train_vision.py` with the decoder frozen (`training/vision.py`).
PRESETS["demo-vision"] = {**PRESETS["demo"], "vision_config": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                               "intermediate_size": 64}}


# The tiny V4.1 preset reading images: the release's ViT and aligner at width 32 (2 blocks of 2 heads), with
# the release's image sizing (patch 14, 3 x 3 cells, the 1,024-token cap, 544² minimum pixels), which
# deepseek-recipe applies whatever the config says.
PRESETS["tiny-v4.1-vision"] = {**PRESETS["tiny-v4.1"], "vision_config": {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
    "intermediate_size": 96, "patch_size": 14, "rope_theta": 10000.0, "downsample_ratio": 3,
    "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None}}


def tiny_v41_vocabulary() -> list[str]:
    """The tiny V4.1 preset's 256-token word-level vocabulary (its `tokenizer.json` holds exactly these, id =
    index). Engram keys tokens by their normalised text, so the words come in spellings that normalise
    alike (case, accents, full-width forms, leading spaces) and whitespace runs that collapse, beside
    plain words: the compressed vocabulary is smaller than the token vocabulary, as the release's is."""
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"]
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "sun", "sky", "red", "blue", "tree", "leaf",
             "rain", "snow", "wind", "fire", "cafe", "naive", "resume", "over", "under", "and", "or", "not",
             "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "is", "was", "it",
             "a"]
    accented = {"cafe": "café", "naive": "naïve", "resume": "résumé"}
    vocab = list(specials)
    for w in words:
        vocab += [w, w.capitalize(), " " + w, " " + w.upper()]
        if w in accented:
            vocab += [accented[w], " " + accented[w].capitalize()]
    vocab += ["ｃａｔ", "ＴＨＥ", "ﬁre", " ", "  ", "\n", "\t", " \n ", ".", ",", "!", "?", ":", ";", "(", ")",
              "\ufffd", "a\ufffd", "'", '"', "-", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    vocab += [f"<tok{i}>" for i in range(256 - 1 - len(vocab))]
    return vocab + ["<｜deepseek_image｜>"]
