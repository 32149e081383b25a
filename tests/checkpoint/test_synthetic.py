"""Synthetic release-format checkpoints: the names, dtypes and shapes DeepSeek ships, sharded, loadable."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax.checkpoint.safetensors_io import iter_tensors, read_header
from dsjax.checkpoint.save import save_model
from dsjax.checkpoint.synthetic import write_synthetic
from dsjax.config import ModelConfig, QuantConfig
from dsjax.quantize import quantize_model

ROOT = Path(__file__).resolve().parents[2]


def test_tensors_are_those_of_a_quantized_model_saved_with_release_names(tmp_path):
    cfg = ModelConfig.preset("tiny")
    weight_map = write_synthetic(tmp_path / "syn", cfg, max_shard_bytes=150_000, seed=1)
    save_model(quantize_model(dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)), tmp_path / "ref",
               naming="original")
    ours = {n: (v.dtype, v.shape) for n, _, v in iter_tensors(str(tmp_path / "syn"))}
    ref = {n: (v.dtype, v.shape) for n, _, v in iter_tensors(str(tmp_path / "ref"))}
    assert ours == ref and set(weight_map) == set(ours)
    assert ours["layers.1.ffn.experts.7.w2.weight"] == (np.dtype(np.int8), (64, 16))
    assert ours["layers.1.ffn.experts.7.w2.scale"][0] == np.dtype(ml_dtypes.float8_e8m0fnu)
    assert ours["layers.1.attn.wq_b.weight"][0] == np.dtype(ml_dtypes.float8_e4m3fn)


def test_shards_are_bounded_and_the_model_loads(tmp_path):
    cfg = ModelConfig.preset("tiny")
    write_synthetic(tmp_path, cfg, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".part")]
    mask = os.umask(0)
    os.umask(mask)
    assert {stat.S_IMODE(os.stat(tmp_path / s).st_mode) for s in shards} == {0o666 & ~mask}  # not safetensors' 0600
    for shard in shards:
        refs, _ = read_header(str(tmp_path / shard))
        biggest = max(r.end - r.begin for r in refs.values())
        assert sum(r.end - r.begin for r in refs.values()) <= max(100_000, biggest)
    ids = jnp.asarray([[0, 5, 9, 2, 7, 7, 1, 3]])
    kept = dsjax.load_model(tmp_path)
    assert kept.cfg.quantization.expert_dtype == "fp4"
    logits = np.asarray(kept(ids))
    assert np.isfinite(logits).all() and logits.std() > 0
    np.testing.assert_allclose(np.asarray(dsjax.load_model(tmp_path, weights="bf16")(ids)), logits, rtol=1e-5,
                               atol=1e-6)


def test_only_the_release_format_is_made(tmp_path):
    with pytest.raises(ValueError, match="release format"):
        write_synthetic(tmp_path, ModelConfig.preset("tiny"), quant=QuantConfig(expert_dtype="fp8"))


def test_script_sizes_the_preset(tmp_path):
    out = tmp_path / "v4"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(out),
                           "--preset", "demo", "--layers", "8", "--experts", "4", "--shard-mb", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = ModelConfig.from_hf(out)
    assert cfg.num_hidden_layers == 8 and cfg.n_routed_experts == 4 and cfg.layer_types[-1] == cfg.layer_types[5]
    assert "8 layers, 4 experts" in proc.stdout and "MB/s" in proc.stdout
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py"), str(out)],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr


def test_script_gives_a_v41_preset_another_presets_encoder(tmp_path):
    """`--vision v4.1-flash`: the tiny V4.1 text model with the release-size encoder (what the H200's image job
    runs); a V4 preset or a preset without an encoder is refused by name."""
    from dsjax.config_v41 import V41Config

    script = [sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py")]
    out = tmp_path / "v41"
    proc = subprocess.run([*script, str(out), "--preset", "tiny-v4.1", "--vision", "tiny-v4.1-vision"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = dsjax.load_model(out).cfg
    assert cfg.vision == V41Config.preset("tiny-v4.1-vision").vision and cfg.hidden_size == 64
    for args, message in ((["--preset", "tiny-v4.1", "--vision", "tiny"], "'tiny' is not a V4.1 preset"),
                          (["--preset", "tiny-v4.1", "--vision", "tiny-v4.1"], "has no image encoder"),
                          (["--preset", "tiny", "--vision", "v4.1-flash"], "into a V4.1 preset")):
        bad = subprocess.run([*script, str(tmp_path / "x"), *args], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert not (tmp_path / "x").exists()


def test_script_shrinks_a_v41_slices_engram_tables(tmp_path):
    """`--engram-rows`: a V4.1 slice's Engram tables of about that many rows (bucket primes from a smaller
    start), the layers otherwise as released; refused without --layers and for V4 presets."""
    from dsjax.config_v41 import V41Config

    script = [sys.executable, str(ROOT / "scripts" / "make_synthetic_checkpoint.py")]
    out = tmp_path / "v41"
    proc = subprocess.run([*script, str(out), "--preset", "tiny-v4.1", "--layers", "0,1,2,3", "--engram-rows", "100"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = V41Config.from_hf(out / "config.json")
    whole = V41Config.preset("tiny-v4.1")
    assert cfg.num_hidden_layers == 4 and cfg.engram_layer_ids == (1, 3)
    assert all(a < b for a, b in zip(cfg.engram_num_embeddings, whole.engram_num_embeddings))
    assert dsjax.load_model(out).cfg.engram_num_embeddings == cfg.engram_num_embeddings
    for args, message in ((["--preset", "tiny-v4.1", "--engram-rows", "600"], "give --layers too"),
                          (["--preset", "tiny", "--engram-rows", "600"], "shrinks a V4.1 preset's Engram tables")):
        bad = subprocess.run([*script, str(tmp_path / "x"), *args], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert not (tmp_path / "x").exists()
