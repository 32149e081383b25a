"""What the parity harness runs: two random tiny configurations covering every layer and MLP type."""

from __future__ import annotations

MIXED = {  # sqrtsoftplus, modern keys, YaRN, a repeated [CSA, HCA] run, mlp_bias on.
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 6,
    "num_attention_heads": 4, "head_dim": 32, "partial_rotary_factor": 0.25, "q_lora_rank": 24,
    "num_experts_per_tok": 2, "n_routed_experts": 8, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "max_position_embeddings": 128, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16,
    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "swiglu_limit": 1.0, "mlp_bias": True,
}

LEGACY = {  # sigmoid, the legacy keys (compress_ratios, scalar rates, num_hash_layers, qk_rope_head_dim).
    "vocab_size": 200, "hidden_size": 48, "moe_intermediate_size": 24, "num_hidden_layers": 5,
    "num_attention_heads": 6, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 20,
    "num_experts_per_tok": 3, "n_routed_experts": 6, "scoring_func": "sigmoid", "routed_scaling_factor": 2.0,
    "compress_ratios": [128, 4, 128, 0, 4], "compress_rate_csa": 2, "compress_rate_hca": 6, "num_hash_layers": 2,
    "rope_theta": 5000.0, "compress_rope_theta": 40000.0,
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                     "beta_fast": 16, "beta_slow": 2},
    "max_position_embeddings": 128, "sliding_window": 6, "o_groups": 3, "o_lora_rank": 8,
    "index_n_heads": 16, "index_head_dim": 12, "index_topk": 3, "hc_mult": 3, "hc_sinkhorn_iters": 5,
    "hc_eps": 1e-4, "rms_norm_eps": 1e-5, "swiglu_limit": 0.8,
}

CASES = [
    # generate: prompts shorter than a window, exactly on HCA (and CSA) window boundaries, and between;
    # 32 greedy steps cross further HCA windows and leave partial CSA windows buffered.
    {"name": "mixed", "config": MIXED, "seed": 11, "batch": 2, "seq_lens": [5, 16, 37, 64],
     "generate": {"prompt_lens": [3, 8, 13, 24], "new_tokens": 32}},
    {"name": "legacy", "config": LEGACY, "seed": 23, "batch": 2, "seq_lens": [6, 23, 48],
     "generate": {"prompt_lens": [1, 6, 11, 18], "new_tokens": 32}},
]

# Raw configs whose derived fields (layer schedule, rope tables) are compared with the reference's.
CONFIGS = [
    {},
    MIXED,
    LEGACY,
    {"num_hidden_layers": 7, "compress_ratios": [0, 4, 128, 4, 0, 128, 4]},
    {"num_hidden_layers": 4, "rope_scaling": {"rope_type": "yarn", "factor": 16.0,
                                              "original_max_position_embeddings": 65536}},
    {"num_hidden_layers": 3, "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 90000.0, "factor": 2.0, "partial_rotary_factor": 0.25,
                     "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5}}},
]

PARAM_COUNTS = {"v4-flash": {}}

SPEC = {"cases": CASES, "configs": CONFIGS, "param_counts": PARAM_COUNTS}
