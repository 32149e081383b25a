"""ModelConfig: derivation from HF configs (legacy keys included) matches the reference; round trips."""

import json
import re

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


TINY = ModelConfig.preset("tiny").to_hf()


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "big", "hidden_size must be a positive integer, got 'big'"),
    ("hidden_size", True, "hidden_size must be a positive integer, got True"),  # bools are not ints here
    ("hidden_size", 256.5, "hidden_size must be a positive integer, got 256.5"),
    ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
    ("num_hidden_layers", None, "num_hidden_layers must be a positive integer, got None"),
    ("num_hidden_layers", -1, "num_hidden_layers must be a positive integer, got -1"),
    ("vocab_size", -5, "vocab_size must be a positive integer, got -5"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
    ("head_dim", 0, "head_dim must be a positive integer, got 0"),
    ("n_routed_experts", 0, "n_routed_experts must be a positive integer, got 0"),
    ("num_experts_per_tok", 0, "num_experts_per_tok must be a positive integer, got 0"),
    ("o_groups", 0, "o_groups must be a positive integer, got 0"),
    ("hc_sinkhorn_iters", -1, "hc_sinkhorn_iters must be a non-negative integer, got -1"),
    ("layer_types", 5, "layer_types must be a list of strings, got 5"),
    ("mlp_layer_types", ["moe", 3, "moe", "moe"], r"mlp_layer_types\[1\] must be a string, got 3"),
    ("eos_token_id", "x", "eos_token_id must be a non-negative integer, got 'x'"),
    ("eos_token_id", [1, "x"], r"eos_token_id\[1\] must be a non-negative integer, got 'x'"),
    ("bos_token_id", -1, "bos_token_id must be a non-negative integer, got -1"),
    ("rope_parameters", "yes", "rope_parameters must be an object, got 'yes'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": "4"}, "rope_scaling.factor must be a finite number, got '4'"),
    ("rope_scaling", {"main": {"rope_theta": "x"}, "compress": {}},
     "rope_scaling.main.rope_theta must be a finite number, got 'x'"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a finite number, got '1e-6'"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number, got nan"),
    ("mlp_bias", "no", "mlp_bias must be true or false, got 'no'"),
    ("compress_rates", 3, "compress_rates must be an object, got 3"),
    ("compress_rates", {"compressed_sparse_attention": "4"},
     "compress_rates.compressed_sparse_attention must be a non-negative integer, got '4'"),
    ("quantization_config", "fp8", "quantization_config must be an object, got 'fp8'"),
    ("quantization_config", {"weight_block_size": [128, "x"]},
     r"quantization_config.weight_block_size\[1\] must be a positive integer, got 'x'"),
    ("vision_config", {"hidden_size": True, "num_layers": 1, "num_heads": 2, "intermediate_size": 8},
     "vision_config.hidden_size must be a positive integer, got True"),
])
def test_wrong_field_types_and_values_name_the_field(key, value, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        ModelConfig.from_hf({**TINY, key: value})


def test_integral_floats_read_as_ints():
    """JSON has one number type: 64.0 is the integer 64 (as int() always read it)."""
    cfg = ModelConfig.from_hf({**TINY, "hidden_size": 64.0, "num_hidden_layers": 4.0})
    assert cfg == ModelConfig.preset("tiny")
    assert type(cfg.hidden_size) is int and type(cfg.num_hidden_layers) is int


def test_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "hidden_size": "big"}))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: hidden_size must be a positive integer, "
                                          "got 'big'$"):
        ModelConfig.from_hf(tmp_path)
    path.write_text(json.dumps({**TINY, "scoring_func": "softmax"}))  # a check of the whole config
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: scoring_func must be one of"):
        ModelConfig.from_hf(path)


@pytest.mark.parametrize("text, message", [
    (json.dumps(TINY)[:40], r"is not valid JSON \(line 1, column 31: Unterminated string starting at\)"),
    ("hello", r"is not valid JSON \(line 1, column 1: Expecting value\)"),
    ('{"hidden_size": 64,\n "vocab_size": }', r"is not valid JSON \(line 2, column 16: Expecting value\)"),
    ("", "is empty; expected a JSON object"),
    ("[1, 2]", "must hold a JSON object, got an array"),
    ('"deepseek_v4"', "must hold a JSON object, got a string"),
    (b"\xff\xfe{\x00\xff", r"is not valid JSON \(not UTF-8 text"),
], ids=["truncated", "hello", "error on line 2", "empty", "an array", "a string", "not UTF-8"])
def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))} {message}"):
        ModelConfig.from_hf(tmp_path)


def test_missing_config_files_and_folders_are_named(tmp_path):
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))} has no config.json$"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'nope'))} does not exist$"):
        ModelConfig.from_hf(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01")  # a file where a folder or config.json was meant
    with pytest.raises(ConfigError, match=r"weights\.bin is not valid JSON"):
        ModelConfig.from_hf(tmp_path / "weights.bin")
