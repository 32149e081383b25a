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
    # DeepSeek-V4.1-Flash: the V4 architecture with 40 decoder layers and ~552B parameters, as DeepSeek
    # describes it. DeepSeek has not published the remaining dimensions; ours keep every V4-Flash
    # attention, mHC and indexer dimension and grow the routed-expert pool, which is where V4 keeps its
    # parameters: 544 routed experts (68 per GPU on 8, 17 per GPU on 32) of width 2048, 6 active per
    # token, as in V4-Flash. The first 3 layers stay hash-routed and the CSA/HCA schedule is the
    # reference default truncated to 40 layers. Total: see `dsjax info --preset v4.1-flash`.
    # Its image encoder (dsjax's design: no V4.1 vision weights or code are public; `layers/vision.py`):
    # a 24-layer ViT of width 1024 (16 heads, MLP 4096) over 14-pixel patches, 3×3 patches merged into
    # one decoder embedding by a 2-layer MLP: 357M parameters, kept in bf16.
    "v4.1-flash": {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 40,
        "n_routed_experts": 544,
        "vision_config": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "intermediate_size": 4096},
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
