"""ModelConfig: derivation from HF configs (legacy keys included) matches the reference; round trips."""

import json

import pytest

from dsjax.config import CSA, HCA, SLIDING, ConfigError, ModelConfig
from tests.reference.spec import CONFIGS


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_derived_fields_match_reference(reference, i):
    ref = json.loads((reference / "configs.json").read_text())[i]
    cfg = ModelConfig.from_hf(CONFIGS[i])
    assert list(cfg.layer_types) == ref["layer_types"]
    assert list(cfg.mlp_layer_types) == ref["mlp_layer_types"]
    assert cfg.compress_rate_csa == ref["compress_rates"][CSA]
    assert cfg.compress_rate_hca == ref["compress_rates"][HCA]
    assert cfg.qk_rope_head_dim == ref["qk_rope_head_dim"]
    for label, rope in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        r = ref["rope_parameters"][label]
        assert rope.rope_type == r["rope_type"]
        assert rope.theta == r["rope_theta"]
        assert rope.partial_rotary_factor == pytest.approx(r.get("partial_rotary_factor", 1.0))
        if rope.rope_type == "yarn":
            assert rope.factor == r["factor"]
            assert rope.original_max_position_embeddings == r["original_max_position_embeddings"]


def test_default_schedule_is_three_hca_then_alternating():
    cfg = ModelConfig.preset("v4-flash")
    assert cfg.num_hidden_layers == 43
    assert cfg.layer_types[:5] == (HCA, HCA, HCA, CSA, HCA)
    assert SLIDING not in cfg.layer_types
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_to_hf_round_trips(i):
    cfg = ModelConfig.from_hf(CONFIGS[i])
    again = ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf())))
    assert again == cfg


def test_from_hf_reads_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_hf()))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.preset("tiny")


@pytest.mark.parametrize("raw, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention"]}, "len(layer_types)"),
    ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "layer_types entries"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"compress_ratios": [0, 4, 64]}, "compress_ratios"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_attention_heads": 6, "o_groups": 4}, "o_groups"),
])
def test_invalid_configs_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(raw)


def test_config_is_frozen():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(Exception):
        cfg.hidden_size = 3  # type: ignore[misc]
