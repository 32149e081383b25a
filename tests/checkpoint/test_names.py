"""Original / hybrid / HF names all map to the HF module name."""

import pytest

from dsjax.checkpoint.names import ExpertSlice, to_hf


@pytest.mark.parametrize("name, hf", [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("model.hc_head.hc_scale", "model.hc_head.hc_scale"),
    ("layers.3.attn.wq_a.weight", "model.layers.3.self_attn.q_a_proj.weight"),
    ("model.layers.3.attn.norm.weight", "model.layers.3.self_attn.kv_norm.weight"),
    ("layers.3.attn.kv_norm.weight", "model.layers.3.self_attn.kv_norm.weight"),
    ("layers.0.hc_attn_fn", "model.layers.0.attn_hc.fn"),
    ("layers.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ("layers.1.attn.compressor.norm.weight", "model.layers.1.self_attn.compressor.kv_norm.weight"),
    ("layers.1.attn.indexer.compressor.ape", "model.layers.1.self_attn.compressor.indexer.position_bias"),
    ("layers.1.attn.indexer.weights_proj.weight",
     "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("layers.2.ffn.gate.bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("layers.2.ffn.shared_experts.w3.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"),
    ("model.layers.2.self_attn.q_a_norm.weight", "model.layers.2.self_attn.q_a_norm.weight"),
])
def test_names(name, hf):
    assert to_hf(name) == hf


def test_expert_slices_and_mtp():
    assert to_hf("layers.4.ffn.experts.17.w2.weight") == ExpertSlice("model.layers.4.mlp.experts.down_proj", 17, "w2")
    assert to_hf("model.layers.4.ffn.experts.0.w3.weight").part == "w3"
    assert to_hf("mtp.0.attn.wq_a.weight") is None
    assert to_hf("model.mtp.1.norm.weight") is None
