"""`dsjax info`: parameter counts from abstract shapes, checked against the reference's meta-device count."""

import json
import math

import jax.numpy as jnp
import pytest

from dsjax.cache import cache_bytes_per_token
from dsjax.cli import main
from dsjax.config import ConfigError, ModelConfig
from dsjax.config_v41 import V41Config
from dsjax.info import COMPONENTS, model_info, v41_cache_bytes, v41_model_info


def test_v4_flash_count_matches_reference(reference):
    ref = json.loads((reference / "param_counts.json").read_text())["v4-flash"]
    info = model_info(ModelConfig.preset("v4-flash"))
    assert info.total == ref
    assert sum(info.by_component.values()) == info.total
    assert set(info.by_component) == set(COMPONENTS)


def test_v41_flash_counts_are_the_releases():
    """deepseek_v41_spec.md §1.6: backbone 551.6B (the release says 552B), Engram tables 196.6B
    (768,022,850 rows × 256); about 510 GB in the release's storage (48 shards)."""
    info = v41_model_info(V41Config.preset("v4.1-flash"))
    assert abs(info.backbone - 551.6e9) < 0.05e9
    assert info.by_component["engram_tables"] == (384006168 + 384016682) * 256
    assert info.total == sum(info.by_component.values())
    assert abs(info.release_bytes - 510e9) / 510e9 < 0.01
    assert 15e9 < info.active < 17e9


def test_v41_flash_counts_the_released_image_encoder():
    """The encoder of spec §1.5 / §4.4, counted from its layer shapes: patch embedding 588 → 1024 with bias,
    32 blocks (two norms, qkv and output projections with bias, SwiGLU of 2816 without), the final norm,
    the aligner 9216 → 5120 → 5120 with biases and the three learned delimiters: 485,268,480 parameters,
    outside the backbone and the active count."""
    d, inter, h = 1024, 2816, 5120
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * inter * d + d * inter
    want = (588 * d + d) + 32 * block + d + (9 * d * h + h) + (h * h + h) + 3 * h
    cfg = V41Config.preset("v4.1-flash")
    info, text_only = v41_model_info(cfg), v41_model_info(cfg.replace(vision=None))
    assert info.by_component["vision"] == want == 485_268_480 == info.total - text_only.total
    assert info.active == text_only.active and info.backbone == text_only.backbone


def test_v41_cache_bytes_are_the_releases():
    """890 B per token of global cache with NVFP4 entries (3 · 288 / 2 + 288 entries, 3 · 68 / 2 + 68 index keys);
    1490 with MXFP8 entries; each sequence's 40 window rings of 128 MXFP8 rows of 528 B."""
    cfg = V41Config.preset("v4.1-flash")
    assert v41_cache_bytes(cfg)["global_per_token"] == 890
    assert v41_cache_bytes(cfg, "fp8")["global_per_token"] == 1490
    assert v41_cache_bytes(cfg)["windows_per_sequence"] == 40 * 128 * 528


def test_info_cli(capsys):
    assert main(["info", "--preset", "v4-flash"]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "active per token" in out
    assert "cache per token" in out and "compressed_sparse_attention" in out


def test_info_cli_v41(capsys):
    assert main(["info", "--preset", "v4.1-flash"]) == 0
    out = capsys.readouterr().out
    assert "backbone 551.57B" in out and "tables 196,613,849,600" in out and "DSpark 14.23B" in out
    assert "890 B per token" in out and "1,490 B per token" in out and "reindex×4" in out


def test_image_encoder_matches_a_hand_count():
    """dsjax's own encoder (the V4 demo's, `tiny-vision`): patch embedding, pre-norm blocks (qkv, output,
    2-layer MLP, all with biases; 2 norms), a final norm, the 3×3 merger's 2 layers into the decoder's width
    and 3 learned embeddings. It is not active per text token."""
    cfg = ModelConfig.preset("tiny-vision")
    hv, layers, inter, d = cfg.vision.hidden_size, cfg.vision.num_layers, cfg.vision.intermediate_size, cfg.hidden_size
    block = 2 * hv + (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + (hv * inter + inter) + (inter * hv + hv)
    want = (14 * 14 * 3 * hv + hv) + layers * block + hv + (9 * hv * d + d) + (d * d + d) + 3 * d
    info, text_only = model_info(cfg), model_info(cfg.replace(vision=None))
    assert info.by_component["vision"] == want == info.total - text_only.total
    assert info.active == text_only.active and text_only.by_component["vision"] == 0


def test_info_cli_bad_preset(capsys):
    assert main(["info", "--preset", "v9"]) == 2
    assert "unknown preset" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "v4-flash"])
def test_presets_build(name):
    ModelConfig.preset(name).validate()


def test_a_v41_preset_is_refused_by_the_v4_config_with_a_pointer():
    with pytest.raises(ConfigError, match="DeepSeek-V4.1 config: read it with dsjax.config_v41.V41Config"):
        ModelConfig.preset("v4.1-flash")


def _fp8(rows, cols):  # e4m3 bytes + one ue8m0 byte per 128×128 block
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


def test_v4_flash_weight_bytes_match_a_hand_count():
    """FP8 dense linears with ue8m0 block scales, FP4 routed experts (one ue8m0 per row per 32 inputs),
    and the rest as the reference keeps it: bf16 embedding/head/router/compressor projections, fp32
    norms/mHC/sinks/biases, and our int32 hash table."""
    V, H, E, I, Hc = 129280, 4096, 256, 2048, 4  # noqa: N806
    f32 = lambda n: 4 * n  # noqa: E731
    bf16 = lambda r, c: 2 * r * c  # noqa: E731
    attention = (_fp8(1024, H) + _fp8(64 * 512, 1024) + _fp8(512, H) + _fp8(8 * 1024, 64 * 512 // 8)
                 + _fp8(H, 8 * 1024) + f32(1024 + 512 + 64))
    csa = (2 * bf16(2 * 512, H) + f32(4 * 2 * 512 + 512)  # compressor
           + 2 * bf16(2 * 128, H) + f32(4 * 2 * 128 + 128) + _fp8(64 * 128, 1024) + bf16(64, H))  # indexer
    hca = 2 * bf16(512, H) + f32(128 * 512 + 512)
    per_layer = attention + 2 * f32((2 + Hc) * Hc * Hc * H + (2 + Hc) * Hc + 3) + f32(2 * H)
    shared = 2 * _fp8(I, H) + _fp8(H, I)
    moe_fp4 = E * (2 * I * H // 2 + 2 * I * H // 32) + E * (H * I // 2 + H * I // 32)
    moe_fp8 = E * (_fp8(2 * I, H) + _fp8(H, I))
    routing = {"hash": bf16(E, H) + 4 * V * 6, "topk": bf16(E, H) + f32(E)}
    top = 2 * bf16(V, H) + f32(H) + f32(Hc * Hc * H + Hc + 1)
    layers = 43 * (per_layer + shared) + 20 * csa + 23 * hca + 3 * routing["hash"] + 40 * routing["topk"]
    info = model_info(ModelConfig.preset("v4-flash"))
    assert info.bytes_fp4_experts == top + layers + 43 * moe_fp4
    assert info.bytes_fp8 == top + layers + 43 * moe_fp8
    assert abs(info.bytes_fp4_experts / 2**30 - 145.3) < 0.05


def test_v4_flash_cache_bytes_per_token_match_a_hand_count():
    """Per token of context at 1M tokens: entries grow per token; the window ring and the compressors'
    partial-window buffers (float) are fixed and spread over the context."""
    ctx, d, c, w = 1 << 20, 512, 128, 128
    row = {"bfloat16": 2 * d, "fp8": 448 + 4 * 7 + 2 * 64, "fp4": 448 // 2 + 448 // 32 + 2 * 64}
    index_row = {"bfloat16": 2 * c, "fp8": c + 4, "fp4": c + 4}  # indexer keys: fp8 once quantized
    for kv in ("bfloat16", "fp8", "fp4"):
        csa_fixed = w * row[kv] + 2 * 2 * (4 * 2 * d + 4 * d) + 2 * 2 * (4 * 2 * c + 4 * c)
        hca_fixed = w * row[kv] + 2 * 2 * 128 * d
        want = {"compressed_sparse_attention": (ctx // 4 * (row[kv] + index_row[kv]) + csa_fixed) / ctx,
                "heavily_compressed_attention": (ctx // 128 * row[kv] + hca_fixed) / ctx}
        got = cache_bytes_per_token(ModelConfig.preset("v4-flash"), ctx, jnp.bfloat16, kv)
        assert got == pytest.approx(want, rel=1e-12), kv
    assert row["fp8"] == 604 and row["fp4"] == 366  # vs FlashMLA's 656 and SGLang's 400 for V3's 512+64


def test_info_cli_reports_cache_per_kv_dtype(capsys):
    assert main(["info", "--preset", "v4-flash"]) == 0
    out = capsys.readouterr().out
    for kv in ("bfloat16", "fp8", "fp4"):
        assert f"kv_dtype {kv}" in out
    assert "fp8+fp4 experts 145.3 GiB" in out
