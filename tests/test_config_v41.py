"""V41Config: the presets read and round-trip, the release's layer roles are the spec's §2.1 table, the rope
tables are §2.5's, and every invalid config is refused with a message naming the problem."""

import copy
import json
import math
import re

import numpy as np
import pytest

from dsjax.config import ConfigError, QuantConfig
from dsjax.config_v41 import FULL, REINDEX, REUSE, SLIDING_ONLY, V41Config
from dsjax.layers.rope import inv_freq
from dsjax.presets import PRESETS

PRESET_NAMES = ("v4.1-flash", "tiny-v4.1")


def _tiny(**text_changes) -> dict:
    """The tiny preset's config.json dict with `text_config` keys replaced."""
    raw = copy.deepcopy(PRESETS["tiny-v4.1"])
    raw["text_config"].update(text_changes)
    return raw


# ------------------------------------------------------------------------------------------ presets

@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_load_and_round_trip_through_to_hf(name):
    cfg = V41Config.preset(name)
    assert V41Config.from_hf(cfg.to_hf()) == cfg
    assert V41Config.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg  # through JSON text


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_round_trip_through_a_config_file(tmp_path, name):
    cfg = V41Config.preset(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    assert V41Config.from_hf(tmp_path) == cfg  # the folder
    assert V41Config.from_hf(tmp_path / "config.json") == cfg  # the file
    assert V41Config.from_hf(str(tmp_path / "config.json")) == cfg


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_to_hf_writes_back_every_key_of_the_preset(name):
    """to_hf reproduces the preset's config.json (the release's text for v4.1-flash) key by key; `use_cache`
    is a training-only key dsjax does not keep."""
    raw, hf = PRESETS[name], V41Config.preset(name).to_hf()
    for key, value in raw.items():
        if key in ("text_config", "vision_config"):
            for k, v in value.items():
                if k != "use_cache":
                    assert hf[key][k] == v, f"{key}.{k}"
        else:
            assert hf[key] == value, key


def test_release_preset_values_are_the_spec_table():
    """A few values of spec §1.4 written out by hand, through the parsed config."""
    cfg = V41Config.preset("v4.1-flash")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (129280, 5120, 40, 64)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (512, 64, 1280, 8,
                                                                                                  1024)
    assert cfg.rms_norm_eps == 1e-20
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 512)
    assert (cfg.candidate_source_layer_id, cfg.candidate_topk_blocks, cfg.candidate_block_size) == (20, 2048, 8)
    assert cfg.engram_num_embeddings == (384006168, 384016682)
    assert cfg.engram_hash_heads == 24
    assert cfg.quantization == QuantConfig((32, 32), "ue8m0", "fp4")
    assert cfg.vision is not None and cfg.vision.num_hidden_layers == 32
    assert cfg.image_token_id == 129264 and cfg.eos_token_id == (1,)


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match=r"unknown DeepSeek-V4.1 preset 'tiny'; choose from \['demo-v4.1', "
                                          r"'tiny-v4.1', 'tiny-v4.1-vision', 'v4.1-flash'\]"):
        V41Config.preset("tiny")


def test_a_bare_text_config_reads():
    text = copy.deepcopy(PRESETS["v4.1-flash"]["text_config"])
    assert text["model_type"] == "deepseek_v41_text"
    cfg = V41Config.from_hf(text)
    # The top level (quantization, vision) is absent; everything the text config holds is the release's.
    assert cfg == V41Config.preset("v4.1-flash").replace(quantization=None, vision=None)


def test_a_bare_text_config_reads_its_own_image_token_id():
    text = {**copy.deepcopy(PRESETS["tiny-v4.1"]["text_config"]), "image_token_id": 255}
    cfg = V41Config.from_hf(text)
    assert cfg.image_token_id == 255
    assert cfg == V41Config.preset("tiny-v4.1")


# ------------------------------------------------------------------------------------- layer roles

def _spec_roles() -> list[tuple]:
    """Spec §2.1's table, by hand: (ratio, mode, kv source, uses candidates, candidate source, Engram position)."""
    rows = [(0, SLIDING_ONLY, None, False, False, None), (0, SLIDING_ONLY, None, False, False, 0)]
    for full in (2, 8, 14):  # a Full ratio-2 source, then five Reuse layers of it
        rows.append((2, FULL, full, False, False, 1 if full == 14 else None))
        rows += [(2, REUSE, full, False, False, None)] * 5
    rows.append((1, FULL, 20, False, True, None))  # layer 20: the candidate source
    rows += [(1, REUSE, 20, False, False, None)] * 3  # 21-23
    for _ in (24, 28, 32, 36):  # a Reindex layer inside 20's candidates, three Reuse layers of it
        rows.append((1, REINDEX, 20, True, False, None))
        rows += [(1, REUSE, 20, False, False, None)] * 3
    return rows


def test_release_layer_roles_are_the_spec_table():
    cfg = V41Config.preset("v4.1-flash")
    roles = cfg.layer_roles()
    expected = _spec_roles()
    assert len(expected) == 40 == len(roles)
    for i, (role, want) in enumerate(zip(roles, expected)):
        got = (role.ratio, role.mode, role.kv_source, role.uses_candidates, role.candidate_source, role.engram)
        assert role.index == i
        assert got == want, f"layer {i}: {got} != {want}"
    assert [r.index for r in roles if r.mode == REINDEX] == [24, 28, 32, 36]
    assert [r.index for r in roles if r.engram is not None] == [1, 14]


def test_tiny_layer_roles():
    """The tiny preset's schedule as its comment states it: 0-1 sliding (Engram before 1), 2 Full ratio 2, 3 a
    Reindex of 2 (Engram before it; no candidate source precedes it), 4 the Full candidate source, 5 Reuse,
    6 Reindex inside 4's pool, 7 Reuse."""
    roles = V41Config.preset("tiny-v4.1").layer_roles()
    got = [(r.ratio, r.mode, r.kv_source, r.uses_candidates, r.candidate_source, r.engram) for r in roles]
    assert got == [(0, SLIDING_ONLY, None, False, False, None), (0, SLIDING_ONLY, None, False, False, 0),
                   (2, FULL, 2, False, False, None), (2, REINDEX, 2, False, False, 1),
                   (1, FULL, 4, False, True, None), (1, REUSE, 4, False, False, None),
                   (1, REINDEX, 4, True, False, None), (1, REUSE, 4, False, False, None)]


def test_first_decoder_layer():
    assert V41Config.preset("v4.1-flash").first_decoder_layer == 20
    assert V41Config.preset("tiny-v4.1").first_decoder_layer == 4
    # No ratio-1 layer: the whole stack is the encoder.
    no_ratio_1 = V41Config.from_hf(_tiny(compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2], kv_source_layer_ids=[2, 4],
                                         index_source_layer_ids=[2, 3, 4, 6]))
    assert no_ratio_1.first_decoder_layer == 8


# ------------------------------------------------------------------------------------------- RoPE

def test_rope_tables():
    cfg = V41Config.preset("v4.1-flash")
    main, comp = cfg.rope_main, cfg.rope_compress
    assert main.theta == 10000 and main.rope_type == "default" and main.scaling() == 1.0
    assert comp.theta == 160000 and comp.rope_type == "yarn" and comp.factor == 16
    assert comp.original_max_position_embeddings == 65536 and (comp.beta_fast, comp.beta_slow) == (32, 1)
    assert comp.attention_factor == 1.0 and comp.scaling() == 1.0  # YaRN on frequencies only
    assert main.rope_dim(cfg.head_dim) == comp.rope_dim(cfg.head_dim) == 64
    assert cfg.rope_for_ratio(0) == main and cfg.rope_for_ratio(1) == comp and cfg.rope_for_ratio(2) == comp


def test_rope_frequencies_follow_spec_formula():
    """Spec §2.5 in float64: base θ^(−2i/64); for θ = 160000 low = 15, high = 25, ramp = clip((i − low)/(high −
    low), 0, 1), frequency = base/16·ramp + base·(1 − ramp)."""
    cfg = V41Config.preset("v4.1-flash")
    i = np.arange(32, dtype=np.float64)
    base_main = 10000.0 ** (-2 * i / 64)
    np.testing.assert_allclose(inv_freq(cfg.rope_main, cfg.head_dim), base_main, rtol=1e-6)
    theta = 160000.0
    low = math.floor(64 * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(64 * math.log(65536 / (1 * 2 * math.pi)) / (2 * math.log(theta)))
    assert (low, high) == (15, 25)
    base = theta ** (-2 * i / 64)
    ramp = np.clip((i - low) / (high - low), 0, 1)
    np.testing.assert_allclose(inv_freq(cfg.rope_compress, cfg.head_dim), base / 16 * ramp + base * (1 - ramp),
                               rtol=1e-6)


# ------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("changes, message", [
    ({"compress_ratios": [0, 0, 2, 2, 4, 1, 1, 1]},
     "compress_ratios may hold only 0, 1 or 2 in DeepSeek-V4.1; got [4]"),
    ({"compress_ratios": [0, 0, 2, 2, 1, 1, 1, 128]}, "compress_ratios may hold only 0, 1 or 2"),
    ({"kv_source_layer_ids": [2, 4, 5]},
     "every KV source must be an index source: kv_source_layer_ids [2, 4, 5], index_source_layer_ids [2, 3, 4, 6]"),
    # Layer 4 (ratio 1) would read layer 2's ratio-2 entries.
    ({"kv_source_layer_ids": [2], "candidate_source_layer_id": -1},
     "compressed layer 4 (ratio 1) needs a preceding KV source of the same ratio"),
    # Layer 2 is compressed with no KV source at or before it.
    ({"kv_source_layer_ids": [4]}, "compressed layer 2 (ratio 2) needs a preceding KV source of the same ratio"),
    ({"kv_source_layer_ids": [1, 2, 4], "index_source_layer_ids": [1, 2, 3, 4, 6]},
     "layer 1 has compress ratio 0 but is listed as a KV or index source"),
    ({"index_source_layer_ids": [0, 2, 3, 4, 6]}, "layer 0 has compress ratio 0 but is listed"),
    ({"candidate_source_layer_id": 3}, "candidate_source_layer_id 3 must be a KV source ([2, 4])"),
    ({"candidate_source_layer_id": 6}, "candidate_source_layer_id 6 must be a KV source"),
    ({"engram_num_embeddings": [384]},
     "engram_num_embeddings (1 entries) needs one row count per Engram layer ([1, 3])"),
    ({"engram_num_embeddings": [384, 552, 600]}, "engram_num_embeddings (3 entries) needs one row count"),
    ({"num_hash_layers": 3}, "DeepSeek-V4.1 has no hash-routed layers (num_hash_layers)"),
    ({"num_hash_layers": 0}, "no hash-routed layers"),  # present at all, even as 0
    ({"scoring_func": "softmax"}, "scoring_func is 'softmax'"),
])
def test_invalid_configs_name_the_problem(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        V41Config.from_hf(_tiny(**changes))


def test_quantization_with_128_blocks_is_refused():
    raw = copy.deepcopy(PRESETS["v4.1-flash"])
    raw["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(ConfigError, match=re.escape("quantization_config: DeepSeek-V4.1 stores FP8 weights in 32 × 32 "
                                                    "blocks with ue8m0 scales; got weight_block_size [128, 128]")):
        V41Config.from_hf(raw)
    raw["quantization_config"].update(weight_block_size=[32, 32], scale_fmt="float")
    with pytest.raises(ConfigError, match="scale_fmt 'float'"):
        V41Config.from_hf(raw)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41_vision", None])
def test_other_model_types_are_refused(model_type):
    raw = copy.deepcopy(PRESETS["tiny-v4.1"])
    raw["model_type"] = model_type
    with pytest.raises(ConfigError, match=re.escape(f"model_type is {model_type!r}; a DeepSeek-V4.1 config has "
                                                    "'deepseek_v41'")):
        V41Config.from_hf(raw)


def test_bad_config_paths_are_named(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))} does not exist$"):
        V41Config.from_hf(missing)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))} has no config.json$"):
        V41Config.from_hf(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "deepseek_v41", ')
    with pytest.raises(ConfigError, match=f"^{re.escape(str(bad))} is not valid JSON"):
        V41Config.from_hf(tmp_path)
    # A validation error from a file names the file too.
    bad.write_text(json.dumps(_tiny(compress_ratios=[0, 0, 2, 2, 4, 1, 1, 1])))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(bad))}: compress_ratios may hold only 0, 1 or 2"):
        V41Config.from_hf(bad)


def test_config_is_frozen_and_checked_on_replace():
    cfg = V41Config.preset("tiny-v4.1")
    with pytest.raises(Exception):
        cfg.hidden_size = 3  # type: ignore[misc]
    with pytest.raises(ConfigError, match="candidate_source_layer_id 3 must be a KV source"):
        cfg.replace(candidate_source_layer_id=3)
